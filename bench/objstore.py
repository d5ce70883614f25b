"""Commit latency and ingest throughput with shard logs on object storage (``--storage-uri
file://...``, the ``pyarrow.fs`` path an ``s3://`` URI takes) against the plain local data
directory, side by side.

From the repository root:

    python -m bench.objstore --json                 # 8 rounds
    python -m bench.objstore --rounds 2 --json      # smoke

Two real servers (``--shards 2 --generator none``), one with ``--storage-uri`` under
``bench/out/objstore/bucket``, run at the same time and are driven in alternating order, round
by round (AB, BA, ...). Per round and server: ``--commits`` single-document ingest streams one
after the other (each is one transaction: stage, prepare on both shards -- fsync of the local
log, plus one PUT per shard with storage --, the commit log's fsync, apply; timed at the client
from the first message to the acknowledgement), then one bulk stream of ``--bulk`` documents
(one chunk each, vectors supplied, so no embedding) timed for chunks/s. Percentiles are nearest
rank. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import numpy as np

from oprag_client.client import Doc, OpRAGClient

from ._common import OUT as BENCH_OUT
from ._common import emit_json, log, machine_info, start_server, summarize

OUT = BENCH_OUT / "objstore"
DIM = 384  # MiniLM's width: the server checks supplied vectors against its embedder


def _docs(rng: np.random.Generator, prefix: str, n: int) -> list[Doc]:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return [Doc(f"{prefix}-{i}", f"Harbour log {prefix} {i}: the keeper noted wind and tide.", vector=v[i])
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--commits", type=int, default=20, help="single-document transactions per round and server")
    ap.add_argument("--bulk", type=int, default=1000, help="documents (= chunks) of the bulk stream per round")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    info = machine_info()
    shutil.rmtree(OUT, ignore_errors=True)
    bucket = (OUT / "bucket").resolve()
    servers = {
        "local": start_server(OUT / "local", "--generator", "none", "--shards", "2", log_path=OUT / "local.log"),
        "objstore": start_server(OUT / "obj", "--generator", "none", "--shards", "2", "--storage-uri",
                                 bucket.as_uri(), log_path=OUT / "obj.log"),
    }
    rng = np.random.default_rng(0)
    commit_s = {k: [] for k in servers}
    bulk_cps = {k: [] for k in servers}
    try:
        clients = {k: OpRAGClient(s.target, timeout=120) for k, s in servers.items()}
        for k, c in clients.items():  # warm-up
            for i in range(3):
                c.ingest(_docs(rng, f"warm{i}", 1))
        for rnd in range(a.rounds):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            for k in order:
                c = clients[k]
                for i in range(a.commits):
                    docs = _docs(rng, f"r{rnd}c{i}", 1)
                    t0 = time.perf_counter()
                    c.ingest(docs)
                    commit_s[k].append(time.perf_counter() - t0)
                docs = _docs(rng, f"r{rnd}bulk", a.bulk)
                t0 = time.perf_counter()
                r = c.ingest(docs)
                assert r.chunks_written == a.bulk, r
                bulk_cps[k].append(r.chunks_written / (time.perf_counter() - t0))
            log(f"round {rnd}: commit p50 " + ", ".join(
                f"{k} {statistics.median(v[-a.commits:]) * 1000:.2f} ms" for k, v in commit_s.items())
                + "; bulk " + ", ".join(f"{k} {v[-1]:.0f} chunks/s" for k, v in bulk_cps.items()))
        objects = sum(len(f) for _, _, f in os.walk(bucket))
        for c in clients.values():
            c.close()
    finally:
        for s in servers.values():
            s.stop()
    res = {k: {"commit": summarize(commit_s[k]), "bulk_chunks_per_s_median": round(statistics.median(bulk_cps[k]), 1),
               "bulk_chunks_per_s": [round(x, 1) for x in bulk_cps[k]]} for k in servers}
    out = {
        "rounds": a.rounds, "commits_per_round": a.commits, "bulk_docs": a.bulk, "shards": 2,
        **res,
        "commit_p50_ratio": round(res["objstore"]["commit"]["p50_ms"] / res["local"]["commit"]["p50_ms"], 3),
        "commit_p50_added_ms": round(res["objstore"]["commit"]["p50_ms"] - res["local"]["commit"]["p50_ms"], 3),
        "bulk_ratio": round(res["objstore"]["bulk_chunks_per_s_median"] / res["local"]["bulk_chunks_per_s_median"], 3),
        "objects_in_bucket_at_end": objects,
        "machine": {**info, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    log(out)
    if a.json:
        emit_json(out)


if __name__ == "__main__":
    main()
