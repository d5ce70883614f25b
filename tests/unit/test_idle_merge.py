"""The idle merge: a shard that took no write for ``ShardState.IDLE_MERGE_S`` folds the BM25
delta its last writes left into the segment in a background thread
(``PostingsIndex.idle_merge``, driven by ``ShardState.idle_step`` from the worker loop), so
queries after an ingest read the compact segment as after a restart. Scores are checked
against rank_bm25 0.2.2 (``check`` of test_bm25_segments) before, during and after."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.index import bm25 as B
from oprag_server.index.analyzer import Analyzer
from oprag_server.shards import state as state_mod
from oprag_server.shards.state import ShardState

from test_bm25_segments import check

D = 8
WORDS = "cat dog mat sat log the a pets bm25 quick brown fox jumps over lazy river stone".split()


def _texts(lo: int, hi: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(1, 12)))) for _ in range(lo, hi)]


def _upsert(st: ShardState, lo: int, hi: int, seq: int, texts: list[str]) -> None:
    rng = np.random.default_rng(seq)
    v = rng.standard_normal((hi - lo, D)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(lo, hi)], doc_ids=[f"d{i}" for i in range(lo, hi)],
        titles=[""] * (hi - lo), texts=texts, metadata=[{}] * (hi - lo), ordinals=[0] * (hi - lo),
        generations=[1] * (hi - lo), content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=v)]), seq)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(state_mod, "time", c)
    monkeypatch.setattr(B.PostingsIndex, "IDLE_MERGE_MIN", 16)
    return c


def _live(st: ShardState, texts: dict[str, str]) -> dict[int, tuple[list[str], int]]:
    an = Analyzer()
    ids = st.store._slot_ids  # noqa: SLF001
    return {s: (an.tokens(texts[ids[s]]), 0) for s in range(st.store.next_slot) if ids[s] in texts}


def _scores(p, q):
    stats = B.CorpusStats.merge_full([p.full_stats()])
    s, v = p.score_all(q, stats.query_idf(q, 0.25), stats.avgdl, 1.5, 0.75)
    return s.tolist(), v.tolist()


QUERIES = [["cat", "the"], ["fox", "river", "river"], ["bm25", "zzz"], ["a"]]


def test_an_idle_shard_merges_its_delta_after_the_quiet_period(clock):
    st = ShardState(0, D, None)
    first, second = _texts(0, 200, 1), _texts(200, 260, 2)
    texts = {f"d{i}#0": t for i, t in enumerate(first + second)}
    _upsert(st, 0, 200, 1, first)
    p = st.store.postings
    p.merge()  # the first 200 chunks in the segment (as a restart leaves them)
    assert st.idle_step() is None  # nothing in the delta: nothing to do, ever
    _upsert(st, 200, 260, 2, second)
    assert p._delta.n >= 16 and p.idle_merge_due()  # noqa: SLF001
    merges = p.merges
    left = st.idle_step()  # the write just happened: wait the quiet period out
    assert left == pytest.approx(st.IDLE_MERGE_S) and not p.merging
    clock.t += st.IDLE_MERGE_S / 2
    _upsert(st, 260, 261, 3, ["quick fox"])  # another write: the quiet period starts again
    texts["d260#0"] = "quick fox"
    assert st.idle_step() == pytest.approx(st.IDLE_MERGE_S) and not p.merging
    before = {tuple(q): _scores(p, q) for q in QUERIES}  # from the delta, after the last write
    clock.t += st.IDLE_MERGE_S
    assert st.idle_step() == st.MERGE_POLL_S and p.merging  # started in the background
    for q in QUERIES:  # served from the frozen delta meanwhile: rank_bm25's scores
        check([p], _live(st, texts), q)
    p._pending[0].join()  # noqa: SLF001
    assert st.idle_step() is None and not p.merging and p.merges == merges + 1  # installed
    assert p._delta.n == 0 and p._frozen is None  # noqa: SLF001
    for q in QUERIES:
        check([p], _live(st, texts), q)
        assert _scores(p, q) == before[tuple(q)]


def test_a_small_delta_is_left_to_the_write_path(clock, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "IDLE_MERGE_MIN", 10_000)
    st = ShardState(0, D, None)
    _upsert(st, 0, 100, 1, _texts(0, 100, 3))
    clock.t += 10 * st.IDLE_MERGE_S
    assert st.idle_step() is None and not st.store.postings.merging
    assert not st.store.postings.idle_merge()


def test_dead_postings_alone_trigger_it(clock):
    st = ShardState(0, D, None)
    texts = _texts(0, 120, 4)
    _upsert(st, 0, 120, 1, texts)
    p = st.store.postings
    p.merge()
    assert not p.idle_merge_due()
    st.store.delete([f"d{i}" for i in range(0, 120, 2)], 2)  # half the segment's chunks
    assert p._seg_dead >= 16 and p._delta.n == 0 and p.idle_merge_due()  # noqa: SLF001
    st.idle_step()
    clock.t += st.IDLE_MERGE_S
    st.idle_step()
    assert p.merging
    p.wait_merge()
    assert p._seg_dead == 0  # noqa: SLF001
    live = {f"d{i}#0": t for i, t in enumerate(texts) if i % 2}
    for q in QUERIES:
        check([p], _live(st, live), q)
