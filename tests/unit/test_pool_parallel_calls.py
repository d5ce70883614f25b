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


class _FutureShard:
    """``call`` returns a future (sent at once, like a pipe's), resolved by the test."""

    def __init__(self, shard_id: int, futs: dict) -> None:
        self.shard_id, self.futs = shard_id, futs

    def call(self, op: Op, request):
        fut = asyncio.get_running_loop().create_future()
        self.futs[self.shard_id] = fut
        return fut


def _future_pool(n: int, futs: dict) -> ShardPool:
    pool = ShardPool.__new__(ShardPool)
    pool.n, pool.fenced = n, lambda: None
    pool.clients = [_FutureShard(i, futs) for i in range(n)]
    return pool


def test_futures_resolved_in_any_order_give_the_replies_and_the_missing_shards():
    async def main(order, fail):
        futs: dict = {}
        task = asyncio.ensure_future(_future_pool(3, futs).gather_partial(Op.SEARCH, "q"))
        await asyncio.sleep(0)
        assert sorted(futs) == [0, 1, 2]  # every call sent before any reply
        for s in order:
            await asyncio.sleep(0)
            if s in fail:
                futs[s].set_exception(ShardError(f"shard {s} down"))
            else:
                futs[s].set_result(("reply", s))
        return await task

    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        got, missing = asyncio.run(main(order, {1}))
        assert got == {0: ("reply", 0), 2: ("reply", 2)} and missing == [1]
    got, missing = asyncio.run(main([2, 0, 1], set()))
    assert list(got) == [0, 1, 2] and missing == []


def test_an_error_that_is_not_a_shard_error_is_raised_after_every_reply_came():
    async def main():
        futs: dict = {}
        task = asyncio.ensure_future(_future_pool(2, futs).gather_partial(Op.SEARCH, "q"))
        await asyncio.sleep(0)
        futs[0].set_exception(ValueError("bad reply"))
        await asyncio.sleep(0)
        assert not task.done()  # still waits for shard 1
        futs[1].set_result("ok")
        try:
            await task
        except ValueError as exc:
            return str(exc)
        return None

    assert asyncio.run(main()) == "bad reply"
