"""A broadcast's replies resolve one Gather (shards/gather.py, ShardPool.gather_partial): with
shards on threads only the last shard to answer hands over to the event loop (one
``call_soon_threadsafe`` per request, not one per shard); with pipe transports the replies
land in the group's slots and the awaiting task wakes once. Replies, errors (a missing shard)
and shards that are down give what they gave before."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import numpy as np
from test_pipe_transport import _pair
from test_retrieval import _build, _corpus
from test_thread_shards import _thread_pool

from oprag_server.shards.gather import Gather
from oprag_server.shards.pool import ShardPool
from oprag_server.shards.protocol import Op, StatsRequest
from oprag_server.shards.transport import PipeTransport


def _hand_offs(loop) -> list:
    """Count the loop's ``call_soon_threadsafe`` calls (from a shard's thread, or from the loop's
    when a shard finished before its done callback was added)."""
    seen, real = [], loop.call_soon_threadsafe

    def counted(*a, **k):
        seen.append(a[0])
        return real(*a, **k)
    loop.call_soon_threadsafe = counted
    return seen


def test_thread_shards_hand_a_broadcast_over_to_the_loop_once():
    states, _ = _build(_corpus(np.random.default_rng(3), 40))
    pool = _thread_pool(states)

    async def go():
        seen = _hand_offs(asyncio.get_running_loop())
        outs = [await pool.gather_partial(Op.STATS, StatsRequest()) for _ in range(20)]
        return outs, len(seen)

    outs, hand_offs = asyncio.run(go())
    assert hand_offs == 20  # one per request (two before: one per shard)
    for got, missing in outs:
        assert not missing and sorted(got) == [0, 1]
        assert [got[s].chunks for s in (0, 1)] == [len(s.store.chunks) for s in states]
    assert all(not c._pending for c in pool.clients)  # the slots are forgotten once answered


def test_thread_shards_an_error_or_a_shard_down_is_missing_and_the_rest_answers():
    states, _ = _build(_corpus(np.random.default_rng(4), 40))
    pool = _thread_pool(states)

    def boom(req):
        raise RuntimeError("broken")
    pool.clients[1]._table[Op.STATS] = boom

    async def go():
        got, missing = await pool.gather_partial(Op.STATS, StatsRequest())
        assert missing == [1] and list(got) == [0]
        pool.clients[0]._exec.shutdown(wait=True)  # submit fails on the loop: the slot is set there
        got, missing = await pool.gather_partial(Op.STATS, StatsRequest())
        assert missing == [0, 1] and not got
        pool.clients[1].kill()
        got, missing = await pool.gather_partial(Op.STATS, StatsRequest(), shards=[1, 0])
        assert missing == [1, 0] and not got

    asyncio.run(asyncio.wait_for(go(), 30))


def test_pipe_transports_answer_into_one_gather():
    async def go():
        loop = asyncio.get_running_loop()
        pool = ShardPool(3, 4, None)
        pool.clients = [PipeTransport(i, 4, None) for i in range(3)]
        peers = []
        for t in pool.clients:
            front, back = _pair()
            peers.append(back)
            t.attach(front, loop)
        got, missing = await asyncio.wait_for(pool.gather_partial(Op.STATS, ["a", "b", "c"]), 10)
        assert not missing and [got[s][1] for s in range(3)] == ["a", "b", "c"]
        g = Gather(loop, 2)
        calls = [pool.clients[i].call(Op.STATS, i, into=g.slot(k)) for k, i in enumerate((2, 0))]
        assert calls[0] is not calls[1] and not isinstance(calls[0], asyncio.Future)
        assert [o[1] for o in await asyncio.wait_for(g.future, 10)] == [2, 0]
        # a peer that goes away: its shard is missing, the others answer
        dead_front, dead_back = mp.Pipe(duplex=True)
        pool.clients[1] = PipeTransport(1, 4, None)
        pool.clients[1].attach(dead_front, loop)
        task = asyncio.ensure_future(pool.gather_partial(Op.STATS, StatsRequest()))
        await asyncio.sleep(0.05)
        dead_back.close()
        got, missing = await asyncio.wait_for(task, 10)
        assert missing == [1] and sorted(got) == [0, 2]
        got, missing = await pool.gather_partial(Op.STATS, StatsRequest())  # down: missing at once
        assert missing == [1] and sorted(got) == [0, 2]

    asyncio.run(go())


def test_a_cancelled_awaiter_leaves_the_late_replies_harmless():
    states, _ = _build(_corpus(np.random.default_rng(5), 20))
    pool = _thread_pool(states)
    gate = threading.Event()
    real = pool.clients[0]._table[Op.STATS]
    pool.clients[0]._table[Op.STATS] = lambda req: (gate.wait(10), real(req))[1]

    async def go():
        task = asyncio.ensure_future(pool.gather_partial(Op.STATS, StatsRequest()))
        await asyncio.sleep(0.05)
        task.cancel()
        gate.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        got, missing = await asyncio.wait_for(pool.gather_partial(Op.STATS, StatsRequest()), 10)
        assert not missing and sorted(got) == [0, 1]

    asyncio.run(go())


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


class _Spy:
    """A joining transport over a real process (its pid): records the scheduling policy of
    every process of the broadcast when its call is made, and answers at once."""

    joins, _alive = True, True

    def __init__(self, pid: int, watch: list) -> None:
        self.proc, self.watch, self.seen = _Proc(pid), watch, []

    def call(self, op, request, into=None):
        import os
        self.seen.append([os.sched_getscheduler(p) for p in self.watch])
        into.set_result("ok")
        return into


def test_a_broadcast_holds_the_first_shards_wake_up_preemption_until_its_last_write():
    """gather_partial switches every shard process but the last written to SCHED_BATCH for the
    writes (a woken batch task does not preempt the writer) and back to SCHED_OTHER after; a
    process that is not SCHED_OTHER (here SCHED_IDLE) is left as it is."""
    import os
    import subprocess
    import sys

    from oprag_server.shards import gather

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        pids = [p.pid for p in procs]
        os.sched_setscheduler(pids[3], os.SCHED_IDLE, os.sched_param(0))
        spies = [_Spy(p, pids) for p in pids]
        pool = ShardPool.__new__(ShardPool)
        pool.n, pool.clients, pool.fenced = 4, spies, False
        pool._guard = lambda op: None
        got, missing = asyncio.run(pool.gather_partial(Op.STATS, StatsRequest(), shards=[0, 1, 3, 2]))
        assert got == {0: "ok", 1: "ok", 2: "ok", 3: "ok"} and not missing
        B, O, I = os.SCHED_BATCH, os.SCHED_OTHER, os.SCHED_IDLE
        # written in the order 0, 1, 3, 2: 0 and 1 held (batch) through every write; 2, the last, not
        for s in (0, 1, 3, 2):
            assert spies[s].seen == [[B, B, O, I]], s
        assert [os.sched_getscheduler(p) for p in pids] == [O, O, O, I]  # released after the writes
        gather.HOLD = False
        try:
            asyncio.run(pool.gather_partial(Op.STATS, StatsRequest()))
        finally:
            gather.HOLD = True
        assert spies[0].seen[-1] == [O, O, O, I]  # switched off: nothing held
    finally:
        for p in procs:
            p.kill()
            p.wait()
