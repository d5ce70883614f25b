"""One BM25 merge build at a time across the shards of one data directory (index/bm25/merge_gate.py,
issue 13: two 1M-chunk shards' merges at once made the tree's memory peak). Real indexes, a real
``flock`` held by another process; scores are checked against rank_bm25 0.2.2 (``check`` of
test_bm25_segments: every expected score comes from ``get_scores``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from oprag_server.index import bm25 as B
from oprag_server.index.bm25 import merging
from oprag_server.index.bm25.merge_gate import LOCK_NAME, MergeGate
from oprag_server.shards.state import ShardState

from test_bm25_idle_merge import _upsert
from test_bm25_segments import check

D = 8


@pytest.fixture
def held_build(monkeypatch):
    """``(go, started, arm)``: after ``arm()`` every build's segment merge sets ``started`` and
    waits for ``go`` (a merge under way, held)."""
    go, started = threading.Event(), threading.Event()
    real = merging.merge

    def slow(*a, **k):
        started.set()
        assert go.wait(30)
        return real(*a, **k)
    return go, started, lambda: monkeypatch.setattr(merging, "merge", slow)


def _index(gate: MergeGate, lo: int, n: int) -> tuple[B.PostingsIndex, dict]:
    ix, live = B.PostingsIndex(), {}
    ix.gate = gate
    for s in range(lo, lo + n):
        live[s] = ([f"w{s}", "common"], 0)
    ix.add_batch(list(live), [t for t, _ in live.values()])
    return ix, live


def test_a_second_shards_background_merge_waits_for_the_first(tmp_path, held_build, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    go, started, arm = held_build
    gate = MergeGate.at(tmp_path)
    assert MergeGate.at(tmp_path / ".") is gate  # one gate per directory in a process (thread shards)
    a, live_a = _index(gate, 0, 40)
    b, live_b = _index(gate, 100, 40)
    arm()
    assert a.maybe_merge(background=True) and started.wait(10)
    assert not b.maybe_merge(background=True) and not b.merging  # refused: a's build holds the gate
    assert b.gate_retry_at > time.monotonic()
    assert not b.maybe_merge(background=True)  # before the retry time: not even tried
    go.set()
    a.wait_merge()
    b.gate_retry_at = 0.0
    assert b.maybe_merge(background=True)
    b.wait_merge()
    assert a.segment.n_postings == b.segment.n_postings == 80
    check([a], live_a, ["common", "w3"])
    check([b], live_b, ["common", "w103"])


def test_a_foreground_merge_waits_for_the_build_under_way(tmp_path, held_build, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    go, started, arm = held_build
    gate = MergeGate.at(tmp_path)
    a, _ = _index(gate, 0, 40)
    b, live_b = _index(gate, 100, 40)
    arm()
    a.merge(background=True)
    assert started.wait(10)
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.merge(), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.5)  # (a snapshot's merge: it waits, it is not skipped)
    go.set()
    assert done.wait(20)
    a.wait_merge()
    assert b.segment.n_postings == 80 and gate.acquire(blocking=False)  # released by both
    gate.release()
    check([b], live_b, ["common", "w100"])


def test_a_failed_build_releases_the_gate(tmp_path, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)

    def boom(*a, **k):
        raise MemoryError("test")
    monkeypatch.setattr(merging, "merge", boom)
    gate = MergeGate.at(tmp_path)
    a, live = _index(gate, 0, 40)
    with pytest.raises(MemoryError):
        a.merge()
    assert gate.acquire(blocking=False)
    gate.release()
    monkeypatch.undo()
    a.merge()
    check([a], live, ["common", "w7"])


def test_another_process_holds_the_gate_until_it_dies(tmp_path):
    code = ("import sys, time; from pathlib import Path; from oprag_server.index.bm25.merge_gate import MergeGate;"
            "g = MergeGate.at(Path(sys.argv[1])); assert g.acquire(True); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout.readline().strip() == "held"
        gate = MergeGate.at(tmp_path)
        assert (tmp_path / LOCK_NAME).exists() and not gate.acquire(blocking=False)
        child.send_signal(signal.SIGKILL)  # the kernel releases a dead process's flock
        child.wait(10)
        assert gate.acquire(blocking=False)
        gate.release()
    finally:
        child.kill()
        child.wait()


def test_shards_on_one_data_dir_share_the_gate_and_back_off(tmp_path, held_build, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.0)
    go, started, arm = held_build
    s0, s1 = ShardState(0, D, tmp_path), ShardState(1, D, tmp_path)
    assert s0.merge_gate is s1.merge_gate is s0.store.postings.gate
    assert ShardState(0, D, None).store.postings.gate is None  # memory only: no coordination
    for st in (s0, s1):
        _upsert(st, 0, 100, 1)
        st.store.postings.merge()
        _upsert(st, 100, 110, 2)  # an idle merge is due (30 postings over 300 // 64)
    arm()
    assert s0.idle_wait() == 0.0
    s0.idle_step()
    assert started.wait(10) and s0.store.postings.merging
    assert s1.idle_wait() == 0.0
    s1.idle_step()  # refused: no merge started, the next try in GATE_RETRY_S, not at once (no busy loop)
    assert not s1.store.postings.merging and 0.3 < s1.idle_wait() <= B.PostingsIndex.GATE_RETRY_S
    assert s1.stats().merge_pending == 30  # still due
    go.set()
    s0.store.postings.wait_merge()
    time.sleep(B.PostingsIndex.GATE_RETRY_S)
    assert s1.idle_wait() == 0.0
    s1.idle_step()
    s1.store.postings.wait_merge()
    assert s0.stats().merge_pending == s1.stats().merge_pending == 0
    s0.snapshot()
    restarted = ShardState(0, D, tmp_path)
    first = restarted.store.postings
    restarted.load()  # the snapshot's postings replace the first index: the new one keeps the gate
    assert restarted.store.postings is not first and restarted.store.postings.gate is restarted.merge_gate
