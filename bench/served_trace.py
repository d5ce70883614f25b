"""Where a served hybrid query's time goes between the frontend and its shards (issue 13: one
shard's ``search`` alone ~8 ms, served ``retrieve`` ~14 ms at 1M). No gRPC: the frontend's
:class:`Retriever` runs in this process on a :class:`ShardPool` of the usual pipe-transport
shard processes over ``--data-dir`` (read as the server would; the pool is closed without a
snapshot, so the data dir is not written), SciFact train queries with their MiniLM vectors,
c = 1, hybrid, top_k 10, the server's defaults.

Timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process). Per query:
the frontend's prologue (analyzer, idf), per shard and round the send, the shard's receive,
the end of its ``dispatch`` (wall and thread CPU), the end of its send, the reply resolved on
the frontend's loop; the frontend's merge, the rounds (widening), the fetches
(:meth:`Retriever._materialise`), the whole ``retrieve``. The shards' side is recorded by a
wrapper around their ``dispatch`` (installed in the spawned processes: ``_traced_main``), so no
server code is changed for it. ``--solo`` also times each shard alone (the other idle): the
same requests sent to one shard at a time, which separates the two shards' contention from
the rest.

    python -m bench.served_trace --data-dir bench/out/scale-1000000-hnsw --queries 100 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import DEFAULT_SHARED, emit_json, load_queries_qrels, log, machine_info, percentile, served_args

_ENV = "OPRAG_BENCH_SHARD_TRACE"
_MAIN = None  # worker.main as imported (a spawned shard's own, unpatched)


def _traced_main(*args):
    """Shard process entry point: ``worker.main`` with its ``dispatch`` wrapped; one line per
    request appended to ``$OPRAG_BENCH_SHARD_TRACE.<shard>``: op, receive time (the wrapper's
    entry), dispatch end, dispatch thread-CPU seconds."""
    from oprag_server.shards import search as search_mod  # noqa: PLC0415
    from oprag_server.shards import worker  # noqa: PLC0415

    global _MAIN  # noqa: PLW0603
    _MAIN = worker.main
    from .shard_parts import PARTS, _Timer  # noqa: PLC0415

    inner = worker.dispatch
    path = f"{os.environ[_ENV]}.{args[0]}"
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    timer = _Timer()
    bare = bool(os.environ.get(_ENV + "_BARE"))  # (--bare: no part timers)

    def dispatch(table, op, req):
        if op.value == "search" and not timer.stack and not hasattr(timer, "on") and not bare:
            st = table[op].__self__.store  # the Searcher's store: wrap the parts as bench.shard_parts does
            objs = {"search": table[op].__self__, "dense": st.dense, "postings": st.postings, "mod": search_mod,
                    "store": st}
            for obj, name, label in PARTS:
                timer.wrap(objs[obj], name, label)
            timer.on = True
        timer.acc.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return inner(table, op, req)
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            parts = json.dumps({k: round(v / 1e6, 4) for k, v in timer.acc.items()}, separators=(",", ":"))
            out.write(f"{op.value} {t0:.6f} {t1:.6f} {c1 - c0:.6f} {parts}\n")

    worker.dispatch = dispatch
    return _MAIN(*args)


def _read(path: str) -> list[tuple[str, float, float, float]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            op, a, b, c, parts = line.split(" ", 4)
            rows.append((op, float(a), float(b), float(c), json.loads(parts)))
    return rows


async def _main(a) -> dict:
    from oprag_server.config import BM25Config, DenseConfig, RetrievalConfig  # noqa: PLC0415
    from oprag_server.domain import RetrieveSpec  # noqa: PLC0415
    from oprag_server.engine.commit import CommitProtocol  # noqa: PLC0415
    from oprag_server.index.analyzer import Analyzer  # noqa: PLC0415
    from oprag_server.index.bm25 import CorpusStats  # noqa: PLC0415
    from oprag_server.operators.retrieve import Retriever  # noqa: PLC0415
    from oprag_server.shards import pool as pool_mod  # noqa: PLC0415
    from oprag_server.shards import transport, worker  # noqa: PLC0415
    from oprag_server.shards.protocol import Op  # noqa: PLC0415

    judged, _ = load_queries_qrels(a.shared, "train")
    texts = [judged[x] for x in list(judged)[: a.queries]]
    vecs = _internals.encoder("minilm", device="cpu").encode(texts, truncate=True).astype(np.float32)
    trace = str(Path(a.out) / "shard-trace")
    for i in range(a.shards):
        Path(f"{trace}.{i}").unlink(missing_ok=True)
    os.environ[_ENV] = trace
    if a.bare:
        os.environ[_ENV + "_BARE"] = "1"
    worker.main = _traced_main  # the process target, pickled by name for the spawned shards
    loop = asyncio.get_running_loop()
    pool = pool_mod.ShardPool(a.shards, vecs.shape[1], a.data_dir, dense=DenseConfig(kind=a.dense_index))
    committed = CommitProtocol(pool, CorpusStats(), None).open_log(a.data_dir / "commits.log")
    ready = await loop.run_in_executor(None, lambda: pool.start(loop, committed=committed))
    stats = CorpusStats()
    stats.replace_with(CorpusStats.merge_full([r.lexical for r in ready]))
    ret = Retriever(pool, stats, Analyzer(), BM25Config(), RetrievalConfig())
    widen = []
    ret.on_widen = lambda w, u: widen.append((w, u))
    sends: list[tuple[int, str, float, float]] = []  # (shard, op, sent, resolved)
    orig_call = transport.PipeTransport.call

    class _Stamped:  # a Gather slot that notes when its reply resolved it (the pool sends into slots)
        __slots__ = ("slot", "rec")

        def __init__(self, slot, rec):
            self.slot, self.rec = slot, rec

        def done(self):
            return self.slot.done()

        def set_result(self, value):
            sends.append((*self.rec, time.perf_counter()))
            self.slot.set_result(value)

        def set_exception(self, exc):
            self.set_result(exc)

    def call(self, op, req, into=None):
        t = time.perf_counter()
        if into is not None:
            return orig_call(self, op, req, _Stamped(into, (self.shard_id, op.value, t)))
        fut = orig_call(self, op, req)
        fut.add_done_callback(lambda f, s=self.shard_id: sends.append((s, op.value, t, time.perf_counter())))
        return fut

    transport.PipeTransport.call = call
    spec = RetrieveSpec(mode="hybrid", top_k=10)
    per_q = []
    try:
        for p in range(a.passes):
            for text, v in zip(texts, vecs):
                sends.clear()
                t0 = time.perf_counter()
                _, tim, infos = await ret.retrieve(v[None, :], [text], [spec])
                t1 = time.perf_counter()
                if p == a.passes - 1:
                    per_q.append({"t0": t0, "t1": t1, "sends": list(sends), "fusion": tim["fusion"],
                                  "rounds": infos[0].widen_rounds})
        solo = []
        if a.solo:  # each shard alone: the first round's request, one shard at a time
            for text, v in zip(texts, vecs):
                for s in range(a.shards):
                    sends.clear()
                    terms = [ret.analyzer.tokens(text)]
                    from oprag_server.shards.protocol import QueryBatch, SearchRequest  # noqa: PLC0415
                    idf = [stats.query_idf(terms[0], BM25Config().epsilon)]
                    req = SearchRequest(QueryBatch(v[None, :], terms, idf, stats.avgdl, 1.5, 0.75), "hybrid",
                                        spec.candidates, 0, 0, 10, 64, [(0.5, 0.5)])
                    t = time.perf_counter()
                    await pool.gather_partial(Op.SEARCH, req, shards=[s])
                    solo.append((s, t, time.perf_counter()))
    finally:
        transport.PipeTransport.call = orig_call
        await pool.shutdown(snapshot=False)
    shard_rows = {i: _read(f"{trace}.{i}") for i in range(a.shards)}
    return _summarise(a, per_q, shard_rows, solo, widen)


def _summarise(a, per_q, shard_rows, solo, widen) -> dict:
    """Match each send to the shard's dispatch line (in order per shard and op), then medians."""
    idx = {s: 0 for s in shard_rows}
    rows_by = {s: [r for r in rows] for s, rows in shard_rows.items()}
    # skip the start-up/warm passes' lines: the last pass's and solo's are the tail of each file
    n_sends = {s: sum(1 for q in per_q for x in q["sends"] if x[0] == s) for s in shard_rows}
    n_solo = {s: sum(1 for x in solo if x[0] == s) for s in shard_rows}
    for s, rows in rows_by.items():
        search_like = [r for r in rows if r[0] != "stats" and r[0] != "shutdown"]
        k = n_sends[s] + n_solo[s]
        rows_by[s] = search_like[len(search_like) - k:]
    m: dict[str, list[float]] = {}

    def add(k, v):
        m.setdefault(k, []).append(v * 1e3)

    for q in per_q:
        add("retrieve_wall", q["t1"] - q["t0"])
        add("frontend_fusion", q["fusion"])
        first = {}
        ends = []
        for s, op, sent, resolved in q["sends"]:
            r = rows_by[s][idx[s]]
            idx[s] += 1
            name = "search" if op == "search" else op
            rnd = "r1" if (s, op) not in first else "rN"
            first.setdefault((s, op), True)
            add(f"{name}_{rnd}_send_to_recv", r[1] - sent)
            add(f"{name}_{rnd}_dispatch_wall", r[2] - r[1])
            add(f"{name}_{rnd}_dispatch_cpu", r[3])
            add(f"{name}_{rnd}_end_to_resolved", resolved - r[2])
            add(f"{name}_{rnd}_shard{s}_dispatch_wall", r[2] - r[1])
            if op == "search" and rnd == "r1":
                for part, v in r[4].items():
                    add(f"part r1 {part}", v / 1e3)
                ends.append((resolved, sent, r[1], r[2]))
        if len(ends) >= 2:
            ends.sort()
            add("r1_first_to_last_reply", ends[-1][0] - ends[0][0])
            add("r1_slowest_dispatch_wall", max(e[3] - e[2] for e in ends))
            add("r1_start_skew", abs(ends[0][2] - ends[1][2]))
            add("prologue_to_first_send", min(e[1] for e in ends) - q["t0"])
            add("after_last_r1_reply", q["t1"] - ends[-1][0])
        add("rounds", q["rounds"] / 1e3)
        add("sends", len(q["sends"]) / 1e3)
    for s, t, u in solo:
        r = rows_by[s][idx[s]]
        idx[s] += 1
        add("solo_rt", u - t)
        add("solo_dispatch_wall", r[2] - r[1])
        add("solo_dispatch_cpu", r[3])
        for part, v in r[4].items():
            add(f"part solo {part}", v / 1e3)
        add(f"solo_shard{s}_dispatch_wall", r[2] - r[1])
    out = {"data_dir": str(a.data_dir), "queries": len(per_q), "machine": machine_info(),
           "widened_queries": sum(w for w, _ in widen[-len(per_q):]),
           "p50_ms": {k: round(percentile(v, 50), 3) for k, v in m.items()},
           "mean_ms": {k: round(float(np.mean(v)), 3) for k, v in m.items()},
           "p95_ms": {k: round(percentile(v, 95), 3) for k, v in m.items()}}
    for k in sorted(m):
        log(f"{k:40s} p50 {percentile(m[k], 50):8.3f}  mean {np.mean(m[k]):8.3f}  p95 {percentile(m[k], 95):8.3f}  n {len(m[k])}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    served_args(ap)
    ap.add_argument("--passes", type=int, default=2, help="the last is reported (the first warms the rows)")
    ap.add_argument("--solo", action="store_true", help="also each shard alone")
    ap.add_argument("--bare", action="store_true",
                    help="no part timers in the shards (each costs two clock reads a call): the dispatch times alone")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = asyncio.run(_main(a))
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
