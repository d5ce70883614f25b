"""How long an HNSW shard's request loop is held when deletes cross a quarter of its graph (issue 13, session 40).

One shard's dense index (:class:`oprag_server.index.dense.DenseIndex`, HNSW at the server's defaults: M 32,
efConstruction 80) holds ``--vectors`` real vectors of a bench data dir (shard 0's snapshot, as bench.ivf_retrain
reads them); then deletes arrive in writes of ``--batch`` chunks at ``--rate`` chunks/s until ``--delete`` of them are
gone, and after every write one dense search (``--top-n`` candidates, ``ef_search`` 512) of a live vector runs, as a
query that came in between. In-process, one thread serves both, as a shard process does; between writes the loop
installs a finished background compaction (as the shard's idle step). Two arms, one after the other:

* ``sync``: the compaction in the delete that crossed a quarter dead (the code before session 40);
* ``background``: the compaction in a thread (:mod:`oprag_server.index.hnsw_build`).

Per arm: the build of the starting graph (s), the longest delete and each one over 100 ms, the search p50 / p99 (ms)
overall and while a compaction ran, when the compaction was installed, and the graph's dead count at the end.
Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.hnsw_compact --data-dir bench/out/scale-1000000-ivf --vectors 60000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import time

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one BLAS thread, as in a shard process
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

from bench.ivf_retrain import read_vectors  # noqa: E402


def run_arm(x: np.ndarray, delete: int, batch: int, rate: float, top_n: int, background: bool) -> dict:
    from oprag_server.config import DenseConfig  # noqa: PLC0415
    from oprag_server.index import hnsw_build  # noqa: PLC0415
    from oprag_server.index.dense import DenseIndex  # noqa: PLC0415

    hnsw_build.BACKGROUND_MIN = 16_384 if background else 1 << 62
    dense = DenseIndex(x.shape[1], DenseConfig(kind="hnsw", ann_tail=0))
    t = time.perf_counter()
    for a in range(0, x.shape[0], 8192):
        dense.add(np.arange(a, min(a + 8192, x.shape[0]), dtype=np.int64), x[a:a + 8192])
    build_s = time.perf_counter() - t
    order = np.random.default_rng(0).permutation(x.shape[0])[:delete]
    writes, searches, during, slow, installed = [], [], [], [], None
    t0 = time.perf_counter()
    for i, a in enumerate(range(0, delete, batch)):
        if rate > 0:
            time.sleep(max(0.0, t0 + a / rate - time.perf_counter()))
        t, was = time.perf_counter(), dense.ann_building
        dense.remove(order[a:a + batch])
        if dense.ann_building:  # (the shard's idle step between requests)
            dense.install_ann()
        writes.append(time.perf_counter() - t)
        if was is not None and dense.ann_building is None and installed is None:
            installed = round(time.perf_counter() - t0, 1)
        if writes[-1] > 0.1:
            slow.append([round(writes[-1] * 1e3, 1), a + batch])
        live = dense.slots
        t = time.perf_counter()
        dense.search(x[live[i % live.size]][None, :], top_n, ef_search=512)
        searches.append(time.perf_counter() - t)
        if dense.ann_building is False:
            during.append(searches[-1])
    while dense.ann_building is False:
        time.sleep(0.05)
    if dense.ann_building:
        dense.install_ann()
        installed = installed or f"{time.perf_counter() - t0:.1f} (after the last delete)"
    s = np.array(searches) * 1e3
    dur = np.array(during) * 1e3 if during else np.zeros(1)
    return {"arm": "background" if background else "sync", "build_s": round(build_s, 1), "deletes": len(writes),
            "delete_max_ms": round(max(writes) * 1e3, 1), "deletes_over_100ms": slow,
            "search_p50_ms": round(float(np.median(s)), 3), "search_p99_ms": round(float(np.percentile(s, 99)), 3),
            "searches_during_compaction": len(during),
            "search_p50_during_ms": round(float(np.median(dur)), 3),
            "search_p99_during_ms": round(float(np.percentile(dur, 99)), 3),
            "installed_s_after_first_delete": installed, "dead_at_end": int(dense.ann.dead),
            "live_at_end": int(dense.ann.live)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="a bench data dir whose shard-0 snapshot holds the vectors")
    ap.add_argument("--vectors", type=int, default=60_000)
    ap.add_argument("--delete", type=int, default=0, help="chunks deleted (default: 40%% of --vectors)")
    ap.add_argument("--batch", type=int, default=200, help="chunks a delete write (default 200)")
    ap.add_argument("--rate", type=float, default=2000.0, help="chunks/s the deletes arrive at (0: back to back)")
    ap.add_argument("--top-n", type=int, default=256)
    ap.add_argument("--arms", default="sync,background")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import faiss  # noqa: PLC0415

    faiss.omp_set_num_threads(1)  # (as a shard process)
    x = read_vectors(a.data_dir, a.vectors)
    delete = a.delete or int(0.4 * x.shape[0])
    out = {"vectors": int(x.shape[0]), "delete": delete, "batch": a.batch, "rate": a.rate,
           "arms": [run_arm(x, delete, a.batch, a.rate, a.top_n, arm == "background") for arm in a.arms.split(",")]}
    print(json.dumps(out, indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
