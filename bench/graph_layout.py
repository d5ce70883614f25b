"""Node orders of one HNSW shard's graph side by side (issue 13, session 47: ``--hnsw-layout-min``,
server/oprag_server/index/graph_layout.py): FAISS's search alone, a shard's whole hybrid and dense search, and the
time to renumber, for the graph in insertion order (the slots' order: how an ingest numbers it), the
breadth-first order the shard uses, and, for comparison, k-means cluster order and reverse Cuthill-McKee (scipy).

One shard of a ``bench.scale`` data dir is loaded in this process (its log not replayed; nothing is written) and
renumbered in place, order after order, through the shard's own ``lay_out_ann`` (the id -> slot map, the dense
minimum's seeds and int8 rows renumbered with the graph), in rounds whose order of the orders alternates. Each
measurement runs the same SciFact train queries (their MiniLM vectors), caches cleared before each query, one
thread; per order the median over rounds of the per-round p50s, and the median of each round's ratio to insertion
order. Every order's replies are compared with insertion order's (they must be the same).

    python -m bench.graph_layout --data-dir bench/out/scale-1000000-hnsw --queries 300 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import _internals
from ._common import emit_json, log, machine_info, percentile, shard_probe_args
from .shard_parts import _queries, _request


def _order(name: str, ann) -> np.ndarray:
    """int64[A]: the old id of each new id for order ``name`` of ``ann``'s graph as numbered now."""
    from oprag_server.index import graph_layout  # noqa: PLC0415
    from oprag_server.index.ann_copies import hnsw_storage, level0  # noqa: PLC0415

    index = ann._index  # noqa: SLF001
    n = int(index.ntotal)
    if name == "insertion":
        return np.argsort(ann.ann_slot[:n], kind="stable")
    if name == "bfs":
        return graph_layout.bfs_order(index)
    if name == "kmeans":  # nodes grouped by their nearest of 1,024 k-means centroids (a sample of 64 K trains them)
        import faiss  # noqa: PLC0415

        st = hnsw_storage(index)
        km = faiss.Kmeans(st.shape[1], 1024, niter=8, seed=1, max_points_per_centroid=64)
        km.train(np.ascontiguousarray(st[:: max(1, n // 65536)]))
        _, a = km.index.search(st, 1)
        return np.argsort(a[:, 0], kind="stable")
    if name == "rcm":
        import scipy.sparse as sp  # noqa: PLC0415 - (scipy: installed with sentence-transformers)
        from scipy.sparse.csgraph import reverse_cuthill_mckee  # noqa: PLC0415

        nbr, off, width = level0(index)
        cols = nbr[off[:n, None] + np.arange(width)].ravel()
        rows = np.repeat(np.arange(n), width)
        ok = cols >= 0
        g = sp.csr_matrix((np.ones(int(ok.sum()), np.int8), (rows[ok], cols[ok])), shape=(n, n))
        return reverse_cuthill_mckee((g + g.T).tocsr(), symmetric_mode=True).astype(np.int64)
    raise ValueError(f"unknown order {name!r}")


def _clear(st) -> None:
    """The per-query caches a repeated query would hit (BM25 lists, the check's scores, dense minima)."""
    from oprag_server.index.bm25 import listed_cache  # noqa: PLC0415

    listed_cache.of(st.store.postings).entries.clear()
    ck = st.search._check  # noqa: SLF001
    if ck is not None:
        ck._memo.clear()  # noqa: SLF001
        ck._lows.clear()  # noqa: SLF001
    st.search._dmin = (-1, {})  # noqa: SLF001


def _measure(st, qs, reqs, ef: int) -> tuple[dict, list]:
    ann = st.store.dense.ann
    faiss_ms, out, replies = [], {}, []
    for v, _, _ in qs:
        t = time.perf_counter_ns()
        ann.search(v[None], 256, ef)
        faiss_ms.append((time.perf_counter_ns() - t) / 1e6)
    out["faiss_p50_ms"] = percentile(faiss_ms, 50)
    for mode, rs in reqs.items():
        ts = []
        for r in rs:
            _clear(st)
            t = time.thread_time_ns()
            rep = st.search.search(r)
            ts.append((time.thread_time_ns() - t) / 1e6)
            replies.append(repr(rep))  # (compared with insertion order's, outside the timing)
        out[f"{mode}_p50_ms"] = percentile(ts, 50)
    return out, replies


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shard_probe_args(ap, queries=300)
    ap.add_argument("--orders", default="insertion,bfs,kmeans,rcm", help="comma-separated: insertion, bfs, kmeans, rcm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ef-search", type=int, default=320, help="FAISS's beam for the search-alone figure")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    _internals.one_thread()
    sp = _internals.shard_plane()
    t0 = time.perf_counter()
    st = _internals.shard_state(a.data_dir, a.shard, a.dense_index)
    st.search.warm()
    log(f"loaded shard {a.shard} ({len(st.store.dense)} chunks) in {time.perf_counter() - t0:.1f} s")
    qs = _queries(a, st)
    avgdl = _internals.shard_avgdl(st.store.postings)
    reqs = {mode: [_request(sp, q, avgdl, mode) for q in qs] for mode in ("hybrid", "dense")}
    names = a.orders.split(",")
    if "insertion" not in names:
        names.insert(0, "insertion")
    runs = {n: [] for n in names}
    base = None
    for rd in range(a.rounds):
        for name in (names if rd % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            perm = _order(name, st.store.dense.ann)
            ordered = time.perf_counter() - t
            t = time.perf_counter()
            assert st.store.dense.lay_out_ann(st.search._low, order=perm)  # noqa: SLF001
            renumbered = time.perf_counter() - t
            fig, replies = _measure(st, qs, reqs, a.ef_search)
            fig.update(order_s=round(ordered, 3), renumber_s=round(renumbered, 3))
            if base is None and name == "insertion":
                base = replies
            fig["replies_same"] = None if base is None else replies == base
            runs[name].append(fig)
            log(f"round {rd} {name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in fig.items()))
    out = {"chunks": len(st.store.dense), "queries": len(qs), "ef_search": a.ef_search, "rounds": a.rounds,
           "orders": {}, "machine": machine_info()}
    for name, figs in runs.items():
        row = {k: round(float(np.median([f[k] for f in figs])), 3) for k in ("faiss_p50_ms", "hybrid_p50_ms",
                                                                          "dense_p50_ms", "order_s",
                                                                          "renumber_s")}
        for k in ("faiss_p50_ms", "hybrid_p50_ms", "dense_p50_ms"):
            row[k.replace("_p50_ms", "_vs_insertion")] = round(float(np.median(
                [f[k] / g[k] for f, g in zip(figs, runs["insertion"])])), 3)
        row["replies_same"] = all(f["replies_same"] is not False for f in figs)
        out["orders"][name] = row
    if a.json:
        emit_json(out)
    else:
        for name, row in out["orders"].items():
            log(name, row)
    return out


if __name__ == "__main__":
    main()
