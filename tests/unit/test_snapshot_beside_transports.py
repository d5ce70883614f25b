"""Thread shards (``--shard-workers thread``) and in-process shards write their snapshot beside
the calls, as shard processes do (issue 13, snap15; test_snapshot_beside.py is the process
loop's test): reads sent while a (deliberately held) snapshot is written are answered before it
is done; every other request waits for it, in order; a server killed (SIGKILL) while a thread
shard writes one keeps the previous snapshot live and the log whole; a shard killed meanwhile
ends it first."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
from test_snapshot_beside import (D, _assert_recovered, _batch, _hold, _kill_once_written, _search, _seed,
                                 _stall_before_current)

from oprag_server import records
from oprag_server.shards.inprocess import InProcessTransport
from oprag_server.shards.protocol import (ApplyRequest, FetchRequest, MemoryLookupRequest, Op, PrepareRequest,
                                          PromoteRequest, SnapshotRequest, StageRequest, StatsRequest)
from oprag_server.shards.state import ShardState
from oprag_server.shards.threaded import ThreadTransport
from oprag_server.shards.transport import ShardError

HOLD_S = 8.0  # how long the held snapshot waits for the test to release it before it goes on


def _shard(tmp_path) -> ThreadTransport:
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.search.warm()  # compiled kernels ready (a cold numba cache compiles for seconds at the first search)
    return ThreadTransport.of(st)


def _promote() -> PromoteRequest:
    return PromoteRequest("s", "q?", "", [], [], np.ones(D, np.float32), max_turns=4)


def test_reads_are_answered_while_a_thread_shard_writes_its_snapshot(tmp_path, monkeypatch):
    _seed(tmp_path)
    released = _hold(monkeypatch)
    t = _shard(tmp_path)
    order: list[int] = []

    async def go():
        t0 = time.perf_counter()
        futs = {1: t.call(Op.SNAPSHOT, SnapshotRequest()), 2: t.call(Op.STATS, StatsRequest()),
                3: t.call(Op.SEARCH, _search()), 4: t.call(Op.FETCH, FetchRequest([0, 1, 199])),
                5: t.call(Op.PROMOTE, _promote()),
                6: t.call(Op.MEMORY_LOOKUP, MemoryLookupRequest(["s"], 4))}  # a read: passes the held write
        for i, f in futs.items():
            f.add_done_callback(lambda _, i=i: order.append(i))
        reads = await asyncio.wait_for(asyncio.gather(futs[2], futs[3], futs[4], futs[6]), HOLD_S / 2)
        fast = time.perf_counter() - t0
        await asyncio.sleep(0.2)
        assert not futs[1].done() and not futs[5].done()  # the snapshot is held, and the write behind it
        released.set()
        snap, _ = await asyncio.wait_for(asyncio.gather(futs[1], futs[5]), 30)
        after = await t.call(Op.MEMORY_LOOKUP, MemoryLookupRequest(["s"], 4))
        return fast, reads, snap, after

    try:
        fast, (stats, search, fetch, lookup), snap, after = asyncio.run(go())
    finally:
        released.set()
        t.close()
    # (before: nothing came back until the snapshot went on after HOLD_S, and wait_for timed out)
    assert fast < HOLD_S / 2 and sorted(order[:4]) == [2, 3, 4, 6], order
    assert stats.chunks == 200 and fetch.found == [True, True, True]
    assert len(search.candidates) == 1 and len(search.candidates[0].slots) == 5
    assert lookup.turns == [[]]  # (the promote waits for the snapshot)
    assert order[4:] == [1, 5] and snap.written and snap.chunks == 200
    assert [x.question for x in after.turns[0]] == ["q?"]


def test_reads_are_answered_while_an_in_process_shard_writes_its_snapshot(tmp_path, monkeypatch):
    _seed(tmp_path)
    released = _hold(monkeypatch)
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.search.warm()
    t = InProcessTransport.of(st, copy=True)
    order: list[int] = []

    async def go():
        calls = [(1, Op.SNAPSHOT, SnapshotRequest()), (2, Op.STATS, StatsRequest()), (3, Op.SEARCH, _search()),
                 (4, Op.PROMOTE, _promote()), (5, Op.MEMORY_LOOKUP, MemoryLookupRequest(["s"], 4))]
        futs = []
        for i, op, req in calls:
            futs.append(asyncio.ensure_future(t.call(op, req)))
            futs[-1].add_done_callback(lambda _, i=i: order.append(i))
        stats, search, lookup = await asyncio.wait_for(asyncio.gather(futs[1], futs[2], futs[4]), HOLD_S / 2)
        await asyncio.sleep(0.2)
        assert not futs[0].done() and not futs[3].done()
        released.set()
        snap, _ = await asyncio.wait_for(asyncio.gather(futs[0], futs[3]), 30)
        return stats, search, lookup, snap, await t.call(Op.MEMORY_LOOKUP, MemoryLookupRequest(["s"], 4))

    try:
        stats, search, lookup, snap, after = asyncio.run(go())
    finally:
        released.set()
    # (the promote runs once the snapshot is written; their two replies may come in either order)
    assert sorted(order[:3]) == [2, 3, 5] and sorted(order[3:]) == [1, 4], order
    assert stats.chunks == 200 and len(search.candidates[0].slots) == 5 and lookup.turns == [[]]
    assert snap.written and snap.chunks == 200 and [x.question for x in after.turns[0]] == ["q?"]


def test_writes_and_a_second_snapshot_wait_in_order(tmp_path, monkeypatch):
    """Held requests run in the order they came, a second SNAPSHOT among them holding the rest
    again; a transaction staged, prepared and applied behind the first snapshot is in the second."""
    _seed(tmp_path)
    released = _hold(monkeypatch)
    t = _shard(tmp_path)
    order: list[int] = []

    async def go():
        calls = [(1, Op.SNAPSHOT, SnapshotRequest()), (2, Op.STAGE, StageRequest("t1", records.to_ipc(_batch(200, 230)))),
                 (3, Op.PREPARE, PrepareRequest("t1", 2, "upsert")), (4, Op.APPLY, ApplyRequest("t1")),
                 (5, Op.SNAPSHOT, SnapshotRequest()), (6, Op.PROMOTE, _promote())]
        futs = []
        for i, op, req in calls:
            futs.append(t.call(op, req))
            futs[-1].add_done_callback(lambda _, i=i: order.append(i))
        stats = await asyncio.wait_for(t.call(Op.STATS, StatsRequest()), HOLD_S / 2)
        released.set()
        out = await asyncio.wait_for(asyncio.gather(*futs), 60)
        return stats, out

    try:
        stats, out = asyncio.run(go())
    finally:
        released.set()
        t.close()
    assert stats.chunks == 200 and order == [1, 2, 3, 4, 5, 6], order
    assert out[0].chunks == 200 and out[4].chunks == 230
    again = ShardState(0, D, tmp_path)
    again.load(set())  # (t1 not named committed: its chunks come from the second snapshot, not the log)
    assert len(again.store.chunks) == 230


def test_a_thread_shard_killed_while_it_writes_a_snapshot_ends_it_first(tmp_path, monkeypatch):
    """``kill()`` fails the held calls and returns once the snapshot's writer is done (a
    replacement must not share the log with it); calls after it fail."""
    _seed(tmp_path)
    released = _hold(monkeypatch)
    t = _shard(tmp_path)

    async def go():
        snap = t.call(Op.SNAPSHOT, SnapshotRequest())
        held = t.call(Op.PROMOTE, _promote())
        await asyncio.wait_for(t.call(Op.STATS, StatsRequest()), HOLD_S / 2)
        threading.Timer(0.3, released.set).start()
        t0 = time.perf_counter()
        t.kill()
        waited = time.perf_counter() - t0
        await asyncio.sleep(0.05)
        res = await asyncio.gather(snap, held, return_exceptions=True)
        late = await asyncio.gather(t.call(Op.STATS, StatsRequest()), return_exceptions=True)
        return waited, res, late

    waited, (snap, held), (late,) = asyncio.run(go())
    assert waited >= 0.25  # it waited for the held writer
    assert isinstance(held, ShardError) and isinstance(late, ShardError)
    assert not any(p.name.startswith("snap-") and not (p / "meta.json").exists()
                   for p in (tmp_path / "shard-0").iterdir())  # no half-written snapshot left behind


def _serve_then_die(tmp_path, conn) -> None:
    """(A forked child: the server) a thread shard with an acknowledged transaction in its log;
    its snapshot stops before ``CURRENT`` switches; STATS answered meanwhile; then SIGKILLed."""
    _stall_before_current()
    t = ThreadTransport.of(ShardState(0, D, tmp_path))
    t.state.load(set())

    async def go():
        assert (await t.call(Op.STAGE, StageRequest("t1", records.to_ipc(_batch(200, 260))))) is not None
        await t.call(Op.PREPARE, PrepareRequest("t1", 2, "upsert"))
        await t.call(Op.APPLY, ApplyRequest("t1"))
        conn.send("acknowledged")
        t.call(Op.SNAPSHOT, SnapshotRequest())
        stats = await asyncio.wait_for(t.call(Op.STATS, StatsRequest()), 30)
        conn.send(stats.chunks)
        await asyncio.sleep(3600)

    asyncio.run(go())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_server_killed_while_a_thread_shard_writes_a_snapshot_keeps_everything_acknowledged(tmp_path):
    _seed(tmp_path)
    live = (tmp_path / "shard-0" / "CURRENT").read_text()
    front, back = mp.get_context("fork").Pipe(duplex=True)
    proc = mp.get_context("fork").Process(target=_serve_then_die, args=(tmp_path, back), daemon=True)
    proc.start()
    try:
        assert front.poll(60) and front.recv() == "acknowledged"
        assert front.poll(30) and front.recv() == 260  # answered while the snapshot is written
        _kill_once_written(proc, tmp_path, live)
    finally:
        if proc.is_alive():
            proc.kill()
    _assert_recovered(tmp_path, live)


def test_the_fields_a_snapshot_replaces_are_freed_off_the_shards_thread(tmp_path):
    """Dropping the parts the stored fields served before (at 1M: the previous snapshot's mapping,
    150-260 ms to unmap) is left to a thread of its own: the snapshot is answered meanwhile."""
    _seed(tmp_path)
    st = ShardState(0, D, tmp_path)
    st.load(set())
    started, release, where = threading.Event(), threading.Event(), []

    class Held(list):
        def clear(self):
            where.append(threading.current_thread().name)
            started.set()
            release.wait(HOLD_S)
            super().clear()

    st.store.fields._parts = Held(st.store.fields._parts)
    t0 = time.perf_counter()
    try:
        reply = st.snapshot()
        took = time.perf_counter() - t0
        assert started.wait(HOLD_S / 2)  # (before: the old parts were dropped by the shard's thread itself)
    finally:
        release.set()
    assert reply.written and took < HOLD_S / 2 and where == ["oprag-snapshot-drop"]
