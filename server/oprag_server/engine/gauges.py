"""The index gauges (``oprag_chunks``, ``oprag_documents``, ``oprag_memory_records``,
``oprag_shard_bytes``), read from the shards' STATS after writes, off the request path.

Writes come from committed transactions (an ingest stream, a delete) and from session memory
(a turn promoted by each query with a ``session_id``, a cleared session): one STATS broadcast
per write would add a round trip to every shard per session query, so refreshes coalesce: one
broadcast at a time, at most one every :attr:`IndexGauges.min_gap_s` seconds, and one more after
it when a write came meanwhile (the gauges never stay behind the last write).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..shards.protocol import Op, StatsRequest


class IndexGauges:
    """:param pool: a :class:`~..shards.pool.ShardPool` (``broadcast``).
    :param metrics: :class:`~..service.metrics.Metrics` (``chunks``, ``documents``,
        ``memory_records``, ``shard_bytes``)."""

    min_gap_s = 0.25

    def __init__(self, pool: Any, metrics: Any) -> None:
        self.pool, self.metrics = pool, metrics
        self._stale = False
        self._task: asyncio.Task | None = None

    def stale(self) -> None:
        """The shards changed: refresh soon (a task on the running loop; coalesced, see the module)."""
        self._stale = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        """Stop a pending refresh (the server is closing)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._stale:
            self._stale = False
            await self.refresh()
            await asyncio.sleep(self.min_gap_s)

    async def refresh(self) -> None:
        """One STATS broadcast into the gauges (best effort: a shard down leaves them as they are)."""
        try:
            st = await self.pool.broadcast(Op.STATS, StatsRequest())
        except Exception:  # noqa: BLE001 - gauges are best effort
            return
        self.metrics.chunks.set(sum(s.chunks for s in st))
        self.metrics.documents.set(sum(s.documents for s in st))
        self.metrics.memory_records.set(sum(s.memory_records for s in st))
        for s in st:
            for component, n in (s.nbytes or {}).items():
                self.metrics.shard_bytes.labels(shard=str(s.shard), component=component).set(n)
