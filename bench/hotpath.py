"""Retrieve hot path, side by side: the same data dir served by each given source tree in turn
(interleaved rounds), Retrieve latency over gRPC at c=1 with the query vector supplied, the
server's own ``retrieve`` timing, and the server process tree's CPU time per request.

Queries are chunk vectors of the snapshot perturbed by Gaussian noise (sigma 0.05 per
coordinate, renormalised) with the first 200 characters of the same chunk as the text: the
hot path's cost, not retrieval quality, is measured. Needs a data dir that already holds a
corpus (for example the one ``bench.retrieval`` builds) and psutil (bench extra).

    python -m bench.hotpath --data-dir bench/out/retrieval-data --tree /path/to/old --tree . --json
    python -m bench.hotpath --data-dir bench/out/retrieval-data --tree /path/to/old --tree . --modes "" --ingest
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from ._common import emit_json, hotpath_queries, log, machine_info, percentile, read_snapshot, require


def one(tree: Path, a, texts: list[str], Q: np.ndarray, arm: str = "", hits: dict | None = None) -> dict:
    """Start a server from ``tree`` on ``a.data_dir`` (with the extra server arguments ``arm``,
    space-separated); per mode: p50/p95 wall ms, server ``retrieve`` p50 ms, server CPU ms per
    request. ``hits``: ``{mode: [serialised hits per query]}`` of an earlier arm, filled by the
    first; ``identical_hits`` says whether this arm's equal it."""
    import psutil
    from oprag_client.client import OpRAGClient, query_request
    from oprag_client.testing import ServerProcess

    env = {"PYTHONPATH": f"{tree}/server:{tree}/client:{tree}"}
    srv = ServerProcess.on_free_ports(a.data_dir, "--generator", "none", "--shards", str(a.shards), *a.server_arg,
                                      *arm.split(), env=env).start()
    out = {}
    try:
        with OpRAGClient(srv.target) as c:
            for mode in a.modes.split(","):
                reqs = [query_request(t, top_k=10, mode=mode, query_vector=q.tolist()) for t, q in zip(texts, Q)]
                for r in reqs[: a.warmup]:
                    c.stub.Retrieve(r)
                tree_p = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
                each = lambda: [p.cpu_times().user + p.cpu_times().system for p in tree_p]  # noqa: E731
                cpu = lambda: sum(each())  # noqa: E731
                e0 = each()
                c0, lat, sv, got = sum(e0), [], [], []
                for r in reqs:
                    t = time.perf_counter()
                    rep = c.stub.Retrieve(r)
                    lat.append((time.perf_counter() - t) * 1000)
                    sv.append(rep.timings_ms.get("retrieve", 0.0))
                    got.append(b"".join(h.SerializeToString(deterministic=True) for h in rep.hits))
                out[mode] = {"p50_ms": round(percentile(lat, 50), 2), "p95_ms": round(percentile(lat, 95), 2),
                             "server_retrieve_p50_ms": round(percentile(sv, 50), 2),
                             "server_cpu_ms_per_request": round((cpu() - c0) / len(reqs) * 1000, 2),
                             # frontend first, then its child processes (shards; a helper process ~0)
                             "process_cpu_ms_per_request": [round((b - a) / len(reqs) * 1000, 2)
                                                            for a, b in zip(e0, each())],
                             "load": round(os.getloadavg()[0], 2)}
                if hits is not None:
                    out[mode]["identical_hits"] = hits.setdefault(mode, got) == got
                log(f"{tree} {arm} {mode}: {out[mode]}")
    finally:
        srv.stop()
    return out


def ingest(tree: Path, a, snap: dict) -> dict:
    """Ingest every chunk of the snapshot with its own vector (documents as in the snapshot,
    ``--per-stream`` documents per stream, one stream at a time) into a fresh data dir served
    from ``tree``: chunks/s (wall) and server CPU seconds per process (frontend, shards)."""
    import shutil

    import psutil
    from oprag_client.client import Doc, OpRAGClient
    from oprag_client.testing import ServerProcess

    by_doc: dict[str, list[int]] = {}
    for i, d in enumerate(snap["doc_id"]):
        by_doc.setdefault(d, []).append(i)
    # a tree whose proto predates Document.vectors_f32 gets the float form (what its client sent)
    packed = "vectors_f32" in (tree / "proto/oprag/v1/oprag.proto").read_text()
    vec = (lambda v: v) if packed else (lambda v: v.tolist())  # noqa: E731
    docs = [Doc(d, title=snap["title"][rows[0]], chunks=[(snap["text"][r], vec(snap["vectors"][r])) for r in rows])
            for d, rows in by_doc.items()]
    data = a.data_dir.parent / "hotpath-ingest"
    shutil.rmtree(data, ignore_errors=True)
    env = {"PYTHONPATH": f"{tree}/server:{tree}/client:{tree}"}
    srv = ServerProcess.on_free_ports(data, "--generator", "none", "--shards", str(a.shards), env=env).start()
    try:
        procs = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        cpu = lambda: [p.cpu_times().user + p.cpu_times().system for p in procs]  # noqa: E731
        with OpRAGClient(srv.target, timeout=3600) as c:
            c0, t = cpu(), time.perf_counter()
            parts = [docs[i:i + a.per_stream] for i in range(0, len(docs), a.per_stream)]
            if a.ingest_streams > 1:  # K streams at once (thread pool over the parts)
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(a.ingest_streams) as ex:
                    n = sum(r.chunks_written for r in ex.map(c.ingest, parts))
            else:
                n = sum(c.ingest(p).chunks_written for p in parts)
            wall, c1 = time.perf_counter() - t, cpu()
    finally:
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)
    out = {"chunks": n, "chunks_per_s": round(n / wall), "server_cpu_s": [round(y - x, 2) for x, y in zip(c0, c1)],
           "chunks_per_server_cpu_s": round(n / max(1e-9, sum(c1) - sum(c0))), "streams": a.ingest_streams, "load": round(os.getloadavg()[0], 2)}
    log(f"{tree} ingest: {out}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--tree", type=Path, action="append", required=True, help="source tree (repeatable)")
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="hybrid,dense")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--arm", action="append", default=None,
                    help="extra server arguments of one arm, space-separated (repeatable; each tree runs every arm "
                         "per round, and every arm's hits must equal the first's), e.g. --arm='--shard-workers thread'")
    ap.add_argument("--ingest", action="store_true", help="also own-vector ingest per tree and round")
    ap.add_argument("--per-stream", type=int, default=500, help="documents per ingest stream")
    ap.add_argument("--ingest-streams", type=int, default=1, help="concurrent ingest streams")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    require("psutil", what="the server CPU measurement")
    snap = read_snapshot(a.data_dir)
    Q, texts = hotpath_queries(snap, a.queries)
    result = {"machine": machine_info(), "chunks": len(snap["vectors"]), "runs": []}
    arms, hits, same = a.arm or [""], {}, True
    for r in range(a.rounds):
        for tree in a.tree:
            for arm in arms:
                run = {"round": r, "tree": str(tree), "arm": arm,
                       **(one(tree.resolve(), a, texts, Q, arm, hits if a.arm else None) if a.modes else {})}
                same &= all(v.get("identical_hits", True) for v in run.values() if isinstance(v, dict))
                if a.ingest:
                    run["ingest"] = ingest(tree.resolve(), a, snap)
                result["runs"].append(run)
    if a.json:
        emit_json(result)
    if not same:
        log("the arms' hits differ (identical_hits false above)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
