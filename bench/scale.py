"""How cost grows with corpus size (issue 13; a first version: sizes are run one by one, each on
its own data dir, with supplied vectors so no chunk is embedded by the server).

Corpus of size S: every real chunk of a finished ``bench.retrieval`` data dir (SciFact +
WikiText-2 valid, with their MiniLM vectors, read from its snapshot; ``--source``) as
bring-your-own-vector documents (``Doc(chunks=...)``), plus S - real derived one-chunk
distractor documents. Derived chunk i (seeded): base real chunk ``b = rng.integers(real)``;
text = the sentences of b and of a second random real chunk, shuffled (real vocabulary and its
distribution, no new words); vector = normalise(v_b + e), e ~ N(0, sigma^2 I) with sigma =
``--sigma`` / sqrt(D) (cosine to v_b about 1 / sqrt(1 + sigma^2)), so the derived vectors keep
the real vectors' cluster structure. Never uniform random vectors.

Per size (and ``--dense-index``): ingest rate with supplied vectors (wall to the last
acknowledgement, ``ingest_chunks_per_s``; every acknowledged chunk is durable and searchable);
``index_caught_up_s``, the seconds after it until the shards had inserted every deferred vector
into their HNSW graphs (``ShardStats.ann_pending`` 0; the queries start only then), and
``ingest_indexed_chunks_per_s`` = chunks / (ingest + catch-up seconds); a hybrid pass at once
(straight after the ingest: ``retrieve_p50_after_ingest_ms`` / ``retrieve_p95_after_ingest_ms``,
kept in the JSON beside the settled figures), then ``settled_s``, the seconds until no shard had
a BM25 merge pending either (``ShardStats.merge_pending`` 0: the delta of recent writes folded into
the segment by the merge a shard starts once writes have been quiet, as a restart would serve)
nor held a merged segment only in memory (the snapshot that maps it written: the state a served
corpus stays in once writes stopped; the passes below start only then; until 2026-12-03 they
started once no merge was pending, and at 1M the plain pass could run beside that snapshot's
gigabytes of writes: 33 ms p50 vs 16 ms interleaved later in session 22's run); CPU seconds of the server
tree to the catch-up (``ingest_server_cpu_s``, less sensitive to other load; to the last
acknowledgement: ``ingest_server_cpu_at_ack_s``); Retrieve p50/p95 of hybrid
and full_hybrid (SciFact train queries, MiniLM query vectors sent as ``query_vector``; after
:data:`WARMUP` hybrid queries, one mode per pass; and hybrid interleaved with full_hybrid per
query, ``retrieve_p50_interleaved_ms``, whose full scans evict the caches: bench.scale measured
only that way until 2026-12-01),
Recall@10 of hybrid vs full_hybrid, the share of hybrid queries whose top-k the threshold bound
certified and that were widened (0 for a server without it), SciFact nDCG@10 (documents ranked by their best chunk),
RSS of the server process tree (sampled every 0.5 s on a thread: the high-water mark during
ingest and queries, ``rss_peak_bytes``, with when it was sampled, ``rss_peak_at``, and its anonymous
part, ``rss_peak_anon_bytes``; after the queries; and after the restart, without what
ingest left allocated; after the queries and after the restart also its anonymous part,
``rss_anon_bytes`` / ``rss_anon_after_restart_bytes``, without the clean pages of the mapped
snapshot files, :func:`tree_rss_anon`; and once settled after the queries, ``rss_settled_bytes`` /
``rss_anon_settled_bytes``: no merge pending and no merged segment held only in memory, the
snapshot that maps it written, ``settled_after_passes_s`` later), the shards' bytes by component (``Stats``) in total and per chunk,
snapshot bytes, restart-to-READY seconds, and the seconds spent deriving the corpus and in the
whole size. Derived chunks are generated one stream at a time as the ingest consumes them. The
figures so far are rewritten to ``--out`` (default ``bench/out/scale.json``) after every step and
every ``--log-every`` chunks, so a run cut short leaves them.

Growth (``p50_growth_<kind>``, and ``p50_growth_10k_to_1m`` for sizes 10000,...,1000000): the smallest and the
largest size served side by side once both are built, in ``--pair-rounds`` alternating rounds (:func:`paired_growth`;
session 44: the same code's 10K p50 read 2.3 ms one hour and 4.1 ms the next, so the quotient of two passes minutes
apart said more about the machine than about the corpus). The quotient of the two sizes' own passes is kept as
``p50_growth_<kind>_sequential``; ``--pair-only`` measures the growth again over the data dirs a run left.

    python -m bench.scale --source bench/out/retrieval-data --sizes 20000,100000 --json
    python -m bench.scale --sizes 10000,1000000 --dense-index hnsw --queries 100 --pair-only --pair-rounds 12 --json
    python -m bench.scale --source bench/out/retrieval-data --sizes 1000000 --dense-index hnsw --queries 100 --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import (DEFAULT_SHARED, OUT, emit_json, load_queries_qrels, log, machine_info, percentile,
                      read_snapshot, require, start_server)

#: hybrid queries sent (not timed) before the timed passes
WARMUP = 20


def derived(snap: dict, n: int, sigma: float, seed: int = 13, block: int = 2000):
    """``n`` derived chunks (see the module docstring), yielded in blocks of ``block``:
    ``(texts list[str], unit float32[m, D] vectors)``. Generated lazily, so a 1M corpus never
    holds more than one block besides the real chunks (the whole set at once would take ~6 GB
    of float64 intermediates in the bench process)."""
    rng = np.random.default_rng(seed)
    V, texts = snap["vectors"], snap["text"]
    for start in range(0, n, block):
        m = min(block, n - start)
        base = rng.integers(0, len(texts), m)
        other = rng.integers(0, len(texts), m)
        out = []
        for b, o in zip(base.tolist(), other.tolist()):
            sents = [s for s in re.split(r"(?<=[.!?])\s+", texts[b] + " " + texts[o]) if s.strip()]
            rng.shuffle(sents)
            out.append(" ".join(sents))
        vec = V[base] + rng.standard_normal((m, V.shape[1]), dtype=np.float32) * np.float32(sigma / np.sqrt(V.shape[1]))
        yield out, (vec / np.linalg.norm(vec, axis=1, keepdims=True)).astype(np.float32)


def rss_by_process(pid: int, anon: list | None = None) -> dict[str, int]:
    """RSS bytes of ``pid`` (``frontend``) and of its descendants together (``children``: the
    shard processes); with ``anon`` (a list), the tree's anonymous resident bytes (as
    :func:`tree_rss_anon`) appended to it."""
    import psutil

    try:
        p = psutil.Process(pid)
        kids = p.children(recursive=True)
        m = p.memory_info()
    except psutil.Error:
        return {}
    front, rest, shared = m.rss, 0, m.shared
    for q in kids:
        try:
            mq = q.memory_info()
        except psutil.Error:
            continue
        rest, shared = rest + mq.rss, shared + mq.shared
    if anon is not None:
        anon.append(front + rest - shared)
    return {"frontend": front, "children": rest}


def _tree_sum(pid: int, of) -> float:
    """Sum of ``of(process)`` over process ``pid`` and its live descendants (0 once it is gone;
    a child that exits between the listing and the read counts 0)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += of(q)
        except psutil.Error:
            pass
    return total


def tree_rss(pid: int) -> int:
    """RSS bytes of process ``pid`` and all its descendants (0 once it is gone)."""
    return int(_tree_sum(pid, lambda q: q.memory_info().rss))


def tree_rss_anon(pid: int) -> int:
    """Anonymous resident bytes (``RssAnon``: RSS less the file-backed and shared pages, psutil's
    ``rss - shared`` on Linux) of process ``pid`` and all its descendants. The file-backed part
    of the RSS is mostly the snapshot files the shards map read-only (stored fields, BM25
    postings): clean page cache the kernel drops under memory pressure and maps again when read,
    so a fetch's fault-around makes it grow with the pages queries happened to touch, not with
    what the server holds (issue 13, mem17)."""
    return int(_tree_sum(pid, lambda q: (lambda m: m.rss - m.shared)(q.memory_info())))


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its live descendants
    (the server and its shard processes; a timing independent of what else runs)."""
    return float(_tree_sum(pid, lambda q: sum(q.cpu_times()[:2])))


class RssPeak:
    """Samples :func:`tree_rss` of a server every ``interval`` s on a thread; ``peak`` is the
    high-water mark of the whole tree since the last :meth:`reset` (ingest buffers, merges and
    snapshot writes included, which an RSS read after the fact misses)."""

    def __init__(self, interval: float = 0.5) -> None:
        import threading

        self.pid, self.peak, self.interval = 0, 0, interval
        self.peak_by: dict[str, int] = {}  # frontend / shard processes at the tree's peak
        # when the peak was sampled and the anonymous part of it (the rest: file-backed pages mapped, e.g.
        # the snapshot files and a BM25 merge's spill maps, which the kernel can drop; session 48)
        self.peak_at, self.peak_anon = "", 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def watch(self, pid: int) -> None:
        self.pid, self.peak, self.peak_by, self.peak_at, self.peak_anon = pid, 0, {}, "", 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.pid:
                anon: list[int] = []
                by = rss_by_process(self.pid, anon)
                if sum(by.values()) > self.peak:
                    self.peak, self.peak_by = sum(by.values()), by
                    self.peak_at, self.peak_anon = time.strftime("%H:%M:%S"), anon[0] if anon else 0

    def close(self) -> None:
        self._stop.set()
        self._t.join()


def _docs(a, size: int, snap: dict, timing: dict):
    """The corpus of ``size`` chunks as ``Doc`` objects: the real documents first, then the
    derived ones, generated as the ingest consumes them (``timing["derive_s"]`` adds up the
    time spent deriving)."""
    from oprag_client.client import Doc

    by_doc: dict[str, list[int]] = {}
    for i, d in enumerate(snap["doc_id"]):
        by_doc.setdefault(d, []).append(i)
    for d, rows in by_doc.items():
        yield Doc(d, title=snap["title"][rows[0]], chunks=[(snap["text"][r], snap["vectors"][r]) for r in rows])
    i = 0
    blocks = derived(snap, max(0, size - len(snap["text"])), a.sigma, block=a.per_stream)
    while True:
        t = time.perf_counter()
        block = next(blocks, None)
        timing["derive_s"] += time.perf_counter() - t
        if block is None:
            return
        for text, v in zip(*block):
            yield Doc(f"syn:{i}", text, vector=v)
            i += 1


def _caught_up(c, poll_s: float = 0.2) -> float:
    """Seconds until no shard holds acknowledged vectors outside its ANN graph (``ShardStats
    .ann_pending``, 0 at once for a server without deferred inserts)."""
    t = time.perf_counter()
    while any(getattr(s, "ann_pending", 0) for s in c.stats().shards):
        time.sleep(poll_s)
    return time.perf_counter() - t


def _settled(c, poll_s: float = 0.5, limit_s: float = 900.0, unsaved: bool = False) -> float:
    """Seconds until no shard has a BM25 merge pending (``ShardStats.merge_pending``, 0 at once
    for a server without the field) nor deferred HNSW inserts nor new dense-minimum seeds being made
    (``seeds_pending``, since session 46; at most ``limit_s``); with
    ``unsaved`` also until none holds the 64 MiB of merged segment only in memory that make the
    server take a snapshot (``segment_unsaved_bytes``: the snapshot then maps it), i.e. the
    state a served corpus stays in once writes stopped."""
    t = time.perf_counter()
    while any(getattr(s, "merge_pending", 0) or getattr(s, "ann_pending", 0) or getattr(s, "seeds_pending", 0)
              or (unsaved and getattr(s, "segment_unsaved_bytes", 0) >= 64 << 20) for s in c.stats().shards):
        if time.perf_counter() - t > limit_s:
            break
        time.sleep(poll_s)
    return time.perf_counter() - t


def _batches(it, n: int):
    while True:
        batch = list(itertools.islice(it, n))
        if not batch:
            return
        yield batch


def run_size(a, size: int, kind: str, snap: dict, q, save) -> dict:
    """One corpus size with one dense index kind; ``save(res)`` is called with the figures so
    far after every step (ingest, queries, restart), so a run cut short leaves them."""
    from oprag_client.client import OpRAGClient, query_request
    from oprag_client.evaluate import ndcg_at_k

    t_all = time.perf_counter()
    res: dict = {"size": size, "dense_index": kind, "step": "ingest"}
    timing = {"derive_s": 0.0}
    data = OUT / f"scale-{size}-{kind}"
    shutil.rmtree(data, ignore_errors=True)
    args = ["--generator", "none", "--shards", str(a.shards), "--dense-index", kind, "--monitor-fraction", "0",
            *a.server_arg]
    peak = RssPeak()
    srv = start_server(data, *args, log_path=OUT / "scale-server.log")
    try:
        peak.watch(srv.proc.pid)
        with OpRAGClient(srv.target, timeout=3600) as c:
            t, chunks, next_log = time.perf_counter(), 0, a.log_every
            cpu0 = tree_cpu(srv.proc.pid)
            for batch in _batches(_docs(a, size, snap, timing), a.per_stream):
                chunks += c.ingest(batch).chunks_written
                if chunks >= next_log:
                    el = time.perf_counter() - t
                    res.update(chunks=chunks, ingest_s=round(el, 1), ingest_chunks_per_s=round(chunks / el),
                               rss_peak_ingest_bytes=peak.peak, derive_s=round(timing["derive_s"], 1))
                    log(f"{size} {kind}: {chunks} chunks, {el:.0f} s, tree RSS peak {peak.peak / 2**30:.2f} GiB")
                    save(res)
                    next_log += a.log_every
            ingest_s = time.perf_counter() - t - timing["derive_s"]  # the derivation runs between streams
            cpu_ack = tree_cpu(srv.proc.pid) - cpu0
            caught = _caught_up(c)  # the HNSW inserts the shards deferred past the acknowledgements
            cpu = tree_cpu(srv.proc.pid) - cpu0
            res.update(ingest_server_cpu_s=round(cpu, 1), ingest_chunks_per_server_cpu_s=round(chunks / max(cpu, 1e-9)),
                       ingest_server_cpu_at_ack_s=round(cpu_ack, 1), index_caught_up_s=round(caught, 1),
                       ingest_indexed_chunks_per_s=round(chunks / (ingest_s + caught)))
            res.update(chunks=chunks, ingest_s=round(ingest_s, 1), ingest_chunks_per_s=round(chunks / ingest_s),
                       rss_peak_ingest_bytes=peak.peak, rss_after_ingest_bytes=tree_rss(srv.proc.pid),
                       derive_s=round(timing["derive_s"], 1), step="queries")
            log(f"{size} {kind}: {chunks} chunks ingested in {ingest_s:.1f} s (+{timing['derive_s']:.1f} s deriving)")
            save(res)
            lat: dict[str, list[float]] = {"hybrid": [], "full_hybrid": [], "interleaved": []}
            tops: dict[str, list[list[str]]] = {"hybrid": [], "full_hybrid": []}
            ndcg, bound = [], []  # (certified, widen rounds) of each hybrid query (servers with the bound)
            qs = list(zip(q["texts"], q["vecs"], q["qids"]))

            def ask(text, v, mode):
                req = query_request(text, top_k=10, mode=mode, query_vector=v.tolist())
                t = time.perf_counter()
                r = c.stub.Retrieve(req)
                return r, (time.perf_counter() - t) * 1000

            for text, v, _ in qs[:WARMUP]:  # first queries build per-term state (kernels_wide rows)
                ask(text, v, "hybrid")
            t0, after = time.strftime("%H:%M:%S"), [ask(text, v, "hybrid")[1] for text, v, _ in qs]
            # the idle BM25 merge a large ingest leaves due (ShardState.idle_step) and the snapshot
            # that then maps the merged segment
            settled = _settled(c, unsaved=True)
            res.update(retrieve_p50_after_ingest_ms=round(percentile(after, 50), 2),
                       retrieve_p95_after_ingest_ms=round(percentile(after, 95), 2), settled_s=round(settled, 1),
                       after_ingest_pass_t0=t0, settled_at=time.strftime("%H:%M:%S"))
            log(f"{size} {kind}: hybrid p50 {res['retrieve_p50_after_ingest_ms']} ms straight after the ingest; "
                f"settled {settled:.1f} s later")
            for text, v, _ in qs[:WARMUP]:  # (a merge installed a new segment: its rows are built anew)
                ask(text, v, "hybrid")
            # one mode per pass (a served mix is mostly hybrid), then hybrid interleaved with
            # full_hybrid per query, whose full scans evict the caches the next hybrid query uses
            for mode in ("hybrid", "full_hybrid"):
                for text, v, qid in qs:
                    r, ms = ask(text, v, mode)
                    lat[mode].append(ms)
                    tops[mode].append([h.chunk_id for h in r.hits])
                    if mode == "hybrid":
                        bound.append((getattr(r.retrieval, "certified", False), getattr(r.retrieval, "widen_rounds", 0)))
                        ranked = list(dict.fromkeys(h.doc_id for h in r.hits))
                        ndcg.append(ndcg_at_k(ranked, q["qrels"][qid], 10))
            for text, v, _ in qs:
                lat["interleaved"].append(ask(text, v, "hybrid")[1])
                ask(text, v, "full_hybrid")
            rss, rss_anon = tree_rss(srv.proc.pid), tree_rss_anon(srv.proc.pid)
            # the state it stays in: no merge pending, no merged segment only in memory (a snapshot
            # running when the passes ended holds old and new parts: rss_bytes then reads 2-4 GB more)
            settle_s = _settled(c, unsaved=True, limit_s=600.0)
            time.sleep(2.0)  # (the replaced arrays are freed on the shards' drop threads)
            res.update(rss_settled_bytes=tree_rss(srv.proc.pid), rss_anon_settled_bytes=tree_rss_anon(srv.proc.pid),
                       settled_after_passes_s=round(settle_s, 1))
        recall = [len(set(h) & set(f)) / max(1, len(f)) for h, f in zip(tops["hybrid"], tops["full_hybrid"])]
        res.update({"retrieve_p50_ms": round(percentile(lat["hybrid"], 50), 2),
                    "retrieve_p95_ms": round(percentile(lat["hybrid"], 95), 2),
                    "full_p50_ms": round(percentile(lat["full_hybrid"], 50), 2),
                    "retrieve_p50_interleaved_ms": round(percentile(lat["interleaved"], 50), 2),
                    "retrieve_p95_interleaved_ms": round(percentile(lat["interleaved"], 95), 2),
                    "recall10_vs_exact": round(float(np.mean(recall)), 4),
                    "ndcg10_scifact": round(float(np.mean(ndcg)), 4),
                    "hybrid_certified_share": round(float(np.mean([c for c, _ in bound])), 4),
                    "hybrid_widened_share": round(float(np.mean([w > 0 for _, w in bound])), 4),
                    "rss_bytes": rss, "rss_anon_bytes": rss_anon, "bytes_per_chunk": round(rss / max(chunks, 1)),
                    "rss_peak_bytes": peak.peak, "rss_peak_by_process": peak.peak_by, "rss_peak_at": peak.peak_at,
                    "rss_peak_anon_bytes": peak.peak_anon, "step": "restart"})
        save(res)
        peak.watch(0)
        srv.stop(timeout=1800)
        res["snapshot_bytes"] = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
        t = time.perf_counter()
        srv.start(timeout=1800)
        res["restart_s"] = round(time.perf_counter() - t, 2)
        peak.watch(srv.proc.pid)
        with OpRAGClient(srv.target) as c:
            comp: dict[str, int] = {}
            for sh in c.stats().shards:
                for k in ("postings_bytes", "terms_bytes", "vectors_bytes", "ann_bytes", "chunks_bytes"):
                    comp[k] = comp.get(k, 0) + int(getattr(sh, k, 0))
            c.stub.Retrieve(query_request(q["texts"][0], top_k=10, query_vector=q["vecs"][0].tolist()))
            time.sleep(1.0)  # one more RSS sample after the first query
            rss_first = tree_rss(srv.proc.pid)
            # the same hybrid pass as before the restart (the served state loaded from the snapshot
            # instead of built by the ingest)
            qs = list(zip(q["texts"], q["vecs"]))
            for text, v in qs[:WARMUP]:
                c.stub.Retrieve(query_request(text, top_k=10, mode="hybrid", query_vector=v.tolist()))
            lat_r = []
            for text, v in qs:
                req = query_request(text, top_k=10, mode="hybrid", query_vector=v.tolist())
                t = time.perf_counter()
                c.stub.Retrieve(req)
                lat_r.append((time.perf_counter() - t) * 1000)
            res.update(retrieve_p50_after_restart_ms=round(percentile(lat_r, 50), 2),
                       retrieve_p95_after_restart_ms=round(percentile(lat_r, 95), 2))
        # served from the snapshot: no ingest buffers
        res.update(rss_after_restart_bytes=rss_first, rss_anon_after_restart_bytes=tree_rss_anon(srv.proc.pid),
                   rss_peak_restart_bytes=peak.peak,
                   rss_after_restart_by_process=rss_by_process(srv.proc.pid),
                   shard_bytes_by_component=comp,
                   shard_bytes_per_chunk={k.removesuffix("_bytes"): round(v / max(chunks, 1)) for k, v in comp.items()},
                   rss_after_restart_per_chunk=round(rss_first / max(chunks, 1)), step="done")
    finally:
        peak.close()
        srv.stop()
    res["wall_s"] = round(time.perf_counter() - t_all, 1)
    save(res)
    return res


def paired_growth(a, kind: str, sizes: list[int], q) -> dict:
    """The growth of hybrid Retrieve p50 from the smallest to the largest size, side by side:
    both sizes' data dirs (what :func:`run_size` left) served at once, each by its own server,
    and rounds of ``--pair-per`` hybrid queries (the same SciFact queries as the passes, query
    vectors supplied) alternating between them, the order reversed every other round, so that a
    slow minute of this shared machine slows both sizes alike. The sequential figure divides
    two passes run minutes apart (session 44: the same code's 10K p50 read 2.3 ms one hour and
    4.1 ms the next). ``ratio`` is the median of the per-round ratios of the round p50s.

    The dirty page cache is written back first (``os.sync``: the sizes' runs leave GBs of snapshot pages behind), and
    the load average at the start and the end is reported: a pairing on a busy machine slows both sides and moves the
    quotient (bench/RESULTS.md, session 52).

    :returns: ``{"sizes", "rounds", "per", "small_p50_ms", "large_p50_ms", "ratio", "round_ratios",
        "server_retrieve_small_p50_ms", "server_retrieve_large_p50_ms", "sync_s", "dirty_kb_after_sync",
        "loadavg_at_start", "loadavg_at_end"}`` (the server ``retrieve`` figures: the median round p50 of the
        server's own ``retrieve`` timing, ``QueryReply.timings_ms``, without gRPC and the client)."""
    from oprag_client.client import OpRAGClient, query_request

    lo, hi = min(sizes), max(sizes)
    args = ["--generator", "none", "--shards", str(a.shards), "--dense-index", kind, "--monitor-fraction", "0",
            *a.server_arg]
    reqs = [query_request(t, top_k=10, mode="hybrid", query_vector=v.tolist()) for t, v in zip(q["texts"], q["vecs"])]
    for size in (lo, hi):
        if not (OUT / f"scale-{size}-{kind}").is_dir():
            raise SystemExit(f"bench.scale: no data dir {OUT / f'scale-{size}-{kind}'}; run the sizes first "
                             "(without --pair-only)")
    srvs, clients, p50, srv_p50 = [], [], {lo: [], hi: []}, {lo: [], hi: []}
    # the steps before leave GBs of snapshot and spill pages to write back (a 1M run's ~5 GB): written back first, not
    # during the rounds; the load and what was left are reported, since a busy start slows both sizes and moves the
    # quotient (session 52: the 10K side 50% slower in one pairing, 2.66x against 3.25x a minute later)
    t_sync = time.perf_counter()
    os.sync()
    quiet = {"sync_s": round(time.perf_counter() - t_sync, 2), "dirty_kb_after_sync": _dirty_kb(),
             "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        for size in (lo, hi):
            srvs.append(start_server(OUT / f"scale-{size}-{kind}", *args, log_path=OUT / "scale-server.log",
                                     timeout=1800))
            clients.append(OpRAGClient(srvs[-1].target).__enter__())
        for c in clients:
            for r in reqs[:WARMUP]:
                c.stub.Retrieve(r)
        for rd in range(a.pair_rounds):
            part = [reqs[(rd * a.pair_per + j) % len(reqs)] for j in range(a.pair_per)]
            for i in ((0, 1) if rd % 2 == 0 else (1, 0)):
                lat, sv = [], []
                for r in part:
                    t = time.perf_counter()
                    rep = clients[i].stub.Retrieve(r)
                    lat.append((time.perf_counter() - t) * 1000)
                    sv.append(rep.timings_ms.get("retrieve", 0.0))
                p50[(lo, hi)[i]].append(percentile(lat, 50))
                srv_p50[(lo, hi)[i]].append(percentile(sv, 50))
            log(f"paired {kind} round {rd}: {lo} {p50[lo][-1]:.2f} ms, {hi} {p50[hi][-1]:.2f} ms")
    finally:
        for c in clients:
            c.__exit__(None, None, None)
        for srv in srvs:
            srv.stop()
    ratios = np.array(p50[hi]) / np.array(p50[lo])
    return {"sizes": [lo, hi], "rounds": a.pair_rounds, "per": a.pair_per,
            "small_p50_ms": round(float(np.median(p50[lo])), 2), "large_p50_ms": round(float(np.median(p50[hi])), 2),
            "ratio": round(float(np.median(ratios)), 2), "round_ratios": [round(float(x), 2) for x in ratios],
            "server_retrieve_small_p50_ms": round(float(np.median(srv_p50[lo])), 2),
            "server_retrieve_large_p50_ms": round(float(np.median(srv_p50[hi])), 2), **quiet,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}


def _dirty_kb() -> int | None:
    """The machine's dirty page cache (``Dirty:`` of /proc/meminfo, kB): pages not written back yet; None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Dirty:"))
    except (OSError, StopIteration, ValueError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=OUT / "retrieval-data",
                    help="data dir of a finished bench.retrieval run (real chunks and vectors)")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--sizes", default="20000,100000,1000000")
    ap.add_argument("--dense-index", default="flat,hnsw", help="comma-separated dense index kinds")
    ap.add_argument("--queries", type=int, default=200, help="first N judged SciFact train queries")
    ap.add_argument("--sigma", type=float, default=0.5, help="noise of derived vectors (see module docstring)")
    ap.add_argument("--per-stream", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=100_000, help="log and save progress every N chunks ingested")
    ap.add_argument("--out", type=Path, default=OUT / "scale.json",
                    help="JSON file rewritten after every step (a partial run leaves its figures)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `oprag serve` argument (repeatable; e.g. --server-arg=--cpu-latency-us --server-arg=0)")
    ap.add_argument("--pair-rounds", type=int, default=8,
                    help="rounds of the side-by-side growth measurement (0: none; see paired_growth)")
    ap.add_argument("--pair-per", type=int, default=100, help="hybrid queries per size per round")
    ap.add_argument("--pair-only", action="store_true",
                    help="only the side-by-side growth, over the data dirs an earlier run left")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    require("psutil", what="the RSS measurement")
    if not a.pair_only and not a.source.is_dir():
        raise SystemExit(f"bench.scale: no --source data dir {a.source}: run `python -m bench.retrieval --no-langchain "
                         "--json` first (it leaves bench/out/retrieval-data, the real chunks and vectors the sizes are "
                         "built from), or pass --source")
    snap = None if a.pair_only else read_snapshot(a.source)
    judged, qrels = load_queries_qrels(a.shared, "train")
    qids = list(judged)[: a.queries]
    vecs = _internals.encoder("minilm", device="cpu").encode([judged[x] for x in qids], truncate=True)
    q = {"qids": qids, "texts": [judged[x] for x in qids], "vecs": vecs, "qrels": qrels}
    result: dict = {"machine": machine_info(), "sizes": {}}

    def save_to(key):
        def save(res):
            result["sizes"][key] = res
            a.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = a.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
            tmp.replace(a.out)
        return save

    sizes = [int(s) for s in a.sizes.split(",")]
    for kind in a.dense_index.split(","):
        for size in ([] if a.pair_only else sizes):
            key = f"{size}/{kind}"
            result["sizes"][key] = run_size(a, size, kind, snap, q, save_to(key))
            log(result["sizes"][f"{size}/{kind}"])
        ks = [k for k in result["sizes"] if k.endswith(f"/{kind}")]
        ten_to_1m = min(sizes) == 10_000 and max(sizes) == 1_000_000
        if len(ks) > 1:
            lo, hi = result["sizes"][ks[0]], result["sizes"][ks[-1]]
            result[f"p50_growth_{kind}_sequential"] = round(hi["retrieve_p50_ms"] / lo["retrieve_p50_ms"], 2)
            if ten_to_1m:
                result.setdefault("p50_growth_10k_to_1m_sequential", result[f"p50_growth_{kind}_sequential"])
        if len(set(sizes)) > 1 and a.pair_rounds > 0:
            # the growth figure proper: the two sizes served side by side (paired_growth)
            pg = result[f"p50_growth_{kind}_paired"] = paired_growth(a, kind, sizes, q)
            result[f"p50_growth_{kind}"] = pg["ratio"]
            if ten_to_1m:
                result.setdefault("p50_growth_10k_to_1m", pg["ratio"])
            log(f"{kind}: p50 growth {min(sizes)} -> {max(sizes)} side by side {pg['ratio']}x "
                f"({pg['small_p50_ms']} vs {pg['large_p50_ms']} ms)")
        if ks:
            save_to(ks[-1])(result["sizes"][ks[-1]])
        else:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result))
    if a.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
