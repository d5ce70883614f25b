"""Shards inside the calling process, for unit tests and benches: the same
:class:`~.state.ShardState` and op table the shard processes run, without processes or pipes.

``ShardPool(n, dim, data_dir, transport=InProcessTransport)`` behaves like the real pool;
:func:`in_process_pool` wraps shard states a test built itself. A call runs synchronously
when awaited; errors arrive as :class:`~.transport.ShardError` exactly as over a pipe, and
:meth:`InProcessTransport.kill` makes a shard "down".
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

from .pool import ShardPool
from .protocol import Op, StatsReply, StatsRequest
from .state import ShardState, dispatch, op_table
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

    @classmethod
    def of(cls, state: ShardState, copy: bool = False) -> "InProcessTransport":
        return cls(state.shard_id, state.dim, state.data_dir, state=state, copy=copy)

    def start(self, committed: set[str] | None) -> None:
        self._committed = committed

    def ready(self, loop: asyncio.AbstractEventLoop | None = None, timeout_s: float = 0.0) -> StatsReply:
        try:
            self.state = ShardState(self.shard_id, self.dim, self.data_dir, stem=self.stem, dense=self.dense,
                                    storage=self.storage)
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
            reply = dispatch(self._table, op, request)
        except Exception as exc:  # noqa: BLE001 - a shard answers errors as text
            raise ShardError(f"shard {self.shard_id}: {type(exc).__name__}: {exc}") from exc
        if op is Op.SHUTDOWN:
            self._alive = False
        return pickle.loads(pickle.dumps(reply)) if self.copy else reply

    def is_alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        self._alive = False

    def close(self) -> None:
        self._alive = False


def in_process_pool(states: list[ShardState], copy: bool = False) -> ShardPool:
    """A started :class:`ShardPool` over shard states built by the caller (shard ``i`` is
    ``states[i]``)."""
    pool = ShardPool(len(states), states[0].dim, states[0].data_dir, transport=InProcessTransport)
    pool.clients = [InProcessTransport.of(s, copy=copy) for s in states]
    return pool
