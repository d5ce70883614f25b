"""The shard's end of the pipe (``shards.worker.Pipe``): the frames of
``multiprocessing.connection.Connection`` both ways (small, over 16 KB, over 1 MB, several in
one write, split at every byte), a reply in one write, EOF when the other end closes."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading

import numpy as np
import pytest

from oprag_server.shards.worker import Pipe


def _pair():
    a, b = mp.get_context("spawn").Pipe(duplex=True)
    return a, Pipe.of(b)


@pytest.mark.parametrize("size", [0, 10, 20_000, 70_000, 3_000_000])
def test_frames_both_ways(size):
    front, shard = _pair()
    obj = (7, "op", np.arange(size, dtype=np.uint8), "x" * (size // 3))
    t = threading.Thread(target=front.send, args=(obj,))  # (a large frame fills the pipe: send while reading)
    t.start()
    got = shard.recv()
    t.join()
    assert got[0] == 7 and got[1] == "op" and np.array_equal(got[2], obj[2]) and got[3] == obj[3]
    t = threading.Thread(target=shard.send, args=((7, True, obj),))
    t.start()
    back = front.recv()
    t.join()
    assert back[0] == 7 and back[1] is True and np.array_equal(back[2][2], obj[2])
    assert not shard.buf


def test_several_frames_in_one_write_and_split_writes():
    front, shard = _pair()
    frames = b""
    objs = [(i, "search", list(range(i * 50))) for i in range(6)]
    for o in objs:
        body = pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
        frames += len(body).to_bytes(4, "big", signed=True) + body
    os.write(front.fileno(), frames[:2])  # a header split, then the rest in pieces
    fd = front.fileno()

    def rest():
        for i in range(2, len(frames), 997):
            os.write(fd, frames[i:i + 997])
    t = threading.Thread(target=rest)
    t.start()
    got = [shard.recv() for _ in objs]
    t.join()
    assert got == objs and not shard.buf and not shard.poll(0)


def test_a_reply_is_one_write(monkeypatch):
    front, shard = _pair()
    calls = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, parts: calls.append(len(parts)) or real(fd, parts))
    shard.send((1, True, b"y" * 40_000))
    assert calls == [2] and front.recv() == (1, True, b"y" * 40_000)


def test_eof_when_the_other_end_closes():
    front, shard = _pair()
    front.send((1, "x", None))
    front.close()
    assert shard.recv() == (1, "x", None)
    with pytest.raises(EOFError):
        shard.recv()


def test_something_without_a_descriptor_is_used_as_it_is():
    class Q:
        def fileno(self):
            raise OSError("no descriptor")
    q = Q()
    assert Pipe.of(q) is q


def test_a_reply_is_pickled_with_protocol_5():
    """Replies are pickled with the highest protocol (5: bytearrays as themselves, what the
    compact Candidates buffers are), not Connection.send's default (4 on Python 3.11)."""
    front, shard = _pair()
    shard.send((3, True, bytearray(b"abc")))
    raw = front.recv_bytes()
    assert raw[:2] == b"\x80\x05" and pickle.loads(raw) == (3, True, bytearray(b"abc"))
