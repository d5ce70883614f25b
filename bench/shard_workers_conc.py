"""Hybrid Retrieve throughput at concurrency C, ``--shard-workers`` process vs thread, on one data
dir (arms alternate: process, thread, process, thread); query vectors supplied (chunk vectors
plus Gaussian noise, as ``bench.hotpath``), ``n`` requests spread over C client threads.

    python -m bench.shard_workers_conc <data dir> <C> <n>
"""
import os, sys, time, threading, numpy as np
from pathlib import Path
from oprag_client.client import OpRAGClient, query_request
from oprag_client.testing import ServerProcess
from ._common import read_snapshot, percentile


def main(argv: list[str]) -> int:
    data, C, n = argv[0], int(argv[1]), int(argv[2])
    snap = read_snapshot(Path(data))
    rng = np.random.default_rng(0)
    rows = rng.choice(len(snap["vectors"]), 400, replace=False)
    Q = snap["vectors"][rows] + 0.05 * rng.standard_normal((400, snap["vectors"].shape[1])).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    reqs = [query_request(snap["text"][r][:200], top_k=10, mode="hybrid", query_vector=q.tolist()) for r, q in zip(rows, Q)]
    for w in ["process", "thread", "process", "thread"]:
        srv = ServerProcess.on_free_ports(data, "--generator", "none", "--shards", "2", "--shard-workers", w).start()
        try:
            with OpRAGClient(srv.target) as c:
                for r in reqs[:30]: c.stub.Retrieve(r)
                lat, lock = [], threading.Lock()
                def worker(k):
                    out = []
                    for i in range(k, n, C):
                        t = time.perf_counter(); c.stub.Retrieve(reqs[i % 400]); out.append((time.perf_counter() - t) * 1e3)
                    with lock: lat.extend(out)
                t0 = time.perf_counter()
                ts = [threading.Thread(target=worker, args=(k,)) for k in range(C)]
                [t.start() for t in ts]; [t.join() for t in ts]
                wall = time.perf_counter() - t0
                print(w, f"C={C} qps={n / wall:.0f} p50={percentile(lat, 50):.2f} p95={percentile(lat, 95):.2f} load={os.getloadavg()[0]:.2f}", flush=True)
        finally:
            srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
