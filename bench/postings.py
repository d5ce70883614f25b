"""BM25 postings microbenchmark (issue 13, item 1): the shard's compact CSR postings against the
``dict[term] -> dict[slot, tf]`` layout they replaced (kept in ``bench/_dict_postings.py``), in
process, at the real corpus size and at a derived larger one.

Corpus: the SciFact corpus and WikiText-2 valid articles (``--shared``), cut by the server's
chunker (256 MiniLM tokens) and analysed by the server's BM25 analyzer over ``title\\ntext``, as a
shard indexes them. Sizes above the real chunk count add *derived* chunks: derived chunk ``i``
takes real chunk ``a`` (uniform, seeded) and replaces each of its tokens with probability 1/2 by
a token drawn uniformly from the tokens of another real chunk ``b``, so lengths follow the real
length distribution and tokens the real vocabulary's frequencies (the union of two real chunks'
terms, no new terms).

Per layout and size, each in its own process (so RSS deltas do not mix): build time (adds, the
CSR layout merging between batches of 256 chunks as a shard does, then a final merge), the index
bytes (the Python allocations still held after the build, measured with ``tracemalloc``, which
slows the build; ``PostingsIndex.nbytes`` for CSR; the RSS growth, which understates when the
allocator reuses freed memory), postings and bytes per posting, and per query over SciFact claims (``--queries``): the latency of scoring 256 candidate
chunks (``score``, the hybrid mode's BM25 of the dense candidates; random live slots) and of
scoring every chunk that has a query term (``score_all``, exact and lexical modes), p50/p95
(nearest rank). CSR only: the merge pause after 1% more chunks and after deleting 1%, and the
save / memory-mapped load times. A checksum of every score lets the parent check both layouts
return identical floats.

    python -m bench.postings --sizes 12348,200000 --json
    python -m bench.postings --pause --sizes 12348,200000 --json   # a query's wait during a merge

Prints a table to stderr and, with ``--json``, one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from . import _common as C
from . import _internals

TOKENS = C.OUT / "postings-tokens.pkl"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def real_tokens(shared: Path) -> list[list[str]]:
    """Analysed tokens of every real chunk (cached in ``bench/out/postings-tokens.pkl``)."""
    if TOKENS.exists():
        return pickle.loads(TOKENS.read_bytes())
    an = _internals.analyzer()
    out = []
    for d in C.load_corpus(shared):
        for piece in _internals.chunk_text(d.text):
            if piece.strip():
                out.append(an.tokens(f"{d.title}\n{piece}" if d.title else piece))
    TOKENS.parent.mkdir(parents=True, exist_ok=True)
    TOKENS.write_bytes(pickle.dumps(out))
    return out


def corpus(real: list[list[str]], n: int, seed: int = 0) -> list[list[str]]:
    """``n`` chunks: the real ones first, then derived ones (module docstring)."""
    out = list(real[:n])
    rng = np.random.default_rng(seed)
    while len(out) < n:
        a, b = real[int(rng.integers(len(real)))], real[int(rng.integers(len(real)))]
        if not a or not b:
            continue
        swap = rng.random(len(a)) < 0.5
        picks = rng.integers(len(b), size=len(a))
        out.append([b[picks[i]] if swap[i] else t for i, t in enumerate(a)])
    return out


def worker(layout: str, n: int, shared: Path, n_queries: int, traced: bool = True) -> dict:
    bm25 = _internals.bm25()
    chunks = corpus(real_tokens(shared), n)
    queries, _ = C.load_queries_qrels(shared)
    an = _internals.analyzer()
    qterms = [an.tokens(q) for q in list(queries.values())[:n_queries]]
    gc.collect()
    rss0 = rss_bytes()
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    if layout == "dict":
        from ._dict_postings import DictPostingsIndex
        ix = DictPostingsIndex()
        for slot, toks in enumerate(chunks):
            ix.add(slot, toks)
    else:
        ix = bm25.PostingsIndex()
        for i in range(0, len(chunks), 256):  # batches of 256 chunks, as a shard applies them
            ix.add_batch(range(i, min(i + 256, len(chunks))), chunks[i:i + 256])
            ix.maybe_merge()
        ix.merge()
    build_s = time.perf_counter() - t0
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] if traced else None
    tracemalloc.stop()
    rss1 = rss_bytes()
    postings = sum(len(set(t)) for t in chunks)
    stats = bm25.CorpusStats.merge_full([ix.full_stats()])
    rng = np.random.default_rng(1)
    t_score, t_all, checksum = [], [], 0.0
    for terms in qterms:
        idf = stats.query_idf(terms, 0.25)
        cand = np.sort(rng.choice(n, size=min(256, n), replace=False)).astype(np.int64)
        t = time.perf_counter()
        sc = ix.score(cand, terms, idf, stats.avgdl)
        t_score.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        s_all, v_all = ix.score_all(terms, idf, stats.avgdl)
        t_all.append((time.perf_counter() - t) * 1e3)
        checksum += float(sc.sum()) + float(v_all.sum()) + float(s_all.sum())
    out = {"layout": layout, "chunks": n, "postings": postings, "terms": len(stats.df), "build_s": round(build_s, 2),
           "traced_bytes": held, "traced_bytes_per_posting": round(held / postings, 2) if held else None,
           "rss_delta_bytes": rss1 - rss0, "rss_bytes": rss1,
           "score256_p50_ms": C.percentile(t_score, 50), "score256_p95_ms": C.percentile(t_score, 95),
           "score_all_p50_ms": C.percentile(t_all, 50), "score_all_p95_ms": C.percentile(t_all, 95),
           "checksum": repr(checksum)}
    if layout == "csr":
        nb = ix.nbytes()
        out.update(postings_bytes=nb["postings"], terms_bytes=nb["terms"],
                   bytes_per_posting=round(nb["postings"] / postings, 2), merges=ix.merges)
        extra = corpus(real_tokens(shared), n + n // 100, seed=7)[n:]
        for i, toks in enumerate(extra):
            ix.add(n + i, toks)
        ix.merge()
        out["merge_pause_add1pct_s"] = round(ix.last_merge_s, 3)
        for s in range(0, n, 100):
            ix.remove(s)
        ix.merge()
        out["merge_pause_del1pct_s"] = round(ix.last_merge_s, 3)
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            ix.save(Path(d))
            out["save_s"] = round(time.perf_counter() - t, 3)
            out["snapshot_bytes"] = sum(p.stat().st_size for p in Path(d).iterdir())
            t = time.perf_counter()
            back = bm25.PostingsIndex.load(Path(d), mmap=True)
            out["load_mmap_s"] = round(time.perf_counter() - t, 3)
            assert len(back) == len(ix)
    return out


def ab(n: int, shared: Path, n_queries: int) -> dict:
    """Both layouts in one process, timed alternately per query (dict, csr, dict, csr): a
    latency comparison that a loaded machine disturbs equally on both sides."""
    from ._dict_postings import DictPostingsIndex
    bm25 = _internals.bm25()
    chunks = corpus(real_tokens(shared), n)
    queries, _ = C.load_queries_qrels(shared)
    an = _internals.analyzer()
    qterms = [an.tokens(q) for q in list(queries.values())[:n_queries]]
    old, new = DictPostingsIndex(), bm25.PostingsIndex()
    for slot, toks in enumerate(chunks):
        old.add(slot, toks)
        new.add(slot, toks)
        if slot % 256 == 255:
            new.maybe_merge()
    new.merge()
    stats = bm25.CorpusStats.merge_full([new.full_stats()])
    rng = np.random.default_rng(1)
    t: dict[str, list[float]] = {k: [] for k in ("dict_score256", "csr_score256", "dict_score_all", "csr_score_all")}
    for terms in qterms:
        idf = stats.query_idf(terms, 0.25)
        cand = np.sort(rng.choice(n, size=min(256, n), replace=False)).astype(np.int64)
        for name, ix in (("dict", old), ("csr", new)):
            t0 = time.perf_counter()
            a = ix.score(cand, terms, idf, stats.avgdl)
            t1 = time.perf_counter()
            s_all, v_all = ix.score_all(terms, idf, stats.avgdl)
            t2 = time.perf_counter()
            t[f"{name}_score256"].append((t1 - t0) * 1e3)
            t[f"{name}_score_all"].append((t2 - t1) * 1e3)
            if name == "dict":
                ref = (a, s_all, v_all)
            else:
                assert np.array_equal(a, ref[0]) and np.array_equal(s_all, ref[1]) and np.array_equal(v_all, ref[2])
    out: dict = {"chunks": n, "queries": len(qterms)}
    for k, v in t.items():
        out[f"{k}_p50_ms"], out[f"{k}_p95_ms"] = round(C.percentile(v, 50), 3), round(C.percentile(v, 95), 3)
    return out


def pause(n: int, shared: Path, n_queries: int) -> dict:
    """What a query sees during a merge at ``n`` chunks: the index is built (batches of 256,
    merged), 1% more chunks are added, then the same merge runs twice: blocking (the former
    shard behaviour: a query waits for all of it) and in the background while queries (BM25
    of 256 candidates, as hybrid mode) run back to back; the install (swap) runs in the
    query thread between two queries. Then the same with 1% of the chunks deleted."""
    bm25 = _internals.bm25()
    chunks = corpus(real_tokens(shared), n)
    queries, _ = C.load_queries_qrels(shared)
    an = _internals.analyzer()
    qterms = [an.tokens(q) for q in list(queries.values())[:n_queries]]
    ix = bm25.PostingsIndex()
    for i in range(0, n, 256):
        ix.add_batch(range(i, min(i + 256, n)), chunks[i:i + 256])
        ix.maybe_merge()
    ix.merge()
    stats = bm25.CorpusStats.merge_full([ix.full_stats()])
    rng = np.random.default_rng(2)
    live = ix.slots()

    def query(k: int, pool: np.ndarray = live) -> float:
        terms = qterms[k % len(qterms)]
        cand = np.sort(rng.choice(pool, size=256, replace=False))
        t = time.perf_counter()
        ix.score(cand, terms, stats.query_idf(terms, 0.25), stats.avgdl)
        return (time.perf_counter() - t) * 1e3

    base = [query(k) for k in range(n_queries)]
    out: dict = {"chunks": n, "postings": ix.segment.n_postings, "idle_query_p50_ms": C.percentile(base, 50),
                 "idle_query_p99_ms": C.percentile(base, 99)}
    extra = corpus(real_tokens(shared), n + n // 100, seed=7)[n:]
    for what in ("add1pct", "del1pct"):
        res = {}
        for mode in ("blocking", "background"):
            # the same delta both times: a fresh copy of the state before the merge
            if what == "add1pct":
                ix.add_batch(range(n, n + len(extra)), extra)
            else:
                for s in live[::100].tolist():
                    ix.remove(s)
            t0 = time.perf_counter()
            if mode == "blocking":
                ix.merge()
                res["blocking_pause_s"] = round(time.perf_counter() - t0, 3)
            else:
                pool = ix.slots()
                ix.merge(background=True)
                lat = []
                while ix.merging:
                    lat.append(query(len(lat), pool))
                    if ix.poll_merge():
                        res["swap_ms"] = round(ix.last_swap_s * 1e3, 2)
                res.update(background_build_s=round(ix.last_merge_s, 3), queries_during=len(lat),
                           during_p50_ms=C.percentile(lat, 50) if lat else None,
                           during_max_ms=round(max(lat), 2) if lat else None)
            # undo, so both modes merge the same delta
            if what == "add1pct":
                for s in range(n, n + len(extra)):
                    ix.remove(s)
            else:
                ix.add_batch(live[::100].tolist(), [chunks[s] for s in live[::100].tolist()])
            ix.merge()
        out[what] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="12348,200000", help="chunk counts, comma-separated")
    ap.add_argument("--layouts", default="dict,csr")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--shared", type=Path, default=C.DEFAULT_SHARED)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-trace", action="store_true", help="build without tracemalloc (build time as served)")
    ap.add_argument("--ab", action="store_true", help="latency only: both layouts in one process, alternating")
    ap.add_argument("--pause", action="store_true", help="query latency during a merge, blocking vs background")
    ap.add_argument("--worker", nargs=2, metavar=("LAYOUT", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]), a.shared, a.queries, not a.no_trace)))
        return
    real_tokens(a.shared)  # cache once
    for key, enabled, run in (("pause", a.pause, pause), ("ab", a.ab, ab)):
        if enabled:  # one measurement mode per call, its rows under its own key
            rows = [run(int(n), a.shared, a.queries) for n in a.sizes.split(",")]
            for r in rows:
                C.log(json.dumps(r))
            if a.json:
                C.emit_json({key: rows, "machine": C.machine_info()})
            return
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        for layout in a.layouts.split(","):
            r = subprocess.run([sys.executable, "-m", "bench.postings", "--worker", layout, str(n),
                                "--queries", str(a.queries), "--shared", str(a.shared)]
                               + (["--no-trace"] if a.no_trace else []),
                               check=True, capture_output=True, text=True, cwd=C.REPO)
            row = json.loads(r.stdout.strip().splitlines()[-1])
            C.log(json.dumps(row))
            rows.append(row)
    for n in {r["chunks"] for r in rows}:
        sums = {r["checksum"] for r in rows if r["chunks"] == n}
        if len(sums) > 1:
            raise SystemExit(f"layouts disagree at {n} chunks: {sums}")
    if a.json:
        C.emit_json({"rows": rows, "machine": C.machine_info()})


if __name__ == "__main__":
    main()
