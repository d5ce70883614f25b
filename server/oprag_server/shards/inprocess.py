"""Shards inside the calling process, for unit tests and benches: the same
:class:`~.state.ShardState` and op table the shard processes run, without processes or pipes.

``ShardPool(n, dim, data_dir, transport=InProcessTransport)`` behaves like the real pool;
:func:`in_process_pool` wraps shard states a test built itself. A call runs synchronously
when awaited; errors arrive as :class:`~.transport.ShardError` exactly as over a pipe, and
:meth:`InProcessTransport.kill` makes a shard "down".

A snapshot is written beside the calls, as a shard process writes it (:mod:`.snapjob`; snap15):
its steps run on the event loop between calls, its merge and writer threads are waited for off
the loop, and meanwhile read ops (:data:`.state.READS`) are answered while every other call
waits for it, in order.
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

from .pool import ShardPool
from .protocol import Op, SnapshotReply, StatsReply, StatsRequest
from .state import READS, ShardState, dispatch, op_table
from .transport import ShardError, ShardTransport


class InProcessTransport(ShardTransport):
    """One :class:`ShardState` in this process.

    :param state: an existing state to serve (its shard id, width and directory are used).
    :param copy: pass requests and replies through pickle, as a pipe would (catches a field
        that would not cross a process boundary; slower).
    """

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False, *,
                 state: ShardState | None = None, copy: bool = False) -> None:
        super().__init__(shard_id, dim, data_dir, stem)
        self.state = state
        self.copy = copy
        self._table = op_table(state) if state is not None else None
        self._alive = state is not None
        self._committed: set[str] | None = None
        self._order: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # (FIFO) held by a snapshot

    @classmethod
    def of(cls, state: ShardState, copy: bool = False) -> "InProcessTransport":
        return cls(state.shard_id, state.dim, state.data_dir, state=state, copy=copy)

    def start(self, committed: set[str] | None) -> None:
        self._committed = committed

    def ready(self, loop: asyncio.AbstractEventLoop | None = None, timeout_s: float = 0.0) -> StatsReply:
        try:
            self.state = ShardState(self.shard_id, self.dim, self.data_dir, stem=self.stem, dense=self.dense,
                                    storage=self.storage, who=self.who)
            replayed = self.state.load(self._committed)
        except Exception as exc:  # noqa: BLE001 - as the pipe transport reports it
            raise ShardError(f"shard {self.shard_id} failed to start: {type(exc).__name__}: {exc}") from exc
        self._table = op_table(self.state)
        self._alive = True
        res = self.state.stats(StatsRequest(lexical=True))
        res.replayed = replayed
        return res

    async def call(self, op: Op, request: Any) -> Any:
        if not self._alive or self._table is None:
            raise ShardError(f"shard {self.shard_id} is not running")
        if self.copy:
            request = pickle.loads(pickle.dumps(request))
        try:
            if op in READS:
                reply = dispatch(self._table, op, request)
            else:  # after a snapshot being written, and after the calls that wait for it
                lock = self._lock()
                await lock.acquire()
                if op is Op.SNAPSHOT:  # (it releases the lock once written, even if this call is cancelled)
                    reply = await asyncio.shield(asyncio.get_running_loop().create_task(self._snapshot(lock)))
                else:
                    try:
                        reply = dispatch(self._table, op, request)
                    finally:
                        lock.release()
        except ShardError:
            raise
        except Exception as exc:  # noqa: BLE001 - a shard answers errors as text
            raise ShardError(f"shard {self.shard_id}: {type(exc).__name__}: {exc}") from exc
        if op is Op.SHUTDOWN:
            self._alive = False
        return pickle.loads(pickle.dumps(reply)) if self.copy else reply

    def _lock(self) -> asyncio.Lock:
        """This loop's lock ordering the calls that are no reads (asyncio's lock wakes in order)."""
        loop = asyncio.get_running_loop()
        if self._order is None or self._order[0] is not loop:
            self._order = (loop, asyncio.Lock())
        return self._order[1]

    async def _snapshot(self, lock: asyncio.Lock) -> SnapshotReply:
        """The snapshot's steps on the loop, its merge and writer threads waited for off it;
        ``lock`` released at the end."""
        assert self.state is not None
        try:
            job = self.state.snapshot_begin()
            if job is None:
                return SnapshotReply(written=False)
            while True:
                out = job.step()
                if out is not None:
                    return out
                if not self._alive:  # killed meanwhile: the rest at once
                    return job.wait()
                t = job.blocker()
                await (asyncio.to_thread(t.join) if t is not None else asyncio.sleep(0.001))
        finally:
            lock.release()

    def is_alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        self._alive = False

    def close(self) -> None:
        self._alive = False


def in_process_pool(states: list[ShardState], copy: bool = False) -> ShardPool:
    """A started :class:`ShardPool` over shard states built by the caller (shard ``i`` is
    ``states[i]``)."""
    pool = ShardPool(len(states), states[0].dim, states[0].data_dir, transport=InProcessTransport,
                     dense=states[0].store.dense.params)  # (the Retriever reads the index kind from it)
    pool.clients = [InProcessTransport.of(s, copy=copy) for s in states]
    return pool
