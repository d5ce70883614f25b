"""A background merge moves its new segment out of anonymous memory before it gives the merge
gate back (index/bm25/segment.py ``Segment.spill``, issue 13: each 1M-chunk shard's merged
segment, ~700 MB, stayed resident through the next shard's merge, the process tree's peak).
Real indexes and files; scores are checked against rank_bm25 0.2.2 (``check`` of
test_bm25_segments: every expected score comes from ``get_scores``)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from oprag_server.index import bm25 as B
from oprag_server.index.bm25.merge_gate import SPILL_NAME, MergeGate, sweep_spills
from oprag_server.index.bm25.segment import Segment
from oprag_server.shards.state import ShardState

from test_bm25_idle_merge import _upsert
from test_bm25_segments import check

D = 8


def _index(gate: MergeGate | None, lo: int, n: int) -> tuple[B.PostingsIndex, dict]:
    ix, live = B.PostingsIndex(), {}
    ix.gate = gate
    for s in range(lo, lo + n):
        live[s] = ([f"w{s}", "common", f"t{s % 7}"] + ["rep"] * (s % 3), 0)
    ix.add_batch(list(live), [t for t, _ in live.values()])
    return ix, live


def _spills(root) -> list[str]:
    d = root / SPILL_NAME
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def _eventually(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def spill_all(monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    monkeypatch.setattr(B.PostingsIndex, "SPILL_MIN_BYTES", 0)


def test_a_background_merge_serves_its_new_segment_from_a_file(tmp_path, spill_all):
    gate = MergeGate.at(tmp_path)
    ix, live = _index(gate, 0, 60)
    assert ix.segment.unmapped_nbytes() == 0 or ix.segment.n_postings == 0  # (all in the delta so far)
    ix.merge(background=True)
    ix.wait_merge()
    seg = ix.segment
    assert seg.n_postings > 0 and seg.unmapped_nbytes() == 0 and ix.spills == 1
    [first] = _spills(tmp_path)
    assert first.startswith(f"{os.getpid()}-")
    assert gate.acquire(blocking=False)  # (given back after the spill)
    gate.release()
    check([ix], live, ["common", "w3", "rep", "t2"])
    # more writes, a removal and a replace, then the next merge: its segment spills to a new
    # directory and the previous one goes with the segment it held
    more, _ = {}, None
    for s in range(60, 90):
        more[s] = ([f"w{s}", "common", "late"], 0)
    ix.add_batch(list(more), [t for t, _ in more.values()])
    live.update(more)
    ix.remove(5)
    del live[5]
    ix.remove(7)
    ix.add_batch([7], [["w7", "replaced", "common"]])
    live[7] = (["w7", "replaced", "common"], 0)
    ix.merge(background=True)
    ix.wait_merge()
    assert ix.segment.unmapped_nbytes() == 0 and ix.spills == 2
    del seg
    assert _eventually(lambda: first not in _spills(tmp_path) and len(_spills(tmp_path)) == 1), _spills(tmp_path)
    check([ix], live, ["common", "late", "replaced", "w5", "w7", "rep"])


def test_a_small_segment_or_a_foreground_merge_stays_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    gate = MergeGate.at(tmp_path)
    ix, live = _index(gate, 0, 60)
    ix.merge(background=True)  # below SPILL_MIN_BYTES (64 MB)
    ix.wait_merge()
    assert ix.spills == 0 and ix.segment.unmapped_nbytes() > 0
    monkeypatch.setattr(B.PostingsIndex, "SPILL_MIN_BYTES", 0)
    ix.add_batch([100], [["w100", "common"]])
    live[100] = (["w100", "common"], 0)
    ix.merge()  # a foreground merge (a snapshot's): the snapshot writes the segment next
    assert ix.spills == 0 and ix.segment.unmapped_nbytes() > 0 and _spills(tmp_path) == []
    nogate, live2 = _index(None, 0, 30)  # a memory-only shard has no gate and no directory
    nogate.merge(background=True)
    nogate.wait_merge()
    assert nogate.spills == 0 and nogate.segment.unmapped_nbytes() > 0
    check([ix], live, ["common", "w100", "rep"])
    check([nogate], live2, ["common", "w1"])


def test_a_spill_that_cannot_write_keeps_the_segment_in_memory(tmp_path, spill_all, monkeypatch):
    def full(self, d, parked=()):
        d.mkdir(parents=True, exist_ok=True)
        (d / "offsets.npy").write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Segment, "save", full)
    gate = MergeGate.at(tmp_path)
    ix, live = _index(gate, 0, 50)
    ix.merge(background=True)
    ix.wait_merge()
    assert ix.spills == 0 and ix.segment.unmapped_nbytes() > 0 and ix.last_merge_error is None
    assert _spills(tmp_path) == []  # the partial directory is removed
    assert gate.acquire(blocking=False)
    gate.release()
    check([ix], live, ["common", "w9", "t3"])


def test_a_snapshot_serves_its_own_copy_and_the_spill_goes(tmp_path, spill_all, monkeypatch, capsys):
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.0)
    st = ShardState(0, D, tmp_path)
    toks = _upsert(st, 0, 80, 1)
    st.store.postings.merge()
    toks.update(_upsert(st, 80, 100, 2))
    p = st.store.postings
    if not p.merging:  # (the write-time rule may have started it already: a background merge too)
        assert st.idle_wait() == 0.0
        st.idle_step()  # the idle merge
    assert p.merging
    p.wait_merge()
    st.note()
    assert "served from a file map (.bm25-spill)" in capsys.readouterr().err.splitlines()[-1]  # the shard's log
    assert p.spills >= 1 and p.unsaved_nbytes() == 0 and p.segment.unmapped_nbytes() == 0
    assert _eventually(lambda: len(_spills(tmp_path)) == 1), _spills(tmp_path)  # (an earlier one's gone)
    before = p.score_all(["topic1", "chunk3"], *_stats(p, ["topic1", "chunk3"]))
    st.snapshot()  # maps the snapshot's files: the spill's are not served any more
    assert _eventually(lambda: _spills(tmp_path) == []), _spills(tmp_path)
    after = p.score_all(["topic1", "chunk3"], *_stats(p, ["topic1", "chunk3"]))
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    restarted = ShardState(0, D, tmp_path)
    restarted.load()
    again = restarted.store.postings.score_all(["topic1", "chunk3"], *_stats(p, ["topic1", "chunk3"]))
    np.testing.assert_array_equal(before[1], again[1])
    check([restarted.store.postings], {s: (t, 0) for s, t in toks.items()}, ["topic1", "chunk3", "the"])


def _stats(p, q):
    s = B.CorpusStats.merge_full([p.full_stats()])
    return s.query_idf(q, 0.25), s.avgdl, 1.5, 0.75


def test_a_starting_shard_sweeps_dead_processes_spill_directories(tmp_path):
    root = tmp_path / SPILL_NAME
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for name in (f"{dead.pid}-0", f"{dead.pid}-3", f"{alive.pid}-1", f"{os.getpid()}-99", "notapid"):
            (root / name).mkdir(parents=True)
            (root / name / "slots.npy").write_bytes(b"x")
        gate = ShardState(0, D, tmp_path).merge_gate  # (a shard's start creates its gate)
        assert sorted(p.name for p in root.iterdir()) == sorted([f"{alive.pid}-1", f"{os.getpid()}-99", "notapid"])
        d = gate.spill_dir()
        assert d.parent == root and d.name.startswith(f"{os.getpid()}-") and not d.exists()
        assert gate.spill_dir() != d  # one name per segment
        assert sweep_spills(root) == 0
    finally:
        alive.kill()
        alive.wait()
    assert sweep_spills(root) == 1 and not (root / f"{alive.pid}-1").exists()
