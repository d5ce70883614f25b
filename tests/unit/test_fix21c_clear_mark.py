"""Trial 21: a ClearSession sticks. A turn whose request started before the session's last
clear is not recorded (a Query in flight during the clear), also after the shard restarts from
its log or from a snapshot; turns of requests that start after the clear are recorded. Uses the
shard state (with its write-ahead log) and the Memory operator over the in-process pool."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from oprag_server.config import MemoryConfig
from oprag_server.domain import Hit
from oprag_server.operators.memory import Memory
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.memory import CLEAR_MARK_S, MemoryStore
from oprag_server.shards.protocol import MemoryClearRequest, MemoryLookupRequest, PromoteRequest
from oprag_server.shards.state import ShardState

DIM = 8


def _state(tmp_path) -> ShardState:
    s = ShardState(0, DIM, tmp_path)
    s.load(set())  # attaches the write-ahead log, as a starting shard does
    return s


def _req(sid: str, q: str, started: float) -> PromoteRequest:
    return PromoteRequest(sid, q, "", [], [], np.ones(DIM, np.float32), max_turns=8, started=started)


def _questions(s: ShardState, sid: str) -> list[str]:
    return [t.question for t in s.memory.lookup(MemoryLookupRequest([sid], 100, 0)).turns[0]]


def test_a_turn_that_started_before_the_clear_is_not_recorded_through_the_operator(tmp_path):
    async def go():
        (s,) = states = [_state(tmp_path)]
        mem = Memory(in_process_pool(states), MemoryConfig())
        hit = [Hit("d#0", "d", "T", "text", 1.0, 1.0, 0.0, 0)]
        await mem.promote("race1", "What is Homarus gammarus?", "", hit, np.ones(DIM, np.float32), started=time.time())
        in_flight = time.time()  # a Query arrives ...
        assert await mem.clear("race1") == 1  # ... the session is cleared while it generates ...
        await mem.promote("race1", "What does it eat?", "an answer", hit, np.ones(DIM, np.float32), started=in_flight)
        assert _questions(s, "race1") == []  # ... and its turn is not recorded
        await mem.promote("race1", "Where does it live?", "", hit, np.ones(DIM, np.float32), started=time.time())
        assert _questions(s, "race1") == ["Where does it live?"]  # a request after the clear is
        return s

    asyncio.run(go())


def test_the_clear_mark_survives_log_replay_and_snapshot(tmp_path):
    s = _state(tmp_path)
    t0 = time.time()
    s.memory.clear(MemoryClearRequest("x", t0 + 1.0))
    s.memory.promote(_req("x", "after", t0 + 2.0))
    back = _state(tmp_path)  # from the log
    back.memory.promote(_req("x", "stale", t0 + 0.5))
    assert _questions(back, "x") == ["after"]
    back.snapshot()
    again = _state(tmp_path)  # from the snapshot (the log was reset)
    again.memory.promote(_req("x", "stale", t0 + 0.5))
    again.memory.promote(_req("x", "fresh", t0 + 3.0))
    assert _questions(again, "x") == ["fresh", "after"]


def test_unknown_start_is_recorded_and_old_marks_are_dropped():
    m = MemoryStore()
    m.clear(MemoryClearRequest("a", 1000.0))
    assert m.promote(_req("a", "q", 0.0)).records == 1  # started 0: unknown (an old frontend)
    m.clear(MemoryClearRequest("b", 1000.0 + CLEAR_MARK_S + 1))
    assert list(m.cleared) == ["b"]
