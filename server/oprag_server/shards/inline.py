"""``--shard-workers inline``: shard 0 in the frontend process, its one-query reads run on the
event loop's own thread; every other shard in a process of its own.

Why (issue 13, 12K chunks on a 2-CPU machine): a served Retrieve with two shard processes pays,
for the slower shard, a pipe wake-up, the reply's pickle and its unpickle in the frontend (~0.2 ms
served of ~2.3 ms: bench/RESULTS.md, session 31), while the frontend's own core waits. Here the
frontend writes the other shards' requests first (:meth:`.pool.ShardPool.gather_partial` sends an
inline shard last, the processes held from preempting it until its search ends) and then
searches shard 0 itself, in parallel with them: one hand-off less on the critical path, no
thread switch, no GIL contention between two shards' Python (each other shard has its own
interpreter).

Shard 0 is the same :class:`~.state.ShardState` on a :class:`~.threaded.ThreadTransport`: writes,
snapshots, idle work (BM25 merges, deferred HNSW inserts) and batched searches still run on its
thread, in the order sent, with the durability of thread shards. A search or fetch
(:data:`INLINE_OPS`) of at most :attr:`InlineTransport.INLINE_QUERIES` queries runs inline only
when nothing is queued for the shard and its thread is not working on the state
(:attr:`~.threaded.ThreadTransport._busy`, taken by the thread before a queued request leaves
the count, so an inline read never overtakes a request sent before it); otherwise it is queued
like any other. A batch of several queries (the scheduler's, under load) goes to the thread, so
that the loop stays free for the other requests meanwhile, and so do exact mode's rounds
(``full_hybrid`` and the pruning monitor's sampled re-runs: a pass over every chunk, ~100 ms
at a million).

Trade-offs, as thread shards: a native fault in shard 0 ends the server (the other shards are
restarted alone, as processes); no ``--replicas`` or ``--ray-address``. While shard 0 is
searched inline (~0.5-1 ms at 5K chunks) the loop does nothing else: for latency at low
concurrency on small deployments; ``process`` (the default) for large ones and throughput.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..index.disk_errors import print_failure
from .gather import Slot
from .protocol import Op
from .state import dispatch
from .threaded import ThreadTransport
from .transport import PipeTransport, ShardError, ShardTransport


#: the reads that may run on the loop (a subset of :data:`.threaded.ZERO_COPY`: no exact-mode round)
INLINE_OPS = frozenset({Op.SEARCH, Op.FETCH})


def queries(request: Any) -> int:
    """Queries in a read request (1 for one without a query batch)."""
    batch = getattr(request, "batch", None)
    return 1 if batch is None else len(batch.q)


class InlineTransport(ThreadTransport):
    """A :class:`~.threaded.ThreadTransport` whose small reads run on the caller's thread (the
    event loop) when the shard is idle (module docstring)."""

    #: the pool sends this shard's request after every other shard's (gather_partial)
    inline = True
    #: queries a read may hold to run inline (more: the shard's thread, the loop stays free)
    INLINE_QUERIES = 1

    def _inline(self, op: Op, request: Any, fut: asyncio.Future | Slot) -> bool:
        """(From :meth:`~.threaded.ThreadTransport.call`) serve a read of at most
        :attr:`INLINE_QUERIES` queries now, on this thread, when nothing is queued for the shard
        and its thread holds no work on the state; its outcome set on ``fut`` as the thread's
        would be. False: the caller queues it."""
        if op not in INLINE_OPS or queries(request) > self.INLINE_QUERIES or not self._busy.acquire(blocking=False):
            return False
        try:
            with self._gate:
                if self._queued or not self._alive:
                    return False
            try:
                out: Any = dispatch(self._table, op, request)
            except Exception as exc:  # noqa: BLE001 - answered as the shard's thread answers it
                print_failure(exc)
                out = ShardError(f"shard {self.shard_id}: {type(exc).__name__}: {exc}")
        finally:
            self._busy.release()
        if isinstance(out, ShardError) and type(fut) is not Slot:
            fut.set_exception(out)
        else:
            fut.set_result(out)  # (a Slot: the group's last outcome resolves the gather)
        # (no idle step queued after it, unlike a request the thread runs: a read changes nothing, and idle
        # work never waited for it, as an idle step only skips while a request is queued; the wake-up of
        # the shard's thread and its GIL hand-offs would land on this request's merge)
        return True


def first_inline(shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> ShardTransport:
    """The transport factory of ``--shard-workers inline``: shard 0 an :class:`InlineTransport`,
    every other shard a :class:`~.transport.PipeTransport` (a process)."""
    return (InlineTransport if shard_id == 0 else PipeTransport)(shard_id, dim, data_dir, stem)
