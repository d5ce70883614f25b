"""Memory records on a shard: per-session turn bound, shard-wide record budget, idle time to
live, isolation between sessions, snapshot round trip (ShardState and the shard protocol
types, no processes)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from oprag_server.shards.protocol import MemoryClearRequest, MemoryLookupRequest, MemoryTurn, PromoteRequest
from oprag_server.shards.state import ShardState

DIM = 8


def _promote(s: ShardState, sid: str, q: str, max_turns: int, max_total: int = 0, ttl_s: float = 0.0) -> None:
    s.memory.promote(PromoteRequest(sid, q, f"answer to {q}", [f"{sid}#c"], [f"title {sid}"],
                                    np.ones(DIM, np.float32), max_turns=max_turns, max_total=max_total, ttl_s=ttl_s))


def _search(s: ShardState, sid: str, k: int = 100, ttl_s: float = 0.0) -> list[MemoryTurn]:
    return s.memory.lookup(MemoryLookupRequest([sid], k, ttl_s)).turns[0]


def test_turn_bound_keeps_the_newest_turns():
    s = ShardState(0, DIM, None)
    for i in range(7):
        _promote(s, "a", f"q{i}", max_turns=3)
    got = _search(s, "a")
    assert [r.question for r in got] == ["q6", "q5", "q4"]  # newest first
    assert [r.turn for r in got] == [6, 5, 4]
    assert [r.question for r in _search(s, "a", k=2)] == ["q6", "q5"]
    assert s.stats().memory_records == 3
    assert all(np.array_equal(r.vector, np.ones(DIM, np.float32)) for r in got)  # the context row reuses them


def test_shard_budget_evicts_least_recently_active_sessions_first():
    s = ShardState(0, DIM, None)
    for sid in ("old", "mid"):
        for i in range(3):
            _promote(s, sid, f"{sid}{i}", max_turns=10, max_total=6)
            time.sleep(0.002)
    _promote(s, "new", "new0", max_turns=10, max_total=6)
    assert s.stats().memory_records == 6
    assert [r.question for r in _search(s, "old")] == ["old2", "old1"]  # its oldest record went
    assert len(_search(s, "mid")) == 3 and len(_search(s, "new")) == 1
    for i in range(1, 6):
        _promote(s, "new", f"new{i}", max_turns=10, max_total=6)
    assert s.stats().memory_records == 6
    assert _search(s, "old") == [] and "old" not in s.memory.sessions  # emptied sessions disappear
    assert len(_search(s, "new")) == 6  # the others went first


def test_a_session_past_the_ttl_starts_again_at_its_own_next_turn():
    """trial53 #1: the expired turns of a session were kept when that same session wrote next (they were never
    looked up again, yet they counted against the budget and filled the snapshot)."""
    s = ShardState(0, DIM, None)
    for i in range(3):
        s.memory._promote(PromoteRequest("solo", f"q{i}", "a", [], [], np.ones(DIM, np.float32), max_turns=5,
                                         ttl_s=10.0), 1000.0 + i)
    s.memory._promote(PromoteRequest("solo", "again", "a", [], [], np.ones(DIM, np.float32), max_turns=5, ttl_s=10.0),
                      1030.0)
    assert len(s.memory) == 1 and [r.question for r in s.memory.sessions["solo"]] == ["again"]
    s.memory._promote(PromoteRequest("solo", "soon", "a", [], [], np.ones(DIM, np.float32), max_turns=5, ttl_s=10.0),
                      1035.0)  # (within the ttl: kept)
    assert [r.question for r in s.memory.sessions["solo"]] == ["again", "soon"]


def test_an_active_session_shows_its_turns_whatever_their_own_age(monkeypatch):
    """trial53b #5: the TTL is the session's idle time (its last turn), for lookups as for expiry; each turn was
    filtered by its own age, so an active session's older turns were hidden yet stored and counted."""
    from oprag_server.shards import memory as mem

    s = ShardState(0, DIM, None)
    for i, t in enumerate((1000.0, 1008.0, 1016.0)):  # each within 10 s of the one before
        s.memory._promote(PromoteRequest("act", f"q{i}", "a", [], [], np.ones(DIM, np.float32), max_turns=5,
                                         ttl_s=10.0), t)
    monkeypatch.setattr(mem.time, "time", lambda: 1020.0)
    assert [r.question for r in _search(s, "act", ttl_s=10.0)] == ["q2", "q1", "q0"]  # q0 is 20 s old
    monkeypatch.setattr(mem.time, "time", lambda: 1027.0)  # idle 11 s: none
    assert _search(s, "act", ttl_s=10.0) == [] and len(s.memory) == 3


def test_the_budget_holds_with_one_session_too():
    """trial53 #2: alone on a shard, a session kept up to its turn bound whatever the budget."""
    s = ShardState(0, DIM, None)
    for i in range(8):
        _promote(s, "only", f"q{i}", max_turns=10, max_total=4)
    assert s.stats().memory_records == 4
    assert [r.question for r in _search(s, "only")] == ["q7", "q6", "q5", "q4"]
    _promote(s, "other", "o0", max_turns=10, max_total=1)  # the new turn always stays
    assert s.stats().memory_records == 1 and len(_search(s, "other")) == 1


def test_idle_sessions_expire():
    s = ShardState(0, DIM, None)
    _promote(s, "idle", "q", max_turns=5)
    _promote(s, "busy", "q", max_turns=5)
    for r in s.memory.sessions["idle"]:
        r.created -= 100.0  # idle for 100 s
    assert _search(s, "idle", ttl_s=50) == []  # invisible once past the time to live
    assert len(_search(s, "idle")) == 1  # (no ttl: still stored)
    _promote(s, "busy", "q2", max_turns=5, ttl_s=50)  # the next write sweeps it away
    assert "idle" not in s.memory.sessions and len(_search(s, "busy", ttl_s=50)) == 2


def test_clear_and_snapshot_round_trip(tmp_path):
    s = ShardState(0, DIM, tmp_path)
    for sid in ("a", "b"):
        for i in range(2):
            _promote(s, sid, f"{sid}{i}", max_turns=5)
    assert s.memory.clear(MemoryClearRequest("a")).removed == 2
    assert _search(s, "a") == []
    s.snapshot()
    t = ShardState(0, DIM, tmp_path)
    t.load()
    assert [r.question for r in _search(t, "b")] == ["b1", "b0"] and _search(t, "a") == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s1", "s2", "s3", "s4"]), st.integers(0, 999)), min_size=1, max_size=40),
       st.integers(1, 5), st.integers(0, 12))
def test_sessions_never_see_each_other(ops, max_turns, max_total):
    s = ShardState(0, DIM, None)
    for sid, n in ops:
        _promote(s, sid, f"{sid}-{n}", max_turns=max_turns, max_total=max_total)
        total = s.stats().memory_records
        assert not max_total or total <= max_total  # (the writer too is trimmed: trial53 #2)
    reply = s.memory.lookup(MemoryLookupRequest(["s1", "s2", "s3", "s4", "nobody"], 100, 0)).turns
    for sid, recs in zip(["s1", "s2", "s3", "s4", "nobody"], reply):
        assert len(recs) <= max_turns
        assert all(r.question.startswith(sid + "-") and r.chunk_ids == [f"{sid}#c"] for r in recs)
    assert reply[-1] == []


def _reference_promote(sessions: dict, sid: str, now: float, max_turns: int, max_total: int, ttl_s: float) -> None:
    """The retention rule as a scan over every session (the code before trial52 #3): the order-kept store must
    keep exactly these records."""
    recs = sessions[sid] = sessions.pop(sid, [])  # (last in the dict: ties of equal times go by activity order)
    if ttl_s and recs and now - recs[-1] > ttl_s:  # (trial53 #1: the writer's own expired turns go too)
        recs.clear()
    recs.append(now)
    del recs[: max(0, len(recs) - max_turns)]
    if ttl_s:
        for s in [s for s, v in sessions.items() if v and now - v[-1] > ttl_s]:
            del sessions[s]
    total = sum(len(v) for v in sessions.values())
    if max_total and total > max_total:
        for s in sorted(sessions, key=lambda k: sessions[k][-1] if sessions[k] else 0):
            if total <= max_total:
                break
            if s == sid:
                continue
            drop = min(len(sessions[s]), total - max_total)
            del sessions[s][:drop]
            total -= drop
            if not sessions[s]:
                del sessions[s]
    if max_total and total > max_total:  # (trial53 #2: then the writer's older turns; its new one stays)
        del recs[:min(len(recs) - 1, total - max_total)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30)), min_size=1, max_size=60),
       st.integers(1, 4), st.integers(0, 10), st.sampled_from([0.0, 5.0, 25.0]))
@example(ops=[(0, 0), (2, 0), (0, 0), (1, 0)], max_turns=1, max_total=2, ttl_s=0.0)  # (CI: equal times, s2 goes)
def test_the_retention_keeps_what_a_scan_of_every_session_keeps(ops, max_turns, max_total, ttl_s):
    s = ShardState(0, DIM, None)
    ref: dict = {}
    now = 1000.0
    for k, dt in ops:  # (time moves forward by dt between turns)
        now += dt
        sid = f"s{k}"
        s.memory._promote(PromoteRequest(sid, "q", "a", [], [], np.ones(DIM, np.float32), max_turns=max_turns,
                                         max_total=max_total, ttl_s=ttl_s), now)
        _reference_promote(ref, sid, now, max_turns, max_total, ttl_s)
        got = {k2: [r.created for r in v] for k2, v in s.memory.sessions.items() if v}
        assert got == {k2: v for k2, v in ref.items() if v}
        assert len(s.memory) == sum(len(v) for v in ref.values()) == s.stats().memory_records


def test_a_turn_costs_the_same_whatever_the_number_of_sessions():
    """trial52 #3: each turn scanned every session for idle expiry and summed every record (4.3 ms a turn at 50K
    sessions), and sorted them all once over the shard budget (90 ms)."""

    def per_turn(n_sessions: int) -> float:
        s = ShardState(0, DIM, None)
        for i in range(n_sessions):
            _promote(s, f"idle{i}", "q", max_turns=4, max_total=n_sessions, ttl_s=3600.0)
        t = time.perf_counter()
        for i in range(300):  # over the budget: every turn evicts the least recently active session
            _promote(s, f"new{i}", "q", max_turns=4, max_total=n_sessions, ttl_s=3600.0)
        assert len(s.memory) == n_sessions
        return (time.perf_counter() - t) / 300

    small, large = per_turn(200), per_turn(40_000)
    assert large < 8 * small + 1e-4, (small, large)  # (the scans made it ~200x)


def test_a_loaded_snapshot_evicts_the_least_recently_active_session_first(tmp_path):
    s = ShardState(0, DIM, tmp_path)
    _promote(s, "first", "q0", max_turns=5)
    time.sleep(0.002)
    _promote(s, "second", "q0", max_turns=5)
    time.sleep(0.002)
    _promote(s, "first", "q1", max_turns=5)  # "first" is now the more recent session
    s.snapshot()
    t = ShardState(0, DIM, tmp_path)
    t.load()
    assert list(t.memory.sessions) == ["second", "first"] and len(t.memory) == 3
    _promote(t, "third", "q0", max_turns=5, max_total=3)
    assert _search(t, "second") == [] and len(_search(t, "first")) == 2


def test_the_snapshot_keeps_the_vectors_in_binary_and_reads_an_older_snapshot_too(tmp_path):
    """trial52 #1: a record's vector as decimal text was ~8.5 KB of its ~9.2 KB in memory.json."""
    import json

    rng = np.random.default_rng(7)
    vecs = {f"s{i}": rng.standard_normal(DIM).astype(np.float32) for i in range(5)}
    s = ShardState(0, DIM, tmp_path)
    for sid, v in vecs.items():
        s.memory.promote(PromoteRequest(sid, "q", "a", [f"{sid}#c"], ["t"], v, max_turns=5))
    s.snapshot()
    shard = tmp_path / "shard-0"
    snap = shard / (shard / "CURRENT").read_text().strip()
    items = json.loads((snap / "memory.json").read_text())
    assert all("vector" not in m for m in items) and np.load(snap / "memory_vectors.npy").shape == (5, DIM)
    t = ShardState(0, DIM, tmp_path)
    t.load()
    for sid, v in vecs.items():
        assert np.array_equal(_search(t, sid)[0].vector, v)  # bit for bit
    t.txns.wal.close()
    # a snapshot from before the binary file: vectors inside memory.json
    items, rows = s.memory.dump()
    old = [{**{k: v for k, v in m.items() if k != "row"}, "vector": rows[m["row"]].tolist()} if "row" in m else m
           for m in items]
    (snap / "memory.json").write_text(json.dumps(old))
    (snap / "memory_vectors.npy").unlink()
    _without_memory_crc(snap)  # (written before the CRCs too)
    u = ShardState(0, DIM, tmp_path)
    u.load()
    assert len(u.memory) == 5 and all(np.array_equal(_search(u, k)[0].vector, v) for k, v in vecs.items())


def _without_memory_crc(snap):
    import json

    from oprag_server.shards.snapshot import meta_crc

    meta = json.loads((snap / "meta.json").read_text())
    meta.pop("memory_crc")
    meta["crc32"] = meta_crc(meta)
    (snap / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["a digit of memory.json", "a vector byte", "no vectors file", "an older snapshot"])
def test_memory_files_that_still_parse_but_were_changed_are_refused_naming_them(tmp_path, damage):
    """trial56b F5: memory.json and memory_vectors.npy had no CRC, so an edit that still parsed (a timestamp's digit, a
    vector row's byte) was served. meta.json now keeps each file's CRC-32; a snapshot without them loads unchecked."""
    import json

    rng = np.random.default_rng(3)
    s = ShardState(0, DIM, tmp_path)
    for i in range(4):
        s.memory.promote(PromoteRequest(f"s{i}", "q", "a", [f"s{i}#c"], ["t"],
                                        rng.standard_normal(DIM).astype(np.float32), max_turns=5))
    s.snapshot()
    shard = tmp_path / "shard-0"
    snap = shard / (shard / "CURRENT").read_text().strip()
    assert set(json.loads((snap / "meta.json").read_text())["memory_crc"]) == {"memory.json", "memory_vectors.npy"}
    mem, vec = snap / "memory.json", snap / "memory_vectors.npy"
    if damage in ("a digit of memory.json", "an older snapshot"):
        text = mem.read_text()
        i = next(i for i, c in enumerate(text) if c.isdigit() and c != "9")
        mem.write_text(text[:i] + str(int(text[i]) + 1) + text[i + 1:])
        json.loads(mem.read_text())  # (it still parses)
        name = "memory.json"
    elif damage == "a vector byte":
        data = bytearray(vec.read_bytes())
        data[-3] ^= 0x10
        vec.write_bytes(bytes(data))
        name = "memory_vectors.npy"
    else:
        vec.unlink()
        name = "memory_vectors.npy"
    if damage == "an older snapshot":
        _without_memory_crc(snap)
        t = ShardState(0, DIM, tmp_path)
        t.load()  # (unchecked, as before)
        assert len(t.memory) == 4
        t.txns.wal.close()
        return
    with pytest.raises(RuntimeError, match=rf"{name}.*(CRC-32|No such file).*restore the snapshot from a backup"):
        ShardState(0, DIM, tmp_path).load()


def test_salvage_memory_starts_a_shard_without_a_damaged_memory_keeping_its_documents(tmp_path, capsys):
    """A damaged memory.json stops the shard's start, and the session memory has no other copy: `oprag salvage-memory`
    keeps the files as .damaged, leaves an empty memory in their place, and the shard starts with its documents and
    the turns its write-ahead log holds after the snapshot."""
    import pyarrow as pa
    from test_snapshot_beside import D, _batch

    from oprag_server.salvage import memory_main

    rng = np.random.default_rng(5)
    s = ShardState(0, D, tmp_path)
    s.load(set())
    s.store.upsert(pa.Table.from_batches([_batch(0, 40)]), 1)
    s.memory.promote(PromoteRequest("s0", "q", "a", ["s0#c"], ["t"], rng.standard_normal(D).astype(np.float32),
                                    max_turns=5))
    s.snapshot()
    s.memory.promote(PromoteRequest("s1", "q", "a", ["s1#c"], ["t"], rng.standard_normal(D).astype(np.float32),
                                    max_turns=5))  # (after the snapshot: in the write-ahead log only)
    s.txns.wal.close()
    shard = tmp_path / "shard-0"
    snap = shard / (shard / "CURRENT").read_text().strip()
    text = (snap / "memory.json").read_text()
    i = text.index('"created": ') + len('"created": ')
    edited = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]  # (a digit of the turn's time: still parses)
    (snap / "memory.json").write_text(edited)
    with pytest.raises(RuntimeError, match=r"run `oprag salvage-memory .*shard-0` to start the shard without it"):
        ShardState(0, D, tmp_path).load(set())
    assert memory_main([str(shard)]) == 0
    out = capsys.readouterr().out
    assert "the session memory could not be read" in out and "memory.json.damaged, memory_vectors.npy.damaged" in out
    assert (snap / "memory.json.damaged").read_text() == edited
    t = ShardState(0, D, tmp_path)
    t.load(set())
    assert len(t.store.fields) == 40 and sorted(t.memory.sessions) == ["s1"]
    t.txns.wal.close()
    assert memory_main([str(shard)]) == 0 and "loads (memory.json); not changed" in capsys.readouterr().out
    assert memory_main([str(tmp_path / "nothing")]) == 2 and "no such directory" in capsys.readouterr().err
