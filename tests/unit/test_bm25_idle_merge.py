"""The idle BM25 merge (issue 13, settle11): a shard whose writes have gone quiet folds a delta of
1/IDLE_DIV (64) of its segment in the background, below the write-time rule's 1/MERGE_DIV, and Stats
report it as ``merge_pending`` until it is installed. Scores are checked against rank_bm25 0.2.2
(the ``check`` helper of test_bm25_segments: every expected score comes from ``get_scores``)."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pyarrow as pa

from oprag_server import records
from oprag_server.index import bm25 as B
from oprag_server.shards.state import ShardState

from test_bm25_segments import check

D = 8


def test_idle_merge_due_at_a_sixty_fourth_of_the_segment(monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    assert B.PostingsIndex.IDLE_DIV == 64 and B.PostingsIndex.MERGE_DIV == 4
    ix, live = B.PostingsIndex(), {}
    for s in range(320):
        live[s] = ([f"w{s}", "common"], 0)
    ix.add_batch(list(live), [t for t, _ in live.values()])
    ix.merge()
    assert ix.segment.n_postings == 640 and not ix.idle_merge_due() and ix.merge_pending() == 0
    for s in range(320, 324):  # 8 postings: under 640 // 64 = 10
        live[s] = ([f"w{s}", "common"], 0)
        ix.add(s, live[s][0])
    # under 1/64: not due after IDLE_QUIET_S, only after IDLE_SMALL_QUIET_S (at MERGE_MIN: 4 here), and pending
    assert not ix.idle_merge_due() and ix.idle_merge_due(small=True) and ix.merge_pending() == 8
    live[324] = (["w324", "common"], 0)
    ix.add(324, live[324][0])  # 10 postings: an idle merge is due, the write-time rule (160) is not
    assert ix.idle_merge_due() and ix.merge_pending() == 10 and not ix.maybe_merge()
    ix.merge(background=True)
    assert ix.merge_pending() > 0 and not ix.idle_merge_due()
    ix.wait_merge()
    assert ix.merge_pending() == 0 and ix.segment.n_postings == 650
    check([ix], live, ["common", "w3", "w324"])
    merges = ix.merges
    ix.merge()  # nothing to fold: the segment is not rebuilt
    assert ix.merges == merges
    check([ix], live, ["common", "w324"])
    ix.remove(324)  # a dead posting: merge() rebuilds
    del live[324]
    ix.merge()
    assert ix.merges == merges + 1 and ix.segment.n_postings == 648
    check([ix], live, ["common", "w324", "w0"])


def _upsert(st: ShardState, lo: int, hi: int, seq: int) -> dict[int, list[str]]:
    texts = [f"chunk{i} topic{i % 5} the" for i in range(lo, hi)]
    V = np.ones((hi - lo, D), np.float32) / np.sqrt(D)
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(lo, hi)], doc_ids=[f"d{i}" for i in range(lo, hi)],
        titles=[""] * (hi - lo), texts=texts, metadata=[{}] * (hi - lo), ordinals=[0] * (hi - lo),
        generations=[1] * (hi - lo), content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=V)]), seq)
    return {i: st.store.analyzer.tokens(t) for i, t in zip(range(lo, hi), texts)}


def test_a_quiet_shard_merges_its_delta_in_the_background(monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.2)
    st = ShardState(0, D, None)
    toks = _upsert(st, 0, 100, 1)
    st.store.postings.merge()
    assert st.idle_wait() is None and st.stats().merge_pending == 0
    toks.update(_upsert(st, 100, 110, 2))  # 30 postings: over 300 // 64, under 300 // 4
    p = st.store.postings
    assert not p.merging and st.stats().merge_pending == 30
    assert 0.1 < st.idle_wait() <= 0.2 + 1e-9  # (t + 0.2 - t: 0.20000000000004547 for a large monotonic t)
    time.sleep(0.12)
    toks.update(_upsert(st, 110, 111, 3))  # a write: the quiet time starts again
    assert st.idle_wait() > 0.15
    st.idle_step()
    assert not p.merging
    time.sleep(0.21)
    st.txns.prepared["t"] = {}  # a prepared transaction waits for its apply: no merge starts (nor a busy loop)
    assert st.idle_wait() is None
    st.idle_step()
    assert not p.merging
    st.txns.prepared.clear()
    st.idle_step()
    assert p.merging and st.stats().merge_pending > 0
    toks.update(_upsert(st, 111, 113, 4))  # a write during the merge goes to the new delta
    st.store.delete(["d5", "d112"], 5)  # a segment chunk and a delta chunk, during the merge
    del toks[5], toks[112]
    deadline = time.monotonic() + 10
    while p.merging and time.monotonic() < deadline:
        if st.idle_wait() == 0.0:
            st.idle_step()
        time.sleep(0.01)
    assert not p.merging and p.merges == 2 and st.stats().merge_pending == 0 and st.idle_wait() is None
    live = {s: (t, 0) for s, t in toks.items()}
    for q in (["the", "topic3"], ["chunk105", "chunk112", "topic1"], ["chunk5", "topic0"]):
        check([p], live, q)


def test_the_idle_merge_waits_for_the_hnsw_catch_up(monkeypatch):
    from oprag_server.config import DenseConfig

    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.0)
    st = ShardState(0, D, None, dense=DenseConfig(kind="hnsw", hnsw_m=8))
    _upsert(st, 0, 100, 1)
    st.store.postings.merge()
    _upsert(st, 100, 110, 2)  # deferred HNSW inserts and an idle merge due
    assert st.store.dense.pending and st.store.postings.idle_merge_due()
    assert st.idle_wait() is None and st.stats().merge_pending == 30
    while st.background_step():
        pass
    assert st.idle_wait() == 0.0
    st.idle_step()
    st.store.postings.wait_merge()
    assert st.stats().merge_pending == 0


def test_a_delta_under_a_sixty_fourth_merges_after_the_longer_quiet_time(monkeypatch):
    """A snapshot no longer merges a small delta (``bm25.delta_files``), so a quiet shard folds one of at least
    MERGE_MIN postings after ``IDLE_SMALL_QUIET_S`` (a 1/64 one after ``IDLE_QUIET_S``, as before): reads return to
    one segment once writes stop, and a trickle of writes does not rebuild the segment at every pause."""
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.05)
    monkeypatch.setattr(ShardState, "IDLE_SMALL_QUIET_S", 0.4)
    st = ShardState(0, D, None)
    toks = _upsert(st, 0, 200, 1)
    st.store.postings.merge()
    p = st.store.postings
    toks.update(_upsert(st, 200, 202, 2))  # 6 postings: under 600 // 64, at least MERGE_MIN
    assert not p.idle_merge_due() and p.idle_merge_due(small=True) and st.stats().merge_pending == 6
    assert 0.3 < st.idle_wait() <= 0.4 + 1e-9  # (not after IDLE_QUIET_S)
    time.sleep(0.1)
    st.idle_step()
    assert not p.merging
    time.sleep(0.35)
    assert st.idle_wait() == 0.0
    st.idle_step()
    assert p.merging
    p.wait_merge()
    assert p.merges == 2 and p._delta.n == 0 and st.stats().merge_pending == 0 and st.idle_wait() is None
    live = {s: (t, 0) for s, t in toks.items()}
    for q in (["the", "topic3"], ["chunk201", "topic1"]):
        check([p], live, q)
    _upsert(st, 202, 203, 3)  # 3 postings: under MERGE_MIN, never merged while quiet
    assert not p.idle_merge_due(small=True) and st.idle_wait() is None and st.stats().merge_pending == 0
