"""The gRPC floor under a Retrieve, side by side per source tree: the round trip of a gRPC
Health check (no OpRAG code on the path) against Retrieve at c = 1 with the query vector
supplied (dense top_k 1 and 10, lexical 10, hybrid 10; one fixed question and one fixed unit
vector), with the server's own ``retrieve`` timing. What a Retrieve costs above the Health
round trip and above its ``retrieve`` timing is the servicer, the conversions, the engine's
hand-offs and gRPC's handling of the larger messages.

Each tree serves the same ``--data-dir`` in turn (``--rounds`` alternations); ms, p50 / p95
(nearest rank, :func:`._common.percentile`) of ``--calls`` calls after 50 warm-up calls.

    python -m bench.floor --data-dir <copy of a data dir> --tree <old> --tree <new> --rounds 2 \
        [--server-arg=--shard-workers --server-arg=thread] --json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from ._common import emit_json, log, machine_info, percentile

CALLS = [("dense", 1), ("dense", 10), ("lexical", 10), ("hybrid", 10)]


def _timed(f, n: int) -> tuple[float, float]:
    for _ in range(50):
        f()
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        lat.append((time.perf_counter() - t) * 1000)
    return round(percentile(lat, 50), 3), round(percentile(lat, 95), 3)


def one(tree: Path, a) -> dict:
    """Serve ``a.data_dir`` from ``tree``; ``{"health": [p50, p95], "dense@1": {...}, ...}``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from oprag_client.client import OpRAGClient, query_request
    from oprag_client.testing import ServerProcess

    env = {"PYTHONPATH": f"{tree}/server:{tree}/client:{tree}"}
    srv = ServerProcess.on_free_ports(a.data_dir, "--generator", "none", "--shards", "2", *a.server_arg,
                                      env=env).start()
    out: dict = {"tree": str(tree)}
    try:
        with OpRAGClient(srv.target) as c, grpc.insecure_channel(srv.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            out["health"] = _timed(lambda: health.Check(health_pb2.HealthCheckRequest()), a.calls)
            q = np.random.default_rng(0).standard_normal(384).astype(np.float32)
            q /= np.linalg.norm(q)
            for mode, k in CALLS:
                r = query_request("protein expression in cells", top_k=k, mode=mode, query_vector=q.tolist())
                server: list[float] = []
                p50, p95 = _timed(lambda r=r: server.append(c.stub.Retrieve(r).timings_ms.get("retrieve", 0.0)),
                                  a.calls)
                out[f"{mode}@{k}"] = {"p50_ms": p50, "p95_ms": p95,
                                      "server_retrieve_p50_ms": round(percentile(server, 50), 3)}
        out["load"] = round(os.getloadavg()[0], 2)
        log(out)
    finally:
        srv.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--tree", type=Path, action="append", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    runs = [{"round": i, **one(t.resolve(), a)} for i in range(a.rounds) for t in a.tree]
    if a.json:
        emit_json({"machine": machine_info(), "server_args": a.server_arg, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
