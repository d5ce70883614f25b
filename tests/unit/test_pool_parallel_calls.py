"""ShardPool.gather_partial starts every shard's call before awaiting any, also when a
transport's call is a coroutine that runs only when awaited (a replica set's read)."""

from __future__ import annotations

import asyncio

from oprag_server.shards.pool import ShardPool
from oprag_server.shards.protocol import Op
from oprag_server.shards.transport import ShardError


class _CoroutineShard:
    """``call`` is ``async def``: nothing is sent until it is awaited."""

    def __init__(self, shard_id: int, started: list[int], release: asyncio.Event, fail: bool = False) -> None:
        self.shard_id, self.started, self.release, self.fail = shard_id, started, release, fail

    async def call(self, op: Op, request):
        self.started.append(self.shard_id)
        await self.release.wait()
        if self.fail:
            raise ShardError(f"shard {self.shard_id} down")
        return (self.shard_id, request)


def _pool(n: int, started: list[int], release: asyncio.Event, fail: set[int] = frozenset()) -> ShardPool:
    pool = ShardPool.__new__(ShardPool)
    pool.n, pool.fenced = n, lambda: None
    pool.clients = [_CoroutineShard(i, started, release, i in fail) for i in range(n)]
    return pool


def test_every_shard_starts_before_any_reply_and_failures_are_missing():
    async def main():
        started: list[int] = []
        release = asyncio.Event()
        pool = _pool(3, started, release, fail={1})
        task = asyncio.ensure_future(pool.gather_partial(Op.SEARCH, "q"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert sorted(started) == [0, 1, 2]  # all three in flight while none has answered
        release.set()
        return await task

    got, missing = asyncio.run(main())
    assert got == {0: (0, "q"), 2: (2, "q")}
    assert missing == [1]
