"""Session memory is as durable as documents: every acknowledged memory change (a promoted
turn, a clear, retention applied by a write) is in the shard's write-ahead log before it is
visible, and a restarted shard (snapshot + log replay) holds exactly what was acknowledged --
in particular a cleared session never comes back. Uses the in-process shard pool and the
Memory operator; a "crash" is dropping the shard objects without a snapshot."""

from __future__ import annotations

import asyncio

import numpy as np

from oprag_server.config import MemoryConfig
from oprag_server.domain import Hit
from oprag_server.operators.memory import Memory
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.protocol import MemoryClearRequest, MemoryLookupRequest, PromoteRequest
from oprag_server.shards.state import ShardState

DIM = 8


def _states(tmp_path, n=2):
    out = []
    for i in range(n):
        s = ShardState(i, DIM, tmp_path)
        s.load(set())  # attaches the write-ahead log, as a starting shard does
        out.append(s)
    return out


def _turns(states, sid):
    got = []
    for s in states:
        got += s.memory.lookup(MemoryLookupRequest([sid], 100, 0)).turns[0]
    return [t.question for t in got]


def test_turns_and_clear_survive_a_crash_through_the_pool(tmp_path):
    async def go():
        states = _states(tmp_path)
        mem = Memory(in_process_pool(states), MemoryConfig())
        for sid in ("keep", "gone", "later"):
            for i in range(3):
                await mem.promote(sid, f"{sid} q{i}", "an answer", [Hit(f"d{i}#0", f"d{i}", f"T{i}", "text", 1.0, 1.0, 0.0, 0)],
                                 np.ones(DIM, np.float32))
        assert await mem.clear("gone") == 3
        return states

    states = asyncio.run(go())
    states[0].snapshot()  # one shard snapshots mid-way (the other has only its log)
    owner = next(s for s in states if _turns([s], "keep"))
    owner.memory.promote(PromoteRequest("keep", "after snapshot", "", [], [], np.ones(DIM, np.float32), max_turns=32))
    expected = {sid: _turns(states, sid) for sid in ("keep", "gone", "later")}
    del states  # crash: no snapshot, nothing closed
    back = _states(tmp_path)
    for sid, qs in expected.items():
        assert _turns(back, sid) == qs
    assert _turns(back, "gone") == []
    assert _turns(back, "keep")[0] == "after snapshot"


def test_resolved_subject_fields_round_trip_log_and_snapshot(tmp_path):
    (s,) = _states(tmp_path, 1)
    req = PromoteRequest("a", "And its battery?", "", ["c1#0"], ["Z900"], np.ones(DIM, np.float32), max_turns=4,
                         resolved="And its battery? Z900 warranty", doc_ids=["c1"], terms=["z900", "warranty"])
    s.memory.promote(req)
    (t,) = _states(tmp_path, 1)  # from the log
    got = t.memory.lookup(MemoryLookupRequest(["a"], 1, 0)).turns[0][0]
    assert (got.resolved, got.doc_ids, got.terms) == (req.resolved, ["c1"], ["z900", "warranty"])
    t.snapshot()
    (u,) = _states(tmp_path, 1)  # from the snapshot (the log was reset)
    got = u.memory.lookup(MemoryLookupRequest(["a"], 1, 0)).turns[0][0]
    assert (got.resolved, got.doc_ids, got.terms) == (req.resolved, ["c1"], ["z900", "warranty"])


def test_retention_replays_as_it_was_applied(tmp_path):
    (s,) = _states(tmp_path, 1)
    for i in range(6):
        s.memory.promote(PromoteRequest(f"s{i % 3}", f"q{i}", "", [], [], np.ones(DIM, np.float32), max_turns=1,
                                        max_total=2))
    before = {sid: _turns([s], sid) for sid in ("s0", "s1", "s2")}
    (t,) = _states(tmp_path, 1)
    assert {sid: _turns([t], sid) for sid in ("s0", "s1", "s2")} == before
    assert len(t.memory) == 2


def test_clear_is_logged_before_the_records_go(tmp_path):
    (s,) = _states(tmp_path, 1)
    s.memory.promote(PromoteRequest("x", "q", "", [], [], np.ones(DIM, np.float32), max_turns=4))
    s.snapshot()  # the turn is now only in the snapshot
    s.memory.clear(MemoryClearRequest("x"))
    (t,) = _states(tmp_path, 1)  # snapshot has it, the log's clear removes it
    assert _turns([t], "x") == []
