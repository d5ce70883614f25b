"""Shards on Ray: the data plane (pipe vs Ray actor calls) and node loss on a real multi-node
Ray cluster (``ray.cluster_utils.Cluster``: separate raylets on this machine).

    python -m bench.cluster --json                   # data plane + 5 node kills
    python -m bench.cluster --data-plane-only --json
    python -m bench.cluster --kills 1 --json

Data plane: three 2-shard pools side by side, over pipes (:class:`PipeTransport`), over Ray
actor calls (``--ray-channel actor``) and over direct TCP channels to Ray actors
(``--ray-channel direct``), all with ``--ray-address local``, each holding the same ~12K synthetic chunks (random
unit vectors, D=384, a small vocabulary); then ``--rounds`` alternating rounds of the shard
half of a Retrieve (SEARCH hybrid, n=256, B=1 on both shards, then FETCH of the top 5) and a
null op (STATS), timed at the pool (nearest-rank percentiles). No models are involved.

Node loss (:func:`node_loss`): 3 one-CPU worker nodes plus a zero-CPU head (the frontend's
node); 2 shards land on 2 different workers. Under concurrent commits and queries, the node
holding shard 0 is killed, the supervisor revives the shard (Ray restarts the actor on the
spare node, it reloads snapshot + committed log from the shared data dir) and a fresh node
joins for the next kill. Reported: ``acked_docs_lost`` (acknowledged documents missing
after recovery), ``silent_partial_results`` (a query with fewer shard replies than shards and
no shard reported missing), ``partial_results``, ``failed_writes`` (UNAVAILABLE while down),
``shard_recovery_s`` (the supervisor's revive: Ray placing the actor + reload),
``kill_to_serving_s`` (node kill until the shard serves on another node), and whether results equal those of an in-process reference fed the
same committed transactions (``identical_results``).

Replicas (R = 2, :func:`bench.replicas.replica_loss`): ``replica_loss_pipes`` SIGKILLs a
replica process of shard 0 ``--kills`` times (alternately replica 0 and 1, each once its
sibling serves again), ``replica_loss_ray`` removes the node holding it (5 one-CPU workers):
``failed_requests`` (writes + queries), ``acked_docs_lost``, ``identical_results``, ``catch_up_s``.

Server internals come through ``bench/_internals.py`` (:func:`~bench._internals.shard_plane`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import _internals

DIM = 384
VOCAB = [f"w{i}" for i in range(200)]


def _pct(xs: list[float], p: float) -> float:
    from oprag_client.evaluate import percentile

    return percentile(sorted(xs), p)


def make_batch(S, doc_ids: list[str], chunks_per_doc: int, seed: int):
    """An Arrow chunk batch: ``chunks_per_doc`` chunks per document, random unit float32[D]
    vectors and 12-word texts drawn from a 200-word vocabulary (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    n = len(doc_ids) * chunks_per_doc
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    texts = [" ".join(rng.choice(VOCAB, 12)) for _ in range(n)]
    docs = [d for d in doc_ids for _ in range(chunks_per_doc)]
    return S.records.make_chunk_batch(
        chunk_ids=[f"{d}#{i % chunks_per_doc}" for i, d in enumerate(docs)], doc_ids=docs, titles=[""] * n,
        texts=texts, metadata=[{}] * n, ordinals=[i % chunks_per_doc for i in range(n)], generations=[1] * n,
        content_hashes=texts, vectors=v)


async def ingest(S, cp, txn: str, doc_ids: list[str], chunks_per_doc: int, seed: int):
    """Stage each shard's part of the batch, then two-phase commit ``txn``."""
    pool = cp.pool
    batch = make_batch(S, doc_ids, chunks_per_doc, seed)
    by = pool.group(list(range(batch.num_rows)), lambda i: pool.owner(doc_ids[i // chunks_per_doc]))
    for shard, rows in by.items():
        part = batch.take(rows)
        await pool.call(shard, S.protocol.Op.STAGE, S.protocol.StageRequest(txn, S.records.to_ipc(part)))
    return await cp.commit(txn, "upsert")


def search_request(S, seed: int, n: int = 256):
    """SEARCH hybrid for one query (B=1): a random unit vector and 3 vocabulary terms."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, DIM)).astype(np.float32)
    q /= np.linalg.norm(q)
    terms = [list(rng.choice(VOCAB, 3))]
    P = S.protocol
    return P.SearchRequest(P.QueryBatch(q, terms, [np.full(3, 1.5)], 12.0, 1.5, 0.75), "hybrid", n)


def top_chunks(replies: dict, k: int = 10) -> list[tuple[str, float, float]]:
    """The global top-k ``(chunk id, dense, lexical)`` by dense score over every shard reply."""
    rows = [(cid, float(c.dense[j]), float(c.lexical[j])) for r in replies.values() for c in r.candidates
            for j, cid in enumerate(c.chunk_ids)]
    return sorted(rows, key=lambda t: (-t[1], t[0]))[:k]


class WriteLoad:
    """Commits transactions ``t0, t1, ...`` of ``docs_per_txn`` documents (``chunks_per_doc``
    chunks each, seed = the transaction's number) until ``stop`` is set, as the node-loss and
    replica-loss runs' writer. ``acked``: transaction -> document ids acknowledged; ``failed``:
    those whose commit raised ``ShardError`` (aborted on the shards that answer; it may still have
    landed if it failed after the commit point); ``pause_s`` after a failure."""

    def __init__(self, S, cp, docs_per_txn: int, chunks_per_doc: int, pause_s: float = 0.0) -> None:
        self.S, self.cp, self.docs_per_txn, self.chunks_per_doc, self.pause_s = S, cp, docs_per_txn, chunks_per_doc, pause_s
        self.acked: dict[str, list[str]] = {}
        self.failed: dict[str, list[str]] = {}
        self.seeds: dict[str, int] = {}
        self.writes = self.failed_writes = 0

    async def run(self, stop: asyncio.Event) -> None:
        S, P, t = self.S, self.S.protocol, 0
        while not stop.is_set():
            txn, docs = f"t{t}", [f"d{t}-{i}" for i in range(self.docs_per_txn)]
            self.seeds[txn] = t
            try:
                await ingest(S, self.cp, txn, docs, self.chunks_per_doc, seed=t)
                self.acked[txn] = docs
                self.writes += 1
            except S.ShardError:
                self.failed[txn] = docs
                self.failed_writes += 1
                await self.cp.pool.gather_partial(P.Op.ABORT, P.AbortRequest(txn))
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)
            t += 1


async def acked_docs_lost(S, pool, acked: dict[str, list[str]]) -> int:
    """How many acknowledged document ids no shard holds (asked with REUSE per owner shard)."""
    P, present = S.protocol, set()
    for s in range(pool.n):
        ids = [d for docs in acked.values() for d in docs if pool.owner(d) == s]
        present |= set((await pool.call(s, P.Op.REUSE, P.ReuseRequest(ids))).vectors)
    return sum(d not in present for docs in acked.values() for d in docs)


# ------------------------------------------------------------------------------ data plane
async def data_plane(S, rounds: int, chunks: int) -> dict:
    """Pipe vs Ray actor round trips on identical 2-shard pools (see the module doc)."""
    loop = asyncio.get_running_loop()
    out: dict = {"chunks": chunks, "rounds": rounds}
    pools = {}
    with tempfile.TemporaryDirectory() as tmp:
        ray_cfg = {"address": "local", "shard_cpus": 0.5}  # two Ray pools on this machine's 2 CPUs
        for name, transport in (("pipe", S.PipeTransport),
                                ("ray_actor", S.RayPlacement(S.RayConfig(**ray_cfg, channel="actor"), 2)),
                                ("ray_direct", S.RayPlacement(S.RayConfig(**ray_cfg, channel="direct"), 2))):
            d = Path(tmp) / name
            pool = S.ShardPool(2, DIM, d, transport=transport)
            cp = S.CommitProtocol(pool, S.CorpusStats(), S.RWLock())
            cp.open_log(d / "commits.log")
            await loop.run_in_executor(None, lambda: pool.start(loop, committed=set()))
            per_doc, per_txn = 10, 100
            for t in range(chunks // (per_doc * per_txn)):
                await ingest(S, cp, f"t{t}", [f"d{t}-{i}" for i in range(per_txn)], per_doc, seed=t)
            pools[name] = pool
        P = S.protocol
        times = {f"{n}_{op}": [] for n in pools for op in ("retrieve", "null")}
        for r in range(rounds):
            req = search_request(S, r)
            for name, pool in pools.items():
                t0 = time.perf_counter()
                got, missing = await pool.gather_partial(P.Op.SEARCH, req)
                assert not missing
                best = {s: sorted(range(len(rep.candidates[0].slots)), key=lambda j: -rep.candidates[0].dense[j])[:5]
                        for s, rep in got.items()}
                await pool.gather_partial(P.Op.FETCH, [P.FetchRequest([int(got[s].candidates[0].slots[j]) for j in best[s]])
                                                       for s in sorted(got)])
                times[f"{name}_retrieve"].append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                await pool.broadcast(P.Op.STATS, P.StatsRequest())
                times[f"{name}_null"].append((time.perf_counter() - t0) * 1000)
        for k, v in times.items():
            out[f"{k}_p50_ms"] = round(_pct(v, 50), 3)
            out[f"{k}_p99_ms"] = round(_pct(v, 99), 3)
        for name in ("ray_actor", "ray_direct"):
            out[f"{name}_minus_pipe_retrieve_p50_ms"] = round(out[f"{name}_retrieve_p50_ms"] - out["pipe_retrieve_p50_ms"], 3)
        for pool in pools.values():
            await pool.shutdown(snapshot=False)
    return out


# ------------------------------------------------------------------------------ node loss
class _Health:
    async def set(self, name, status):
        pass


class _Metrics:
    """What :class:`ShardSupervisor` records, kept as plain numbers."""

    def __init__(self):
        self.recovery_s: list[float] = []
        me = self

        class _G:
            def set(self, v):
                pass

            def inc(self, v=1):
                pass

            def labels(self, **kw):
                return self

            def observe(self, v):
                me.recovery_s.append(v)

        self.shards_up = self.shard_restarts = self.stage_seconds = _G()


def start_cluster(workers: int = 3):
    """A Ray cluster on this machine: a zero-CPU head (the frontend's node) and ``workers``
    one-CPU nodes; node failure detected within about a second. Connects this process."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                           "health_check_failure_threshold": 3, "worker_niceness": 0}})
    for _ in range(workers):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


async def node_loss(S, cluster, data_dir: Path, *, kills: int = 1, chunks_per_doc: int = 5, docs_per_txn: int = 20,
                    warm_txns: int = 5, recovery_timeout_s: float = 60.0, preload_chunks: int = 0,
                    preload_snapshot: bool = True, storage: str | None = None) -> dict:
    """Kill the node holding shard 0 ``kills`` times under concurrent commits and queries
    (see the module doc). ``preload_chunks``: first commit that many chunks (10 per document,
    1,000 per transaction, supplied vectors) and snapshot every shard, as the server's periodic
    snapshot does, so shard 0 recovers from a snapshot of about half of them plus the log of
    the writes under load (``preload_snapshot=False``: no snapshot, the whole log is replayed).
    ``storage``: a ``--storage-uri``; then shard 0's local directory is deleted with its node
    (the next node has nothing) and it recovers from the store. :returns: the counts and recovery times."""
    loop = asyncio.get_running_loop()
    P = S.protocol
    pool = S.ShardPool(2, DIM, data_dir, transport=S.RayPlacement(S.RayConfig(address=cluster.address, ping_s=0.25), 2),
                       storage=storage)
    lock = S.RWLock()
    cp = S.CommitProtocol(pool, S.CorpusStats(), lock)
    cp.open_log(data_dir / "commits.log")
    await loop.run_in_executor(None, lambda: pool.start(loop, committed=set()))
    for t in range(preload_chunks // 1000):
        await ingest(S, cp, f"pre{t}", [f"pre{t}-{i}" for i in range(100)], 10, seed=100_000 + t)
    if preload_chunks and preload_snapshot:
        await pool.broadcast(P.Op.SNAPSHOT, P.SnapshotRequest())
        cp.reset_log()
    preloaded = [st.chunks for st in await pool.broadcast(P.Op.STATS, P.StatsRequest())]
    nodes0 = [c.node_id for c in pool.clients]
    metrics = _Metrics()
    sup = S.ShardSupervisor(pool, lambda i: S.restart_shard(pool, i, committed=cp.committed_txns, lock=lock,
                                                            stats=cp.stats), _Health(), ("",), metrics)
    load = WriteLoad(S, cp, docs_per_txn, chunks_per_doc, pause_s=0.05)
    acked, failed, seeds = load.acked, load.failed, load.seeds
    counts = {"queries": 0, "partial_results": 0, "silent_partial_results": 0, "failed_queries": 0}
    stop = asyncio.Event()

    async def reader():
        r = 0
        while not stop.is_set():
            try:
                got, missing = await pool.gather_partial(P.Op.SEARCH, search_request(S, r))
            except Exception:  # noqa: BLE001 - anything but a flagged partial is a failure
                counts["failed_queries"] += 1
                continue
            counts["queries"] += 1
            counts["partial_results"] += bool(missing)
            counts["silent_partial_results"] += len(got) + len(missing) != pool.n
            r += 1
            await asyncio.sleep(0.01)

    sup_stop = asyncio.Event()
    tasks = [asyncio.create_task(sup.run(sup_stop)), asyncio.create_task(load.run(stop)),
             asyncio.create_task(reader())]
    while len(acked) < warm_txns:
        await asyncio.sleep(0.05)
    moves, serving_s = [], []
    for _ in range(kills):
        victim = pool.clients[0].node_id
        node = next(n for n in cluster.worker_nodes if n.node_id == victim)
        cluster.remove_node(node, allow_graceful=False)
        if storage is not None:  # its disk went with it
            shutil.rmtree(data_dir / "shard-0", ignore_errors=True)
        cluster.add_node(num_cpus=1)  # a spare for the next kill
        t0 = time.perf_counter()
        while pool.clients[0].node_id == victim or not pool.clients[0].is_alive():
            if time.perf_counter() - t0 > recovery_timeout_s:
                raise TimeoutError(f"shard 0 not back on another node within {recovery_timeout_s} s")
            await asyncio.sleep(0.05)
        moves.append((victim, pool.clients[0].node_id))
        serving_s.append(time.perf_counter() - t0)
        n_acked = len(acked)
        while len(acked) < n_acked + 2:  # writes flow again
            await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*tasks[1:])
    sup_stop.set()
    tasks[0].cancel()
    # landed = acknowledged + failed after the commit point (in the commit log: replayed)
    committed = cp.committed_txns()
    landed = {t: d for t, d in {**failed, **acked}.items() if t in acked or t in committed}
    lost = await acked_docs_lost(S, pool, acked)
    ref = S.in_process_pool([S.ShardState(i, DIM, None) for i in range(2)])
    rcp = S.CommitProtocol(ref, S.CorpusStats(), S.RWLock())
    for t in range(preload_chunks // 1000):
        await ingest(S, rcp, f"pre{t}", [f"pre{t}-{i}" for i in range(100)], 10, seed=100_000 + t)
    for txn in sorted(landed, key=lambda t: seeds[t]):
        await ingest(S, rcp, txn, landed[txn], chunks_per_doc, seed=seeds[txn])
    identical = True
    for r in range(20):
        a, _ = await pool.gather_partial(P.Op.SEARCH, search_request(S, 10_000 + r))
        b, _ = await ref.gather_partial(P.Op.SEARCH, search_request(S, 10_000 + r))
        identical &= top_chunks(a) == top_chunks(b)
    after = await pool.broadcast(P.Op.STATS, P.StatsRequest())
    docs, chunks_after = sum(st.documents for st in after), [st.chunks for st in after]
    await pool.shutdown(snapshot=False)
    rec = metrics.recovery_s
    return {**counts, "failed_writes": load.failed_writes, "kills": kills, "acked_txns": len(acked),
            "acked_docs": sum(map(len, acked.values())), "acked_docs_lost": lost,
            "documents_after": docs, "landed_docs": sum(map(len, landed.values())) + preload_chunks // 1000 * 100,
            "identical_results": bool(identical), "shard_nodes_distinct": len(set(nodes0)) == 2,
            "moved_to_other_node": all(a != b for a, b in moves),
            "shard_recovery_s": [round(x, 2) for x in rec],
            "shard_recovery_p50_s": round(_pct(rec, 50), 2) if rec else None,
            "kill_to_serving_s": [round(x, 2) for x in serving_s], "preloaded_chunks_per_shard": preloaded,
            "shard_chunks_after": chunks_after}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=12_000)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--data-plane-only", action="store_true")
    ap.add_argument("--replicas-only", action="store_true", help="only the R = 2 replica-loss runs")
    ap.add_argument("--recovery-only", action="store_true",
                    help="only node loss with --preload-chunks committed first (the 10K-chunk shard recovery)")
    ap.add_argument("--preload-chunks", type=int, default=0,
                    help="node loss: commit this many chunks (both shards) and snapshot before the kills")
    ap.add_argument("--no-preload-snapshot", action="store_true",
                    help="no snapshot after the preload: a revived shard replays its whole log")
    ap.add_argument("--object-storage", action="store_true",
                    help="node loss with --storage-uri file://TMP/bucket: the lost node's shard directory is "
                         "deleted, the shard recovers from the store")
    ap.add_argument("--embed-only", action="store_true",
                    help="only ingest embedding over 1 vs 2 Ray embedding actors (bench/embed_actors.py)")
    ap.add_argument("--embed-chunks", type=int, default=4096, help="chunks embedded per setting (--embed-only)")
    ap.add_argument("--shared", type=Path, default=None, help="folder with data/ (the bench corpus; --embed-only)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    S = _internals.shard_plane()
    res: dict = {"load_before": os.getloadavg()}
    if a.embed_only:
        from .embed_actors import measure

        res["embed_actors"] = measure(a.embed_chunks, shared=a.shared)
        res["load_after"] = os.getloadavg()
        print(json.dumps(res) if a.json else json.dumps(res, indent=1))
        return 0
    if not (a.replicas_only or a.recovery_only):
        res["data_plane"] = asyncio.run(data_plane(S, a.rounds, a.chunks))
    if not (a.data_plane_only or a.replicas_only):
        import ray

        ray.shutdown()
        cluster = start_cluster()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                uri = (Path(tmp) / "bucket").as_uri() if a.object_storage else None
                res["node_loss"] = asyncio.run(node_loss(S, cluster, Path(tmp) / "local", kills=a.kills,
                                                         preload_chunks=a.preload_chunks,
                                                         preload_snapshot=not a.no_preload_snapshot, storage=uri))
                res["node_loss"]["storage"] = uri
        finally:
            ray.shutdown()
            cluster.shutdown()
    if not (a.data_plane_only or a.recovery_only):  # R = 2 (bench/replicas.py): replica processes SIGKILLed, then Ray nodes removed
        import ray

        from .replicas import replica_loss

        with tempfile.TemporaryDirectory() as tmp:
            res["replica_loss_pipes"] = asyncio.run(replica_loss(S, Path(tmp), kills=a.kills))
        ray.shutdown()
        cluster = start_cluster(workers=5)  # 4 replica bundles + a spare
        try:
            with tempfile.TemporaryDirectory() as tmp:
                res["replica_loss_ray"] = asyncio.run(replica_loss(S, Path(tmp), kills=a.kills, cluster=cluster))
        finally:
            ray.shutdown()
            cluster.shutdown()
    res["load_after"] = os.getloadavg()
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
