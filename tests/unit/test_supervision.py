"""Shard supervision (oprag_server.supervision) over fake shards: health, restarts, statistics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from oprag_server.index.bm25 import CorpusStats
from oprag_server.engine.rwlock import RWLock
from oprag_server.service.metrics import Metrics
from oprag_server.shards.protocol import Op
from oprag_server.supervision import INGEST_HEALTH, NOT_SERVING, SERVING, ShardSupervisor, dead_shards, restart_shard


class Transport:
    """Stands in for a shard transport: only whether it is alive matters here."""

    def __init__(self, shard_id, alive=True):
        self.shard_id, self.up = shard_id, alive

    def is_alive(self):
        return self.up


class Pool:
    """A fake pool: ``down_shards`` reads the transports, as ShardPool does."""

    def __init__(self, n):
        self.n = n
        self.clients = [Transport(i) for i in range(n)]
        self.restarted = []

    def down_shards(self):
        return [c.shard_id for c in self.clients if not c.is_alive()]

    def restart(self, i, loop, committed):
        self.restarted.append((i, committed))
        self.clients[i] = Transport(i)


class Health:
    def __init__(self):
        self.calls = []

    async def set(self, name, status):
        self.calls.append((name, status))


def test_dead_shards_are_found():
    pool = Pool(3)
    pool.clients[1].up = False
    pool.clients[2].up = False
    assert dead_shards(pool) == [1, 2]


def test_a_dead_shard_turns_health_not_serving_and_is_restarted():
    pool, health, metrics = Pool(2), Health(), Metrics()
    restarted = []

    async def restart(i):
        restarted.append(i)
        pool.restart(i, None, set())

    sup = ShardSupervisor(pool, restart, health, ("", "oprag.v1.OpRAG"), metrics)
    pool.clients[1].up = False
    assert asyncio.run(sup.check()) == [1]
    # the write path's name too (trial51 #5: a write needs every shard)
    assert health.calls == [("", NOT_SERVING), ("oprag.v1.OpRAG", NOT_SERVING), (INGEST_HEALTH, NOT_SERVING)]
    assert restarted == [1]
    assert metrics.shard_restarts._value.get() == 1 and metrics.shards_up._value.get() == 1
    health.calls.clear()
    assert asyncio.run(sup.check()) == []
    assert health.calls == [("", SERVING), ("oprag.v1.OpRAG", SERVING), (INGEST_HEALTH, SERVING)]
    assert metrics.shards_up._value.get() == 2


def test_a_failed_restart_is_retried_next_round():
    pool, metrics = Pool(1), Metrics()
    pool.clients[0].up = False
    tries = []

    async def restart(i):
        tries.append(i)
        if len(tries) == 1:
            raise RuntimeError("spawn failed")
        pool.restart(i, None, set())

    sup = ShardSupervisor(pool, restart, Health(), ("",), metrics, backoff=(0.0, 30.0))  # (no back-off wait)
    assert asyncio.run(sup.check()) == []
    assert asyncio.run(sup.check()) == [0]
    assert tries == [0, 0] and metrics.shard_restarts._value.get() == 1


def test_run_stops_when_told():
    pool = Pool(1)

    async def main():
        stop = asyncio.Event()
        sup = ShardSupervisor(pool, None, Health(), ("",), Metrics(), interval_s=0.01)
        task = asyncio.create_task(sup.run(stop))
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 1.0)

    asyncio.run(main())


def test_restart_shard_respawns_and_resums_statistics():
    pool, stats = Pool(2), CorpusStats()
    merged = []

    async def broadcast(op, request):
        assert op is Op.STATS and request.lexical
        return [SimpleNamespace(lexical="s0"), SimpleNamespace(lexical="s1")]

    pool.broadcast = broadcast
    orig = CorpusStats.merge_full
    try:
        CorpusStats.merge_full = staticmethod(lambda parts: merged.append(parts) or CorpusStats())
        asyncio.run(restart_shard(pool, 1, committed={"t1"}, lock=RWLock(), stats=stats))
    finally:
        CorpusStats.merge_full = orig
    assert pool.restarted == [(1, {"t1"})] and merged == [["s0", "s1"]]


def test_a_shard_serving_with_a_replica_down_stays_serving_and_the_replica_is_revived():
    pool, health, metrics = Pool(2), Health(), Metrics()
    pool.degraded_shards = lambda: [0] if not pool.restarted else []
    restarted = []

    async def restart(i):
        restarted.append(i)
        pool.restart(i, None, set())

    sup = ShardSupervisor(pool, restart, health, ("",), metrics)
    assert asyncio.run(sup.check()) == [0]
    assert health.calls == [("", SERVING)] and restarted == [0] and metrics.shards_up._value.get() == 2
    assert asyncio.run(sup.check()) == [] and restarted == [0]


def test_restart_shard_reads_the_committed_ids_once_a_commit_in_progress_is_done(monkeypatch):
    """Session 41: commits no longer hold the write lock from their prepare (only for their apply), so the committed
    ids a restarted shard replays are read holding the commit gate: a commit between its prepare and its commit record
    is finished (or failed) first, and its transaction is replayed."""
    pool, log = Pool(2), {"t1"}

    async def broadcast(op, request):
        return [SimpleNamespace(lexical="s0"), SimpleNamespace(lexical="s1")]

    pool.broadcast = broadcast
    monkeypatch.setattr(CorpusStats, "merge_full", staticmethod(lambda parts: CorpusStats()))

    async def go():
        gate = asyncio.Lock()
        await gate.acquire()  # a commit in progress
        task = asyncio.create_task(restart_shard(pool, 1, committed=lambda: set(log), lock=RWLock(), stats=CorpusStats(),
                                                 gate=gate))
        await asyncio.sleep(0.05)
        assert pool.restarted == []  # waits for the commit
        log.add("t2")  # its commit record
        gate.release()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert pool.restarted == [(1, {"t1", "t2"})]
