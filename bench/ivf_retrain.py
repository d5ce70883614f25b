"""How long an IVF shard's request loop is held while it grows past a retraining size (issue 13, session 40).

One shard's dense index (:class:`oprag_server.index.dense.DenseIndex`, IVF, the server's defaults: ``--ivf-train-min``
4096, retrained at each 8x growth) takes the vectors of a real data dir's shard (``chunks.arrow`` of its snapshot: the
1M bench's SciFact / WikiText MiniLM and derived vectors) in writes of ``--batch`` chunks, as an ingest's applies do,
up to ``--vectors``, arriving at ``--rate`` chunks/s; after every write one dense search (``--top-n`` candidates, the default ``nprobe``) of a vector
held by the shard runs, as a query that came in between. In-process, one thread serves both, as a shard process does.
Two arms, run one after the other in this process:

* ``sync``: every retraining in the write that crossed the size (the code before session 40: ``BACKGROUND_MIN``
  set above any size);
* ``background``: retrainings of >= ``BACKGROUND_MIN`` vectors in the build's thread (:mod:`oprag_server.index.ivf_build`).

Per arm: the longest write and the write p99 (ms), each write over 100 ms (ms, chunks held after it, what it did), the search p50 / p99 / max (ms)
over all searches and over those while a build ran, the whole run's seconds, and the retrainings (vectors, lists,
seconds, how). Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.ivf_retrain --data-dir bench/out/scale-1000000-ivf --vectors 300000 --json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one BLAS thread, as in a shard process
    os.environ.setdefault(_v, "1")

import numpy as np
import pyarrow as pa


def read_vectors(data_dir: str, n: int) -> np.ndarray:
    """float32[n, D]: the first ``n`` vectors of shard 0's current snapshot (``chunks.arrow``, an Arrow stream)."""
    snap = sorted(glob.glob(f"{data_dir}/shard-0/snap-*/chunks.arrow"))[-1]
    out, held = [], 0
    with pa.memory_map(snap) as src:
        r = pa.ipc.open_stream(src)
        for b in r:
            col = b.column("vector")
            d = col.type.list_size
            out.append(col.values.to_numpy(zero_copy_only=False).reshape(-1, d)[: n - held].copy())
            held += out[-1].shape[0]
            if held >= n:
                break
    return np.concatenate(out)


def run_arm(x: np.ndarray, batch: int, top_n: int, background: bool, rate: float) -> dict:
    from oprag_server.config import DenseConfig  # noqa: PLC0415
    from oprag_server.index import ann as ann_mod  # noqa: PLC0415
    from oprag_server.index import ivf_build  # noqa: PLC0415
    from oprag_server.index.dense import DenseIndex  # noqa: PLC0415

    ann_mod.BACKGROUND_MIN = ivf_build.BACKGROUND_MIN if background else 1 << 62
    dense = DenseIndex(x.shape[1], DenseConfig(kind="ivf"))
    rng = np.random.default_rng(0)
    writes, searches, during, trainings, slow = [], [], [], [], []
    t0 = time.perf_counter()
    for a in range(0, x.shape[0], batch):
        if rate > 0:  # the next write arrives on the ingest's pace (the shard idles until then)
            time.sleep(max(0.0, t0 + a / rate - time.perf_counter()))
        t, cap, was = time.perf_counter(), dense._vecs.shape[0], dense.ann_building  # noqa: SLF001
        dense.add(np.arange(a, min(a + batch, x.shape[0]), dtype=np.int64), x[a:a + batch])
        if dense.ann_building:  # (what the shard's loop does between requests)
            dense.install_ann()
        writes.append(time.perf_counter() - t)
        if writes[-1] > 0.1:  # what held the loop
            why = [("retrained in the write" if how is None else "installed a build") for *_, how in dense.ann.trainings]
            why += ["float32 copy grown"] if dense._vecs.shape[0] != cap else []  # noqa: SLF001
            why += ["build started"] if was is None and dense.ann_building is not None else []
            slow.append([round(writes[-1] * 1e3, 1), a + batch, ", ".join(why) or "?"])
        trainings += dense.ann.trainings
        dense.ann.trainings.clear()
        q = x[rng.integers(0, min(a + batch, x.shape[0]))][None, :]
        t = time.perf_counter()
        dense.search(q, top_n)
        searches.append(time.perf_counter() - t)
        if dense.ann_building is False:
            during.append(searches[-1])
    total = time.perf_counter() - t0
    left = dense.ann_building is not None
    if left:  # (a build still running at the end: waited for, installed, its time reported)
        dense.install_ann()
        trainings += [(*t[:3], f"{t[3]} (after the last write)") for t in dense.ann.trainings]
    w, s = np.array(writes) * 1e3, np.array(searches) * 1e3
    dur = np.array(during) * 1e3 if during else np.zeros(1)
    return {"arm": "background" if background else "sync", "writes": len(writes),
            "write_max_ms": round(float(w.max()), 1), "write_p99_ms": round(float(np.percentile(w, 99)), 2),
            "writes_over_100ms": slow,
            "search_p50_ms": round(float(np.median(s)), 3), "search_p99_ms": round(float(np.percentile(s, 99)), 3),
            "search_max_ms": round(float(s.max()), 1), "searches_during_build": len(during),
            "search_p50_during_build_ms": round(float(np.median(dur)), 3),
            "search_p99_during_build_ms": round(float(np.percentile(dur, 99)), 3),
            "total_s": round(total, 1), "chunks_per_s": round(x.shape[0] / total), "build_left_at_end": left,
            "trainings": [[n, lists, round(secs, 2), how or "in the write"] for n, lists, secs, how in trainings]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="a bench data dir whose shard-0 snapshot holds the vectors")
    ap.add_argument("--vectors", type=int, default=300_000, help="vectors written (default 300,000: one 262,144 "
                    "retraining at the defaults)")
    ap.add_argument("--batch", type=int, default=1000, help="chunks a write (default 1,000)")
    ap.add_argument("--top-n", type=int, default=256, help="dense candidates a search asks for (default 256)")
    ap.add_argument("--rate", type=float, default=3500.0, help="chunks/s the writes arrive at (default 3,500: the "
                    "1M bench's served ingest, ~7,000 chunks/s over 2 shards; 0: back to back)")
    ap.add_argument("--arms", default="sync,background")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import faiss  # noqa: PLC0415

    faiss.omp_set_num_threads(1)  # (as a shard process)
    x = read_vectors(a.data_dir, a.vectors)
    out = {"vectors": int(x.shape[0]), "batch": a.batch,
           "rate": a.rate,
           "arms": [run_arm(x, a.batch, a.top_n, arm == "background", a.rate) for arm in a.arms.split(",")]}
    print(json.dumps(out, indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
