"""Shard supervision: a dead shard process turns gRPC health NOT_SERVING, is restarted (it
reloads its snapshot and replays its committed write-ahead log), then the corpus-global BM25
statistics are re-summed from every shard; health returns to SERVING when all shards are up.

Engine health (:class:`EngineHealth`): with an inference-engine generator, the health name
``oprag.v1.OpRAG.Query`` (:data:`QUERY_HEALTH`) follows the engine -- NOT_SERVING while it is
down (Retrieve and the server as a whole stay SERVING).

Signals (:func:`on_signals`): the first SIGTERM/SIGINT starts the graceful shutdown, a second
one during it ends the process at once (:func:`stop_now`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpc_health.v1 import health_pb2

from .index.bm25 import CorpusStats
from .shards.protocol import Op, StatsRequest
from .shards.transport import ShardError, StorageUnavailable
from .shards.worker import exit_now

log = logging.getLogger("oprag")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def on_signals(loop: asyncio.AbstractEventLoop, first: Callable[[], None]) -> None:
    """SIGTERM/SIGINT call ``first()`` (the server's graceful shutdown: drain, final snapshot);
    a second one during it calls :func:`stop_now`. Nothing is installed off the main thread."""
    seen: list[int] = []

    def handler(sig: int) -> None:
        if seen:
            stop_now(sig)
        seen.append(sig)
        first()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler, sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


def stop_now(sig: int) -> None:
    """End the process at once, status 128 + ``sig``, without the drain or the final snapshot
    (a second SIGTERM/SIGINT during the graceful shutdown). Nothing acknowledged is lost: a
    write is acknowledged after its records are fsync'ed in the write-ahead logs, and the next
    start replays them. Shard processes end when their pipe closes (a snapshot being written is
    finished first: :func:`.shards.worker.run`); a managed engine has ``PR_SET_PDEATHSIG``."""
    log.warning("second %s during the shutdown: stopping now (acknowledged writes are in the "
                "write-ahead logs; the next start replays them)", signal.Signals(sig).name)
    logging.shutdown()  # flush the log handlers
    exit_now(128 + int(sig))


def dead_shards(pool: Any) -> list[int]:
    """Ids of the shards whose process has died or whose connection is closed."""
    return pool.down_shards()


async def restart_shard(pool: Any, i: int, *, committed: set[str] | Callable[[], set[str]], lock: Any,
                        stats: CorpusStats, check: Callable[[dict[int, int]], None] | None = None,
                        gate: Any = None) -> None:
    """Respawn shard ``i`` (blocking spawn in the default executor), then, under the index
    write lock, replace ``stats`` with the merge of every shard's lexical statistics.

    :param committed: transaction ids in the frontend's commit log (the shard replays those), or
        a function returning them (e.g. ``CommitProtocol.committed_txns``): then it is read
        holding ``gate`` (``CommitProtocol.gate``, which a commit holds from its prepare to its
        apply; without one, the write lock), i.e. after a commit in progress logged its commit
        point or failed (a transaction prepared on the lost shard and logged just after a plain
        read would not be replayed).
    :param check: ``check({i: applied_seq}, committed)`` raises when the shard came back without
        the transactions ``committed`` it was given to replay
        (:meth:`~.engine.commit.CommitProtocol.check_recovered`; commits that went on during the
        restart do not count): it is then stopped again (left down: partial results, retried
        with back-off).
    :raises ShardError | RuntimeError: the shard did not come back.
    """
    loop = asyncio.get_running_loop()
    if callable(committed):
        async with gate if gate is not None else lock.write():
            committed = set(committed())
    ready = await loop.run_in_executor(None, pool.restart, i, loop, committed)
    if check is not None:
        try:
            check({i: ready.applied_seq}, committed)
        except Exception:
            pool.clients[i].kill()
            raise
    async with lock.write():
        st = await pool.broadcast(Op.STATS, StatsRequest(lexical=True))
        stats.replace_with(CorpusStats.merge_full([s.lexical for s in st]))


async def final_snapshot(pool: Any, snapshot: Callable[..., Awaitable[None]]) -> None:
    """The shutdown's snapshot (``Runtime.close``): ``await snapshot(skip=down)`` of every shard
    but those down now (dead, or their restart was under way when the stop came). A shard that is
    not running is not snapshotted, and that is no failure: its write-ahead log (and the commit
    log, kept) is replayed on the next start, so one WARNING line names it, without a traceback
    (trial22: an ERROR with the ``ShardError`` traceback). Any other failure, or a shard that
    fails while running, is logged as an ERROR with its traceback. Never raises (``Exception``).

    :param pool: the :class:`~.shards.pool.ShardPool` (``down_shards()``).
    :param snapshot: ``Runtime.snapshot`` (its ``skip``: shard ids not asked)."""
    down = tuple(pool.down_shards())
    try:
        await snapshot(skip=down)
    except StorageUnavailable as exc:  # (fenced, or the store refuses writes: said once already; trial57 #14)
        log.error("final snapshot failed: %s (the logs on the storage hold every acknowledged write)", exc)
        return
    except ShardError as exc:
        now = tuple(pool.down_shards())  # a shard that died during the snapshot: not snapshotted either
        if set(now) <= set(down):
            log.exception("final snapshot failed")
            return
        down = now
    except Exception:  # noqa: BLE001 - the write-ahead logs still hold everything
        log.exception("final snapshot failed")
        return
    if down:
        who = f"shard{'s' if len(down) > 1 else ''} {', '.join(map(str, down))}"
        log.warning("final snapshot: %s not snapshotted (not running: down or restarting); the write-ahead log of %s "
                    "will be replayed on the next start", who, who)


def periodic_snapshot_failed(pool: Any, exc: BaseException, retry_s: float) -> None:
    """Log a failed periodic snapshot (``Runtime._snapshot_loop``, once per new failure): one WARNING line when a
    shard was down or restarting (a ``ShardError`` while a shard is down: expected, retried; its write-ahead log
    holds its writes; trial50: an ERROR with a traceback each time a shard restarted), else an ERROR with the
    traceback (a storage failure included)."""
    if isinstance(exc, ShardError) and not isinstance(exc, StorageUnavailable) and pool.down_shards():
        log.warning("periodic snapshot not taken: %s (a shard is down or restarting); tried again in %.0f s", exc,
                    retry_s)
    else:
        log.error("periodic snapshot failed (logged again only when the failure changes)", exc_info=exc)


class ShardSupervisor:
    """Polls the pool every ``interval_s`` seconds and restarts dead shards.

    :param restart: ``await restart(i)`` brings shard ``i`` back (e.g. ``Runtime.restart_shard``).
    :param health: a ``grpc_health`` aio ``HealthServicer`` (or anything with ``async set(name, status)``).
    :param names: the health service names to set ("" for the whole server, and the service).
    :param metrics: sets ``shards_up`` and ``shard_replica_up``, counts ``shard_restarts``, observes ``stage_seconds{stage="shard_recovery"}``.
    :param changed: called when the set of dead shards changes (a shard went down or is back),
        e.g. ``IndexGauges.stale``: the index gauges then leave out, or count again, that shard.
    """

    def __init__(self, pool: Any, restart: Callable[[int], Awaitable[None]], health: Any, names: Sequence[str],
                 metrics: Any, interval_s: float = 0.25, fenced: Callable[[], Any] = lambda: None,
                 backoff: tuple[float, float] = (1.0, 30.0), write_error: Callable[[], Any] = lambda: None,
                 changed: Callable[[], Any] = lambda: None) -> None:
        self.pool, self.restart, self.health, self.names = pool, restart, health, tuple(names)
        self.metrics, self.interval_s, self.fenced, self.backoff = metrics, interval_s, fenced, backoff
        self.write_error, self._writes_ok = write_error, True  # (serve() publishes SERVING first)
        self._failures: dict[int, tuple[int, float]] = {}  # shard -> (failed restarts in a row, next try at)
        self.changed, self._dead = changed, frozenset[int]()  # the dead shards of the last round

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
        if frozenset(dead) != self._dead:
            self._dead = frozenset(dead)
            self.changed()
        for i, r, up in getattr(self.pool, "replicas_up", list)():
            self.metrics.shard_replica_up.labels(shard=str(i), replica=str(r)).set(1 if up else 0)
        await self.set_health(not dead and not self.fenced())  # fenced: lost the storage's owner lease
        ok = not self.write_error() and not self.fenced() and not dead  # (a write needs every shard: trial51 #5)
        if ok != self._writes_ok:  # writes alone: the ingest path's health name (reads go on)
            await self.health.set(INGEST_HEALTH, SERVING if ok else NOT_SERVING)
            self._writes_ok = ok
        back = []
        # a shard with R >= 2 that serves with a replica down: revive the replica (health stays SERVING)
        degraded = [i for i in getattr(self.pool, "degraded_shards", list)() if i not in dead]
        for i in dead + degraded:
            n, at = self._failures.get(i, (0, 0.0))
            if time.monotonic() < at:
                continue  # backing off after failed restarts
            if not n:  # a replica down while its shard serves: a warning (the cause, when not planned, was an error)
                log.log(logging.ERROR if i in dead else logging.WARNING,
                        "shard %d is down; restarting it" if i in dead else "shard %d: a replica is down; reviving it", i)
            t = time.perf_counter()
            try:
                await self.restart(i)
            except Exception as exc:  # noqa: BLE001 - try again after a back-off (1 s, 2 s, 4 s, ... capped)
                wait = min(self.backoff[0] * 2 ** n, self.backoff[1])
                self._failures[i] = (n + 1, time.monotonic() + wait)
                if n:  # the traceback once; then one line per try
                    log.error("restart of shard %d failed again (%d in a row): %s; next try in %.0f s", i, n + 1, exc, wait)
                else:
                    log.exception("restart of shard %d failed; next try in %.0f s", i, wait)
                continue
            self._failures.pop(i, None)
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


async def keep_lease(lease: Any, on_wiped: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
    """Renew the storage owner ``lease`` (:mod:`.index.lease`) every ``lease.renew_s`` seconds
    until ``stop``: a lease taken by another server fences this one (logged; the commit
    protocol then refuses writes, the supervisor turns health NOT_SERVING); a lease found gone
    (the storage was wiped) is put back and ``await on_wiped()`` re-establishes the storage
    (a full snapshot). A renewal the storage refuses is logged once per change and retried."""
    failing = None
    while not stop.is_set():
        await asyncio.sleep(lease.renew_s)
        try:
            got = await asyncio.get_running_loop().run_in_executor(None, lease.renew)
        except Exception as exc:  # noqa: BLE001 - the storage refused: try again next round
            said = re.sub(r"\.tmp-[0-9a-f]{32}", ".tmp-*", str(exc))  # (each try's temporary name differs: trial57b)
            if said != failing:
                log.error("renewing the --storage-uri owner lease failed: %s", exc)
            failing = said
            continue
        failing = None
        if got == "taken":
            log.error("%s", lease.fenced)
            return
        if got == "gone":
            log.error("the --storage-uri owner lease is gone (the storage was wiped?): put it back; taking a "
                      "full snapshot to re-establish the storage")
            try:
                await on_wiped()
            except Exception:  # noqa: BLE001
                log.exception("re-establishing the storage failed (the next renewal tries again)")


#: Health service name of the write path (Ingest, Delete): NOT_SERVING while storage writes fail or a shard is down.
INGEST_HEALTH = "oprag.v1.OpRAG.Ingest"
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
