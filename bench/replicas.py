"""Replicas (``--replicas 2``) under replica loss: real shard processes over pipes, SIGKILL.

    python -m bench.replicas --kills 5 --json

Two shards with two replicas each (:class:`ReplicaSet` over :class:`PipeTransport`, each
replica its own process and data directory), a writer committing ``docs_per_txn``-document
transactions (stage, two-phase commit) and a reader running SEARCH every 10 ms. ``kills`` times a
replica process of shard 0 is SIGKILLed (alternately replica 0 and 1), the supervisor brings it
back (a sibling's snapshot copied, a fresh process loads it, the writes since are replayed), and
when it serves again its sibling is killed next, so every acknowledged write must be on the
replica that came back. Reported: ``failed_requests`` (failed writes + failed queries),
``partial_results`` (a query with a shard missing), ``acked_docs_lost``, ``identical_results``
(top 10 of 20 queries against an in-process reference fed the acknowledged transactions),
``catch_up_s`` (the supervisor's revive of the replica) and ``kill_to_serving_s``. Used by
``bench.cluster`` (the R = 2 figures); server internals through ``bench/_internals.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from . import _internals
from .cluster import DIM, WriteLoad, _Health, _Metrics, _pct, acked_docs_lost, ingest, search_request, top_chunks


async def replica_loss(S, data_dir: Path, *, kills: int = 5, chunks_per_doc: int = 5, docs_per_txn: int = 20,
                       warm_txns: int = 5, timeout_s: float = 60.0, cluster=None) -> dict:
    """See the module doc; with ``cluster`` (a ``ray.cluster_utils.Cluster``) the replicas are
    Ray actors (one bundle each, SPREAD) and a kill removes the node holding the replica (a
    fresh node joins as the spare). :returns: counts and times."""
    loop = asyncio.get_running_loop()
    P = S.protocol
    transport = S.PipeTransport if cluster is None else \
        S.RayPlacement(S.RayConfig(address=cluster.address, ping_s=0.25), 2, 2)
    pool = S.ShardPool(2, DIM, data_dir, replicas=2, transport=transport)
    lock = S.RWLock()
    cp = S.CommitProtocol(pool, S.CorpusStats(), lock)
    cp.open_log(data_dir / "commits.log")
    await loop.run_in_executor(None, lambda: pool.start(loop, committed=set()))
    metrics = _Metrics()
    sup = S.ShardSupervisor(pool, lambda i: S.restart_shard(pool, i, committed=cp.committed_txns, lock=lock,
                                                            stats=cp.stats), _Health(), ("",), metrics, interval_s=0.1)
    load = WriteLoad(S, cp, docs_per_txn, chunks_per_doc)
    acked, seeds = load.acked, load.seeds
    counts = {"queries": 0, "failed_queries": 0, "partial_results": 0}
    stop = asyncio.Event()

    async def reader():
        r = 0
        while not stop.is_set():
            try:
                got, missing = await pool.gather_partial(P.Op.SEARCH, search_request(S, r))
                counts["partial_results"] += bool(missing) or len(got) != pool.n
                counts["queries"] += 1
            except Exception:  # noqa: BLE001 - every exception is a failed query
                counts["failed_queries"] += 1
            r += 1
            await asyncio.sleep(0.01)

    sup_stop = asyncio.Event()
    tasks = [asyncio.create_task(sup.run(sup_stop)), asyncio.create_task(load.run(stop)),
             asyncio.create_task(reader())]
    while len(acked) < warm_txns:
        await asyncio.sleep(0.05)
    shard = pool.clients[0]
    serving_s, nodes = [], []
    for k in range(kills):
        r = k % 2
        old = shard.reps[r]
        if cluster is None:
            old.proc.kill()  # SIGKILL
        else:
            nodes.append([t.node_id for t in shard.reps])
            node = next(n for n in cluster.worker_nodes if n.node_id == old.node_id)
            cluster.remove_node(node, allow_graceful=False)
            cluster.add_node(num_cpus=1)
        t0 = time.perf_counter()
        while shard.reps[r] is old or not shard.serving[r]:
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"replica {r} of shard 0 not serving again within {timeout_s} s")
            await asyncio.sleep(0.02)
        serving_s.append(time.perf_counter() - t0)
        n = len(acked)
        while len(acked) < n + 2:  # writes flow on both replicas again
            await asyncio.sleep(0.02)
    stop.set()
    await asyncio.gather(*tasks[1:])
    sup_stop.set()
    tasks[0].cancel()
    lost = await acked_docs_lost(S, pool, acked)
    ref = S.in_process_pool([S.ShardState(i, DIM, None) for i in range(2)])
    rcp = S.CommitProtocol(ref, S.CorpusStats(), S.RWLock())
    for txn in sorted(acked, key=lambda t: seeds[t]):
        await ingest(S, rcp, txn, acked[txn], chunks_per_doc, seed=seeds[txn])
    identical = True
    for q in range(20):  # twice each: consecutive reads go to different replicas
        b, _ = await ref.gather_partial(P.Op.SEARCH, search_request(S, 10_000 + q))
        for _ in range(2):
            a, _ = await pool.gather_partial(P.Op.SEARCH, search_request(S, 10_000 + q))
            identical &= top_chunks(a) == top_chunks(b)
    docs = sum(st.documents for st in await pool.broadcast(P.Op.STATS, P.StatsRequest()))
    await pool.shutdown(snapshot=False)
    rec = metrics.recovery_s
    counts.update(writes=load.writes, failed_writes=load.failed_writes)
    return {**counts, "failed_requests": counts["failed_writes"] + counts["failed_queries"], "kills": kills,
            "acked_txns": len(acked), "acked_docs": sum(map(len, acked.values())), "acked_docs_lost": lost,
            "documents_after": docs, "identical_results": bool(identical),
            "catch_up_s": [round(x, 2) for x in rec], "catch_up_p50_s": round(_pct(rec, 50), 2) if rec else None,
            "kill_to_serving_s": [round(x, 2) for x in serving_s],
            **({"replicas_on_distinct_nodes": all(len(set(n)) == 2 for n in nodes)} if cluster is not None else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--ray", action="store_true", help="replicas as Ray actors on a 5-node local Ray cluster")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res: dict = {"load_before": os.getloadavg()}
    cluster = None
    if a.ray:
        from .cluster import start_cluster

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        cluster = start_cluster(workers=5)  # 4 bundles + a spare
    try:
        with tempfile.TemporaryDirectory() as tmp:
            res["replica_loss"] = asyncio.run(replica_loss(_internals.shard_plane(), Path(tmp), kills=a.kills,
                                                           cluster=cluster))
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    res["load_after"] = os.getloadavg()
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
