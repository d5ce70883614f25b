"""The index gauges while a shard is down (engine/gauges.py, supervision.py), over fake shards:
the totals are the answering shards', the down shard's ``oprag_shard_bytes`` series are removed
and come back with it, and the supervisor asks for a refresh when the dead shards change."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from oprag_server.engine.gauges import IndexGauges
from oprag_server.service.metrics import Metrics
from oprag_server.supervision import ShardSupervisor


class _Pool:
    n = 2

    def __init__(self) -> None:
        self.down: set[int] = set()

    def down_shards(self) -> list[int]:
        return sorted(self.down)

    async def gather_partial(self, op, req):
        got = {i: SimpleNamespace(shard=i, documents=10 + i, chunks=20 + i, memory_records=i,
                                  nbytes={"chunks": 100 + i, "vectors": 200 + i}) for i in range(2) if i not in self.down}
        return got, sorted(self.down)


def _bytes(metrics: Metrics) -> dict[tuple[str, str], float]:
    return {(s.labels["shard"], s.labels["component"]): s.value
            for m in metrics.shard_bytes.collect() for s in m.samples}


def test_a_down_shard_leaves_the_totals_and_its_series_go_until_it_is_back():
    pool, metrics = _Pool(), Metrics()
    g = IndexGauges(pool, metrics)

    async def go():
        await g.refresh()
        assert (metrics.documents._value.get(), metrics.chunks._value.get()) == (21, 41)  # noqa: SLF001
        assert set(_bytes(metrics)) == {("0", "chunks"), ("0", "vectors"), ("1", "chunks"), ("1", "vectors")}
        pool.down = {0}
        await g.refresh()
        assert (metrics.documents._value.get(), metrics.chunks._value.get(), metrics.memory_records._value.get()) \
            == (11, 21, 1)  # noqa: SLF001
        assert _bytes(metrics) == {("1", "chunks"): 101, ("1", "vectors"): 201}
        pool.down = set()
        await g.refresh()
        assert metrics.documents._value.get() == 21 and len(_bytes(metrics)) == 4  # noqa: SLF001

    asyncio.run(go())


def test_the_supervisor_asks_for_a_refresh_when_the_dead_shards_change():
    pool, changes = _Pool(), []

    async def restart(i):  # a restart that fails: the shard stays down
        raise RuntimeError("no")

    async def set_(name, status):
        pass

    sup = ShardSupervisor(pool, restart, SimpleNamespace(set=set_), ("",), Metrics(), backoff=(60.0, 60.0),
                          changed=lambda: changes.append(pool.down_shards()))

    async def go():
        await sup.check()
        pool.down = {1}
        await sup.check()
        await sup.check()  # still down: no second refresh
        pool.down = set()
        await sup.check()

    asyncio.run(go())
    assert changes == [[1], []]


class _Scripted(_Pool):
    """The fake shards, each STATS reply then shaped by ``shape(call number from 0, shard, reply)``."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.calls, self.shape = 0, shape

    async def gather_partial(self, op, req):
        got, missing = await super().gather_partial(op, req)
        for i, s in got.items():
            s.ann_pending = s.merge_pending = 0
            self.shape(self.calls, i, s)
        self.calls += 1
        return got, missing


def _until_quiet(g: IndexGauges, polls: int) -> None:
    """Mark the gauges stale and wait (``polls`` x 10 ms at most) until their refreshes stop; they must."""
    async def go():
        g.stale()
        for _ in range(polls):
            await asyncio.sleep(0.01)
            if g._task.done():  # noqa: SLF001
                break
        assert g._task.done()  # noqa: SLF001 - the refreshes stopped

    asyncio.run(go())


def test_background_work_pending_is_followed_until_it_is_done():
    """trial38b #2: a shard's bytes move without a write (HNSW inserts of deferred vectors, a BM25
    merge); while a refresh sees either pending, another follows, and they stop once none is."""
    def busy(call, i, s):
        left = [3, 1, 0][min(call, 2)]
        s.ann_pending = left if i == 0 else 0
        s.nbytes = {"vectors": 1000 - 100 * left}

    pool, metrics = _Scripted(busy), Metrics()
    g = IndexGauges(pool, metrics)
    g.min_gap_s, g.follow_s, g.settle_s = 0.01, 0.02, 0.0
    _until_quiet(g, 200)
    assert pool.calls == 4  # pending 3, 1, then none: one more finds the same bytes
    assert _bytes(metrics)[("0", "vectors")] == 1000


def test_bytes_that_move_with_nothing_pending_are_followed_for_the_settling_time():
    """trial39: an idle merge (after 5 s without writes) and a snapshot change a shard's bytes while
    no refresh saw any work pending; the refreshes go on for ``settle_s`` after the last write,
    then stop once the bytes stay put."""
    def idle(call, i, s):
        s.nbytes = {"postings": 500 if call >= 4 else 900}  # (the idle merge lands late)

    pool, metrics = _Scripted(idle), Metrics()
    g = IndexGauges(pool, metrics)
    g.min_gap_s, g.follow_s, g.settle_s = 0.01, 0.02, 0.12
    _until_quiet(g, 300)
    assert _bytes(metrics)[("0", "postings")] == 500
    assert pool.calls >= 6


def test_a_write_during_a_follow_up_wait_is_refreshed_at_once():
    """The follow-up refreshes wait ``follow_s`` between them; a write meanwhile does not wait for that
    (the CI saw ``oprag_documents`` 0 a second after an ingest, the refresh queued behind a 2 s wait)."""
    pool, metrics = _Pool(), Metrics()
    g = IndexGauges(pool, metrics)
    g.min_gap_s, g.follow_s, g.settle_s = 0.01, 5.0, 10.0
    calls = []
    real = pool.gather_partial

    async def counted(op, req):
        calls.append(asyncio.get_running_loop().time())
        return await real(op, req)

    pool.gather_partial = counted

    async def go():
        g.stale()
        await asyncio.sleep(0.2)  # the first refresh done, the follow-up waiting 5 s
        assert len(calls) == 1
        g.stale()
        await asyncio.sleep(0.2)
        assert len(calls) == 2  # refreshed at once
        g.cancel()

    asyncio.run(go())


def test_background_work_left_is_a_gauge_per_shard_and_goes_with_a_down_shard():
    """trial50 #9: ``ann_pending``, ``merge_pending`` and ``seeds_pending`` were in Stats only (the README tells
    clients to wait for them), so a dashboard could not show a shard still settling."""
    pool, metrics = _Pool(), Metrics()
    real = pool.gather_partial

    async def with_pending(op, req):
        got, missing = await real(op, req)
        for i, s in got.items():
            s.ann_pending, s.merge_pending, s.seeds_pending = 7 + i, 70_000 * i, 0
        return got, missing

    pool.gather_partial = with_pending
    g = IndexGauges(pool, metrics)

    def pending():
        return {(s.labels["shard"], s.labels["work"]): s.value for m in metrics.shard_pending.collect()
                for s in m.samples}

    async def go():
        assert await g.refresh()  # (work pending: still moving)
        assert pending() == {("0", "ann"): 7, ("0", "merge"): 0, ("0", "seeds"): 0,
                             ("1", "ann"): 8, ("1", "merge"): 70_000, ("1", "seeds"): 0}
        pool.down = {1}
        await g.refresh()
        assert set(pending()) == {("0", "ann"), ("0", "merge"), ("0", "seeds")}

    asyncio.run(go())
