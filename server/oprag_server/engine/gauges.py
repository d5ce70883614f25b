"""The index gauges (``oprag_chunks``, ``oprag_documents``, ``oprag_memory_records``,
``oprag_shard_bytes``, ``oprag_shard_pending``), read from the shards' STATS after writes and when a shard goes down or
comes back, off the request path.

Writes come from committed transactions (an ingest stream, a delete) and from session memory
(a turn promoted by each query with a ``session_id``, a cleared session): one STATS broadcast
per write would add a round trip to every shard per session query, so refreshes coalesce: one
broadcast at a time, at most one every :attr:`IndexGauges.min_gap_s` seconds, and one more after
it when a write came meanwhile (the gauges never stay behind the last write).

Work a shard does between requests changes its bytes without a write: HNSW inserts of deferred
vectors (``ann_pending``), BM25 merges (``merge_pending``; an idle merge starts only after writes
have been quiet for 5 s, reported as pending by no refresh before it), the snapshot that maps a
merged segment. So refreshes go on every :attr:`IndexGauges.follow_s` seconds for
:attr:`IndexGauges.settle_s` after the last write or snapshot, and past that while a shard reports
work pending or a refresh still finds other bytes than the one before (trial38b, trial39:
``oprag_shard_bytes`` stayed up to 2.5x off the Stats RPC after an ingest, until the next write).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..shards.protocol import Op, StatsRequest


#: the background work ``oprag_shard_pending`` reports, as ``StatsReply.<work>_pending``
_PENDING = ("ann", "merge", "seeds")


class IndexGauges:
    """:param pool: a :class:`~..shards.pool.ShardPool` (``gather_partial``).
    :param metrics: :class:`~..service.metrics.Metrics` (``chunks``, ``documents``,
        ``memory_records``, ``shard_bytes``)."""

    min_gap_s = 0.25
    #: seconds between the refreshes that follow a write's background work (module docstring)
    follow_s = 2.0
    #: seconds after the last write or snapshot during which they go on whatever they find
    settle_s = 15.0

    def __init__(self, pool: Any, metrics: Any) -> None:
        self.pool, self.metrics = pool, metrics
        self._stale = False
        self._since = 0.0  # loop time of the last stale()
        self._seen: dict | None = None  # the bytes the last refresh found
        self._wake: asyncio.Event | None = None  # set by stale() while a follow-up refresh waits
        self._task: asyncio.Task | None = None
        self._bytes_series: dict[int, set[str]] = {}  # shard -> its oprag_shard_bytes components

    def stale(self) -> None:
        """The shards changed: refresh soon (a task on the running loop; coalesced, see the module)."""
        self._stale = True
        self._since = asyncio.get_running_loop().time()
        if self._wake is not None:  # (a write during a follow-up's wait: refresh now, not at its end)
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        """Stop a pending refresh (the server is closing)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._stale:
            self._stale = False
            moving = await self.refresh()
            await asyncio.sleep(self.min_gap_s)
            loop = asyncio.get_running_loop()
            if not self._stale and (moving or loop.time() - self._since < self.settle_s):
                self._wake = asyncio.Event()
                try:
                    await asyncio.wait_for(self._wake.wait(), max(self.follow_s - self.min_gap_s, 0.0))
                except TimeoutError:
                    pass
                self._wake = None
                self._stale = True  # (not stale(): the settling window stays the last write's)

    async def refresh(self) -> bool:
        """One STATS round into the gauges (best effort: an error leaves them as they are);
        returns whether the shards are still moving: one reports background work pending, or the
        bytes differ from the last refresh's (module docstring).

        The totals (``oprag_chunks``, ``oprag_documents``, ``oprag_memory_records``) are those of
        the shards that answer, as the Stats RPC's; a shard that is down is left out of them and
        its ``oprag_shard_bytes`` series are removed (no stale sample) until it answers again
        (``oprag_shards_up``, ``oprag_shard_replica_up`` say which: the supervisor refreshes the
        gauges when a shard goes down and when it is back, :meth:`stale`).
        """
        try:
            got, missing = await self.pool.gather_partial(Op.STATS, StatsRequest())
        except Exception:  # noqa: BLE001 - gauges are best effort
            return False
        st = list(got.values())
        self.metrics.chunks.set(sum(s.chunks for s in st))
        self.metrics.documents.set(sum(s.documents for s in st))
        self.metrics.memory_records.set(sum(s.memory_records for s in st))
        for i, s in got.items():
            parts = self._bytes_series.setdefault(i, set())
            for component, n in (s.nbytes or {}).items():
                self.metrics.shard_bytes.labels(shard=str(i), component=component).set(n)
                parts.add(component)
            for work in _PENDING:
                self.metrics.shard_pending.labels(shard=str(i), work=work).set(getattr(s, f"{work}_pending", 0))
        for i in missing:
            for component in self._bytes_series.pop(i, ()):
                self.metrics.shard_bytes.remove(str(i), component)
            for work in _PENDING:
                try:
                    self.metrics.shard_pending.remove(str(i), work)
                except KeyError:  # (never set: the shard was down from the start)
                    pass
        seen = {i: dict(s.nbytes or {}) for i, s in got.items()}
        changed, self._seen = seen != self._seen, seen
        return changed or any(getattr(s, f"{work}_pending", 0) for s in st for work in _PENDING)
