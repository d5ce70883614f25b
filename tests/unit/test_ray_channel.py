"""The direct channel of Ray-placed shards without Ray: the actor body (ShardActor) serves the
pipe protocol on one end of a real socket pair, the frontend's PipeTransport.attach reads the
other; a request before loading, a bad op and a silent peer (a lost node sends no FIN) all
end as ShardError, and marking the shard down wakes the blocked reader."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import pytest

from oprag_server.shards.protocol import Op, StatsRequest
from oprag_server.shards.ray_transport import RayTransport, ShardActor
from oprag_server.shards.transport import PipeTransport, ShardError


def _channel(actor: ShardActor, loop) -> PipeTransport:
    front, back = mp.Pipe(duplex=True)  # a socket pair: the same Connection type as TCP
    threading.Thread(target=actor._serve, args=(back,), daemon=True).start()
    chan = PipeTransport(0, 4, None)
    chan.attach(front, loop)
    return chan


def test_actor_body_serves_the_pipe_protocol():
    async def go():
        actor = ShardActor(0, 4, None, False)
        chan = _channel(actor, asyncio.get_running_loop())
        with pytest.raises(ShardError, match="not loaded"):
            await chan.call(Op.STATS, StatsRequest())
        inc, ok, _ = actor.load(None)
        assert ok and inc == actor.incarnation
        st = await chan.call(Op.STATS, StatsRequest())
        assert st.shard == 0 and st.chunks == 0
        with pytest.raises(ShardError, match="takes a StatsRequest"):
            await chan.call(Op.STATS, "not a request")
        assert (await chan.call(Op.STATS, StatsRequest())).shard == 0  # the loop survived it
        assert chan.is_alive()

    asyncio.run(go())


def test_marking_down_fails_calls_pending_on_a_silent_peer():
    async def go():
        loop = asyncio.get_running_loop()
        front, _silent = mp.Pipe(duplex=True)  # nobody answers, nothing closes
        t = RayTransport(0, 4, None, placement=None)
        t._chan = PipeTransport(0, 4, None)
        t._chan.attach(front, loop)
        t.loop, t._alive = loop, True
        pending = t.call(Op.STATS, StatsRequest())
        await asyncio.sleep(0.1)
        assert not pending.done() and t.is_alive()
        t._mark_down("ping failed")
        with pytest.raises(ShardError):
            await asyncio.wait_for(pending, 5)
        assert not t.is_alive()
        with pytest.raises(ShardError, match="not running"):
            await t.call(Op.STATS, StatsRequest())

    asyncio.run(go())
