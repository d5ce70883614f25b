"""HNSW build parameters offline (issue 13): build rate and the ANN's recall of the exact
top-N for ``IndexHNSWFlat`` (inner product) at each (M, efConstruction), on one shard's vectors.

Vectors: one shard of a ``--total`` chunk corpus built as ``bench.scale`` builds it (every other
real chunk vector of a ``bench.retrieval`` data dir, ``--source``, plus derived vectors:
``normalise(v_b + e)``, :func:`bench.scale.derived`), so ``--per-shard`` vectors. Queries: the
first ``--queries`` judged SciFact train queries embedded with MiniLM (what ``bench.scale``
sends). The build adds the vectors in batches of ``--batch`` (what one shard applies per ingest
stream at the bench's 2,000 documents per stream and 2 shards) on ``--threads`` OpenMP threads
(1: what a shard process uses, ``shards/worker.py``); build rate = vectors / wall seconds of
the adds. Recall = |ANN top-N  &  exact top-N| / N per query, averaged, with efSearch =
max(``--ef-search``, N) as the server raises it (``index/ann.py``), for each ``--ef-search``
given; search ms = one batched search of all queries / queries (one thread); exact = ``faiss.knn``.

    python -m bench.hnsw_params --source /tmp/rd12k --per-shard 100000 --json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import DEFAULT_SHARED, OUT, emit_json, load_queries_qrels, log, machine_info, read_snapshot
from .scale import derived


def shard_vectors(snap: dict, n: int, sigma: float) -> np.ndarray:
    """float32[n, D] unit vectors of one shard (see the module docstring)."""
    real = snap["vectors"][::2]
    parts = [real[:n]]
    left = n - len(parts[0])
    if left > 0:
        parts += [v for _, v in derived(snap, left, sigma, block=20000)]
    return np.ascontiguousarray(np.vstack(parts), dtype=np.float32)


def build(faiss, xb: np.ndarray, m: int, efc: int, batch: int):
    idx = faiss.IndexHNSWFlat(xb.shape[1], m, faiss.METRIC_INNER_PRODUCT)
    idx.hnsw.efConstruction = efc
    t = time.perf_counter()
    for s in range(0, len(xb), batch):
        idx.add(xb[s : s + batch])
    return idx, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=OUT / "retrieval-data")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--per-shard", type=int, default=100_000)
    ap.add_argument("--m", default="16,32")
    ap.add_argument("--ef-construction", default="40,80,120,200")
    ap.add_argument("--ef-search", default="128", help="comma-separated; each raised to --top as the server does")
    ap.add_argument("--top", type=int, default=256, help="N: the dense-first window")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import faiss

    faiss.omp_set_num_threads(a.threads)
    snap = read_snapshot(a.source)
    xb = shard_vectors(snap, a.per_shard, a.sigma)
    judged, _ = load_queries_qrels(a.shared, "train")
    xq = np.ascontiguousarray(_internals.encoder("minilm", device="cpu").encode(list(judged.values())[: a.queries],
                                                                                  truncate=True), dtype=np.float32)
    _, exact = faiss.knn(xq, xb, a.top, metric=faiss.METRIC_INNER_PRODUCT)
    efs = sorted({max(int(x), a.top) for x in a.ef_search.split(",")})
    rows = []
    for m in [int(x) for x in a.m.split(",")]:
        for efc in [int(x) for x in a.ef_construction.split(",")]:
            idx, secs = build(faiss, xb, m, efc, a.batch)
            for ef in efs:
                t = time.perf_counter()
                _, got = idx.search(xq, a.top, params=faiss.SearchParametersHNSW(efSearch=ef))
                ms = (time.perf_counter() - t) * 1000 / len(xq)
                rec = [len(set(g.tolist()) & set(e.tolist())) / a.top for g, e in zip(got, exact)]
                row = {"m": m, "ef_construction": efc, "vectors": len(xb), "build_s": round(secs, 2),
                       "build_vectors_per_s": round(len(xb) / secs), "recall_top": a.top, "ef_search": ef,
                       "search_ms_per_query": round(ms, 3), "recall_mean": round(float(np.mean(rec)), 4),
                       "recall_p05": round(float(np.percentile(rec, 5)), 4), "recall_min": round(float(np.min(rec)), 4)}
                log(row)
                rows.append(row)
            del idx
    out = {"machine": machine_info(), "per_shard": a.per_shard, "threads": a.threads, "batch": a.batch, "rows": rows}
    if a.json:
        emit_json(out)
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
