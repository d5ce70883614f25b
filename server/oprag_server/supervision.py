"""Shard supervision: a dead shard process turns gRPC health NOT_SERVING, is restarted (it
reloads its snapshot and replays its committed write-ahead log), then the corpus-global BM25
statistics are re-summed from every shard; health returns to SERVING when all shards are up.

Engine health (:class:`EngineHealth`): with an inference-engine generator, the health name
``oprag.v1.OpRAG.Query`` (:data:`QUERY_HEALTH`) follows the engine -- NOT_SERVING while it is
down (Retrieve and the server as a whole stay SERVING).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpc_health.v1 import health_pb2

from .index.bm25 import CorpusStats
from .shards.protocol import Op, StatsRequest

log = logging.getLogger("oprag")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def dead_shards(pool: Any) -> list[int]:
    """Ids of the shards whose process has died or whose connection is closed."""
    return pool.down_shards()


async def restart_shard(pool: Any, i: int, *, committed: set[str] | Callable[[], set[str]], lock: Any,
                        stats: CorpusStats) -> None:
    """Respawn shard ``i`` (blocking spawn in the default executor), then, under the index
    write lock, replace ``stats`` with the merge of every shard's lexical statistics.

    :param committed: transaction ids in the frontend's commit log (the shard replays those), or
        a function returning them (e.g. ``CommitProtocol.committed_txns``): then it is read
        under the write lock, i.e. after a commit in progress logged its commit point or failed
        (a transaction prepared on the lost shard and logged just after a plain read would not
        be replayed).
    :raises ShardError | RuntimeError: the shard did not come back.
    """
    loop = asyncio.get_running_loop()
    if callable(committed):
        async with lock.write():
            committed = set(committed())
    await loop.run_in_executor(None, pool.restart, i, loop, committed)
    async with lock.write():
        st = await pool.broadcast(Op.STATS, StatsRequest(lexical=True))
        stats.replace_with(CorpusStats.merge_full([s.lexical for s in st]))


class ShardSupervisor:
    """Polls the pool every ``interval_s`` seconds and restarts dead shards.

    :param restart: ``await restart(i)`` brings shard ``i`` back (e.g. ``Runtime.restart_shard``).
    :param health: a ``grpc_health`` aio ``HealthServicer`` (or anything with ``async set(name, status)``).
    :param names: the health service names to set ("" for the whole server, and the service).
    :param metrics: sets ``shards_up``, counts ``shard_restarts``, observes ``stage_seconds{stage="shard_recovery"}``.
    """

    def __init__(self, pool: Any, restart: Callable[[int], Awaitable[None]], health: Any, names: Sequence[str],
                 metrics: Any, interval_s: float = 0.25) -> None:
        self.pool, self.restart, self.health, self.names = pool, restart, health, tuple(names)
        self.metrics, self.interval_s = metrics, interval_s

    async def set_health(self, serving: bool) -> None:
        for name in self.names:
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def check(self) -> list[int]:
        """One round: publish health and ``shards_up``, restart each dead shard.

        :returns: the shards restarted in this round (a failed restart is logged and retried
            on the next round).
        """
        dead = dead_shards(self.pool)
        self.metrics.shards_up.set(self.pool.n - len(dead))
        await self.set_health(not dead)
        back = []
        # a shard with R >= 2 that serves with a replica down: revive the replica (health stays SERVING)
        degraded = [i for i in getattr(self.pool, "degraded_shards", list)() if i not in dead]
        for i in dead + degraded:
            log.error("shard %d is down; restarting it" if i in dead else "shard %d: a replica is down; reviving it", i)
            t = time.perf_counter()
            try:
                await self.restart(i)
            except Exception:  # noqa: BLE001 - try again on the next round
                log.exception("restart of shard %d failed", i)
                continue
            self.metrics.shard_restarts.inc()
            self.metrics.stage_seconds.labels(stage="shard_recovery").observe(time.perf_counter() - t)
            log.info("shard %d is back after %.1f s", i, time.perf_counter() - t)
            back.append(i)
        return back

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval_s`` seconds until ``stop`` is set (or the task is cancelled)."""
        while not stop.is_set():
            await self.check()
            await asyncio.sleep(self.interval_s)


#: Health service name of the generating query path (Query, QueryStream).
QUERY_HEALTH = "oprag.v1.OpRAG.Query"


class EngineHealth:
    """Publishes :data:`QUERY_HEALTH` from an engine generator's state every ``interval_s``:
    its ``healthy`` flag (False after a failed request, or while a managed engine's process is
    dead), confirmed by ``await generator.probe()`` when False and every ``probe_every`` rounds.
    """

    def __init__(self, generator: Any, health: Any, interval_s: float = 1.0, probe_every: int = 5) -> None:
        self.gen, self.health, self.interval_s, self.probe_every = generator, health, interval_s, probe_every
        self.serving: bool | None = None

    async def check(self, probe: bool) -> bool:
        ok = bool(self.gen.healthy)
        if probe or not ok:
            ok = await self.gen.probe() and bool(self.gen.healthy)
        if ok != self.serving:
            log.warning("generation engine %s", "is serving" if ok else "is DOWN: Query NOT_SERVING")
            await self.health.set(QUERY_HEALTH, SERVING if ok else NOT_SERVING)
            self.serving = ok
        return ok

    async def run(self, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            await self.check(n % self.probe_every == 0)
            n += 1
            await asyncio.sleep(self.interval_s)
