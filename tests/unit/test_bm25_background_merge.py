"""BM25 postings: batched adds and the background merge (built in a thread from an immutable
view while the index keeps serving and taking writes) -- against rank_bm25 0.2.2 through the
``check`` helper of test_bm25_segments (every expected score comes from ``get_scores``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oprag_server.index import bm25 as B
from oprag_server.index.bm25 import merging

from test_bm25_segments import CORPUS, check

QUERIES = [["cat", "the", "sat"], ["dog", "pets", "pets"], ["log", "mat", "zzz"], ["bm25", "a"]]


@pytest.fixture
def gate(monkeypatch):
    """The merge thread waits until the test sets the returned event."""
    ev = threading.Event()
    real = merging.merge

    def gated(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            assert ev.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(merging, "merge", gated)
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    return ev


def _check_all(shards, live):
    for q in QUERIES:
        check(shards, live, q)


def test_background_merge_concurrent_with_queries_and_writes(gate):
    shards = [B.PostingsIndex(), B.PostingsIndex()]
    live = {}
    for s, toks in enumerate(CORPUS):
        live[s] = (toks, s % 2)
    for k in (0, 1):
        mine = [s for s in live if live[s][1] == k]
        shards[k].add_batch(mine, [live[s][0] for s in mine])
    shards[0].merge()  # shard 0: slots 0, 2, 4 in the segment
    shards[0].add_batch([10, 12], [["cat", "cat", "dog"], ["pets", "log"]])
    live.update({10: (["cat", "cat", "dog"], 0), 12: (["pets", "log"], 0)})
    synced = B.CorpusStats.merge_full(sh.full_stats() for sh in shards)
    for sh in shards:
        sh.drain_delta()
    assert shards[0].maybe_merge(background=True) and shards[0].merging
    thread = shards[0]._pending[0]
    assert thread.is_alive()  # held at the gate: everything below runs during the merge
    _check_all(shards, live)
    shards[0].remove(0)  # a segment chunk
    shards[0].remove(10)  # a chunk of the frozen delta
    del live[0], live[10]
    shards[0].add_batch([10, 20], [["mat", "mat"], ["cat", "new"]])  # slot 10 again, and a new one
    live.update({10: (["mat", "mat"], 0), 20: (["cat", "new"], 0)})
    shards[1].remove(1)
    del live[1]
    assert not shards[0].maybe_merge(background=True)  # one merge at a time
    _check_all(shards, live)
    gate.set()
    thread.join()
    _check_all(shards, live)  # finished but not installed yet
    assert shards[0].poll_merge() and not shards[0].merging
    assert shards[0].merges == 2
    _check_all(shards, live)
    seg = shards[0].segment
    # built from the view at the start: slot 0 and slot 10's first version are dead in it
    assert seg.doc_slots.tolist() == [0, 2, 4, 10, 12] and shards[0]._seg_dead == 5 + 2
    assert shards[0].df("mat") == 1 and shards[0].df("dog") == 0 and shards[0].df("new") == 1
    for sh in shards:
        synced.apply_delta(*sh.drain_delta())
    assert synced == B.CorpusStats.merge_full(sh.full_stats() for sh in shards)
    shards[0].merge()
    _check_all(shards, live)
    assert shards[0].segment.doc_slots.tolist() == [2, 4, 10, 12, 20]


def test_failed_background_merge_keeps_serving(monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)

    def broken(*a, **k):
        raise MemoryError("no room")

    ix = B.PostingsIndex()
    live = {s: (t, 0) for s, t in enumerate(CORPUS)}
    ix.add_batch(list(live), CORPUS)
    ix.merge()
    ix.add_batch([7, 8], [["cat", "dog", "pets"], ["log", "log"]])
    live.update({7: (["cat", "dog", "pets"], 0), 8: (["log", "log"], 0)})
    monkeypatch.setattr(merging, "merge", broken)
    ix.MERGE_MIN, ix.MERGE_DIV = 1, 8  # (the 4-posting delta is an eighth of this segment, not a quarter)
    assert ix.maybe_merge(background=True)
    ix._pending[0].join()
    with pytest.raises(MemoryError):
        ix.poll_merge()
    assert not ix.merging
    _check_all([ix], live)
    ix.add_batch([9], [["cat", "mat"]])
    live[9] = (["cat", "mat"], 0)
    assert ix.maybe_merge(background=True)  # fails again: kept, not raised, serving goes on
    ix._pending[0].join()
    assert not ix.poll_merge(raise_errors=False) and not ix.merging
    assert isinstance(ix.last_merge_error, MemoryError)
    _check_all([ix], live)
    monkeypatch.undo()
    ix.merge()
    _check_all([ix], live)


def test_add_batch_rejects_bad_input_and_stores_nothing():
    ix = B.PostingsIndex()
    ix.add_batch([3], [["a"]])
    for slots, toks, exc in (([4, 4], [["a"], ["b"]], ValueError), ([5, 3], [["a"], ["b"]], ValueError),
                             ([6], [["a"], ["b"]], ValueError), ([-1], [["a"]], ValueError),
                             ([2**31], [["a"]], ValueError), (["x"], [["a"]], TypeError)):
        with pytest.raises(exc):
            ix.add_batch(slots, toks)
        assert len(ix) == 1 and ix.full_stats() == (1, 1, {"a": 1})
    ix.add_batch([], [])
    assert len(ix) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=1, max_size=4),
              st.lists(st.lists(st.sampled_from("a b c d e f".split()), max_size=5), min_size=4, max_size=4)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
    st.tuples(st.just("bg"), st.booleans()),
    st.tuples(st.just("poll"), st.booleans()),
), max_size=30))
def test_property_background_merges_match_rank_bm25(ops):
    """Random batched adds, removes (slot reuse included), background merges (a real thread:
    polled, waited for, or left running) and queries: always rank_bm25's scores."""
    ix = B.PostingsIndex()
    ix.MERGE_MIN = 1
    live: dict[int, tuple[list[str], int]] = {}
    for op in ops:
        if op[0] == "add":
            slots = [s for s in dict.fromkeys(op[1]) if s not in live]
            toks = [op[2][i % 4] for i in range(len(slots))]
            ix.add_batch(slots, toks)
            live.update({s: (t, 0) for s, t in zip(slots, toks)})
        elif op[0] == "remove":
            if op[1] in live:
                ix.remove(op[1])
                del live[op[1]]
        elif op[0] == "bg":
            ix.maybe_merge(background=True)
            if op[1]:
                check([ix], live, ["a", "b", "c"])
        else:
            ix.wait_merge() if op[1] else ix.poll_merge()
        check([ix], live, ["a", "c", "f", "a"])
    ix.wait_merge()
    check([ix], live, ["b", "d", "e"])
    assert ix.full_stats()[0] == len(live)
    ix.merge()
    check([ix], live, ["a", "b", "c", "d", "e", "f"])
    assert sorted(ix.segment.doc_slots.tolist()) == sorted(live)


def test_apply_delta_fast_path_for_additions_matches_the_checked_path():
    base = {"a": 2, "b": 1}
    fast, slow = B.CorpusStats(3, 10, dict(base)), B.CorpusStats(3, 10, dict(base))
    fast.apply_delta(2, 5, {"a": 1, "c": 2})  # additions only: the C-level update
    slow.apply_delta(2, 5, {"a": 1, "c": 2, "zz": 0})  # a zero entry: the checked loop
    assert fast == slow and fast.df == {"a": 3, "b": 1, "c": 2} and fast.version == 1
    with pytest.raises(ValueError):
        fast.apply_delta(0, 0, {"b": -2, "a": 1})  # negative: checked, nothing changed
    assert fast.df == {"a": 3, "b": 1, "c": 2} and fast.version == 1
