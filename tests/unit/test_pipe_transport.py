"""The pipe transport read and written by the event loop (issue 13, hot path): frames as
``multiprocessing.connection`` writes them, messages larger than the socket buffers both ways,
replies out of order, and pending calls failing when the peer goes away or is hung up on."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import pytest

from oprag_server.shards.protocol import Op, StatsRequest
from oprag_server.shards.transport import PipeTransport, ShardError


def _echo(conn, reverse: bool = False) -> None:
    """A peer with a plain ``Connection``: answers each request with its payload (a batch of
    requests in reverse order when asked)."""
    held = []
    while True:
        try:
            req_id, op, req = conn.recv()
        except (EOFError, OSError):
            return
        held.append((req_id, True, (op, req)))
        if not reverse or len(held) == 3:
            for m in reversed(held) if reverse else held:
                conn.send(m)
            held = []


def _pair(reverse=False):
    front, back = mp.Pipe(duplex=True)
    threading.Thread(target=_echo, args=(back, reverse), daemon=True).start()
    return front, back


def test_large_messages_cross_both_ways_and_replies_match_their_calls():
    async def go():
        front, _ = _pair()
        t = PipeTransport(0, 4, None)
        t.attach(front, asyncio.get_running_loop())
        big = [bytes([i]) * (3 << 20) + b"x" * i for i in range(4)]  # 3 MiB each: far over a socket buffer
        got = await asyncio.gather(*[t.call(Op.STATS, b) for b in big], t.call(Op.STATS, "small"))
        assert [g[1] for g in got] == [*big, "small"] and all(g[0] is Op.STATS for g in got)
        assert t.is_alive()
        t.close()

    asyncio.run(go())


def test_replies_in_another_order_resolve_the_right_calls():
    async def go():
        front, _ = _pair(reverse=True)
        t = PipeTransport(0, 4, None)
        t.attach(front, asyncio.get_running_loop())
        got = await asyncio.wait_for(asyncio.gather(*[t.call(Op.STATS, i) for i in range(3)]), 10)
        assert [g[1] for g in got] == [0, 1, 2]

    asyncio.run(go())


def test_a_peer_that_goes_away_fails_pending_and_later_calls():
    async def go():
        front, back = mp.Pipe(duplex=True)
        t = PipeTransport(0, 4, None)
        t.attach(front, asyncio.get_running_loop())
        pending = t.call(Op.STATS, StatsRequest())
        await asyncio.sleep(0.05)
        back.close()
        with pytest.raises(ShardError, match="exited"):
            await asyncio.wait_for(pending, 5)
        assert not t.is_alive()
        with pytest.raises(ShardError, match="not running"):
            await t.call(Op.STATS, StatsRequest())

    asyncio.run(go())


def test_hangup_from_another_thread_and_attach_off_the_loop():
    async def go():
        loop = asyncio.get_running_loop()
        front, _silent = mp.Pipe(duplex=True)
        t = PipeTransport(0, 4, None)
        await loop.run_in_executor(None, t.attach, front, loop)  # as a restart does
        pending = t.call(Op.STATS, StatsRequest())
        await asyncio.sleep(0.05)
        assert not pending.done()
        await loop.run_in_executor(None, t.hangup)
        with pytest.raises(ShardError):
            await asyncio.wait_for(pending, 5)
        assert not t.is_alive() and front.closed

    asyncio.run(go())


def test_a_request_that_cannot_be_pickled_fails_alone():
    async def go():
        front, _ = _pair()
        t = PipeTransport(0, 4, None)
        t.attach(front, asyncio.get_running_loop())
        with pytest.raises(ShardError, match="pickle"):
            await t.call(Op.STATS, lambda: 0)
        assert (await t.call(Op.STATS, 1))[1] == 1

    asyncio.run(go())


def _raw_peer(sock, plan):
    """Reads the requests' frames, then writes the replies as one byte stream cut by ``plan``
    (a list of chunk sizes, the rest in one): frames split inside headers and bodies, several
    frames per write."""
    import pickle
    import struct
    import time

    from multiprocessing.connection import Connection

    c = Connection(sock.detach())
    reqs = [c.recv() for _ in range(plan["n"])]
    stream = b""
    for req_id, _op, req in reqs:
        body = pickle.dumps((req_id, True, req), protocol=pickle.HIGHEST_PROTOCOL)
        stream += struct.pack("!i", len(body)) + body
    stream += plan.get("tail", b"")
    pos = 0
    for n in plan["cuts"]:
        c._send(stream[pos:pos + n])
        pos += n
        time.sleep(0.01)  # the reader sees each piece alone
    if stream[pos:]:
        c._send(stream[pos:])
    time.sleep(0.5)


@pytest.mark.parametrize("cuts", [[1], [3, 2, 5], [7, 100_000], [70_000, 1, 1, 1], []])
def test_frames_split_anywhere_and_several_per_read_resolve_in_order(cuts):
    import socket

    async def go():
        a, b = socket.socketpair()
        payloads = ["x" * 10, b"y" * 90_000, {"k": list(range(1000))}, "z"]
        th = threading.Thread(target=_raw_peer, args=(b, {"n": len(payloads), "cuts": cuts}), daemon=True)
        th.start()
        from multiprocessing.connection import Connection

        t = PipeTransport(0, 4, None)
        t.attach(Connection(a.detach()), asyncio.get_running_loop())
        got = await asyncio.wait_for(asyncio.gather(*[t.call(Op.STATS, p) for p in payloads]), 10)
        assert got == payloads
        assert t._rlen == 0 and t._need == 0 and t.is_alive()
        t.close()

    asyncio.run(go())


def test_a_corrupt_frame_fails_pending_calls_after_the_good_ones_resolve():
    import socket

    async def go():
        a, b = socket.socketpair()
        bad = (8).to_bytes(4, "big") + b"\x80\x05notpkl"
        th = threading.Thread(target=_raw_peer, args=(b, {"n": 2, "cuts": [], "tail": bad}), daemon=True)
        th.start()
        from multiprocessing.connection import Connection

        t = PipeTransport(0, 4, None)
        t.attach(Connection(a.detach()), asyncio.get_running_loop())
        first = await asyncio.wait_for(asyncio.gather(t.call(Op.STATS, 1), t.call(Op.STATS, 2)), 10)
        assert first == [1, 2]
        late = t.call(Op.STATS, 3)
        with pytest.raises(ShardError, match="unreadable reply|not running"):
            await asyncio.wait_for(late, 10)
        assert not t.is_alive()
        t.close()

    asyncio.run(go())

