"""Exact mode's compiled BM25 of every chunk (``listed_top.scores_at`` ->
``index/kernels_exact.bm25_at``): ``PostingsIndex.score_all``'s values bit for bit at the given
slots (0.0 elsewhere), on corpora built several ways (Zipf, stop words in most chunks, all
ties), with deletes, replaced chunks in the delta layers, no merge at all, repeated and absent
terms, zero and negative idf; and rank_bm25 0.2.2's ``get_scores`` within 1e-12."""

from __future__ import annotations

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.bm25.postings import PostingsIndex
from test_topm_wide import _index, _stop_words, _ties, _zipf


def _reference(ix, terms, idf, avgdl, k1, b, at):
    s, v = ix.score_all(terms, idf, avgdl, k1, b)
    got = dict(zip(s.tolist(), v.tolist()))
    return np.array([got.get(x, 0.0) for x in at.tolist()], np.float64)


@pytest.mark.parametrize("make,seed,merge_at,deletes,late", [
    (_zipf, 0, 1199, 80, 40), (_stop_words, 1, 1199, 50, 100), (_ties, 2, 1199, 30, 20),
    (_zipf, 3, -1, 40, 30),  # never merged: every posting in the delta layers
    (_stop_words, 4, 600, 0, 0)])  # half in the segment, half in the delta
def test_scores_at_equal_score_all_bit_for_bit(make, seed, merge_at, deletes, late):
    rng = np.random.default_rng(seed)
    docs = make(rng, 1200)
    ix = _index(rng, docs, merge_at, deletes, late)
    for q in range(40):
        terms = [f"t{j}" for j in rng.integers(0, 6 if q % 3 == 0 else 300, int(rng.integers(1, 9)))]
        terms += ["t0", "t1", "nope"][: int(rng.integers(0, 4))]  # repeats and an absent term
        idf = rng.uniform(-0.5, 6.0, len(terms))
        if q % 5 == 0:
            idf[0] = 0.0
        k1, b, avgdl = float(rng.uniform(0.5, 2)), float(rng.uniform(0, 1)), float(rng.uniform(3, 25))
        at = rng.permutation(len(docs))[: int(rng.integers(1, len(docs)))].astype(np.int64)  # live, dead, any order
        got = lt.scores_at(ix, terms, idf, avgdl, k1, b, at)
        ref = _reference(ix, terms, idf, avgdl, k1, b, at)
        assert got.dtype == np.float64 and got.shape == at.shape
        assert got.tobytes() == ref.tobytes(), (seed, q)


def test_scores_at_equal_rank_bm25():
    rng = np.random.default_rng(11)
    corpus = [[f"w{j}" for j in rng.zipf(1.3, int(rng.integers(1, 30))) % 400] for _ in range(500)]
    ref = BM25Okapi(corpus)
    ix = PostingsIndex()
    for s, toks in enumerate(corpus[:300]):
        ix.add(s, toks)
    ix.merge()
    for s, toks in enumerate(corpus[300:], start=300):  # the rest in the delta
        ix.add(s, toks)
    at = np.arange(len(corpus), dtype=np.int64)
    for _ in range(30):
        query = [f"w{j}" for j in rng.zipf(1.3, int(rng.integers(1, 6))) % 400]
        idf = np.array([ref.idf.get(t, 0.0) for t in query])
        got = lt.scores_at(ix, query, idf, ref.avgdl, ref.k1, ref.b, at)
        np.testing.assert_allclose(got, ref.get_scores(query), rtol=1e-12, atol=1e-12)


def test_scores_at_edges():
    ix = PostingsIndex()
    for s, toks in enumerate([["a", "b"], ["b"], ["c", "c"]]):
        ix.add(s, toks)
    at = np.array([2, 0, 1], np.int64)
    assert lt.scores_at(ix, [], np.zeros(0), 2.0, 1.5, 0.75, at).tolist() == [0.0, 0.0, 0.0]
    assert lt.scores_at(ix, ["a"], np.ones(1), 0.0, 1.5, 0.75, at).tolist() == [0.0, 0.0, 0.0]  # avgdl 0: score_all's empty
    assert lt.scores_at(ix, ["a"], np.ones(1), 2.0, 1.5, 0.75, np.zeros(0, np.int64)).size == 0
    with pytest.raises(ValueError):
        lt.scores_at(ix, ["a"], np.ones(2), 2.0, 1.5, 0.75, at)
    with pytest.raises(ValueError):
        lt.scores_at(ix, ["a"], np.ones(1), -1.0, 1.5, 0.75, at)
    ix.remove(0)
    assert lt.scores_at(ix, ["a", "b"], np.ones(2), 2.0, 1.5, 0.75, at)[1] == 0.0  # a deleted chunk: 0.0


@pytest.mark.parametrize("make,seed", [(_zipf, 5), (_stop_words, 6), (_ties, 7)])
def test_listed_top_scored_candidates_equal_score(make, seed, monkeypatch):
    """The dense candidates' BM25 from the top-m pass equals ``PostingsIndex.score`` bit for bit
    (with and without a filter); the pruned paths return None (the caller scores them)."""
    rng = np.random.default_rng(seed)
    docs = make(rng, 900)
    ix = _index(rng, docs, 899, 60, 50)
    live = np.array([s for s in range(len(docs)) if ix.has_slot(s)], np.int64)
    for q in range(30):
        terms = [f"t{j}" for j in rng.integers(0, 300, int(rng.integers(1, 7)))] + ["t0"] * (q % 2)
        idf = rng.uniform(0.0, 6.0, len(terms))
        k1, b, avgdl, m = float(rng.uniform(0.5, 2)), float(rng.uniform(0, 1)), float(rng.uniform(3, 25)), int(rng.integers(1, 60))
        cand = rng.permutation(live)[: int(rng.integers(0, 300))]
        allowed = np.sort(rng.choice(live, 400, replace=False)) if q % 3 == 0 else None
        s, sc, listed, at = lt.listed_top_scored(ix, terms, idf, avgdl, k1, b, m, allowed, cand)
        assert (s.tobytes(), sc.tobytes(), listed) == tuple(
            (x.tobytes() if hasattr(x, "tobytes") else x) for x in lt.listed_top(ix, terms, idf, avgdl, k1, b, m, allowed))
        assert at.tobytes() == ix.score(cand, terms, idf, avgdl, k1, b).tobytes(), (seed, q)
    calls = []
    assert lt.listed_top_scored(ix, ["t0"], np.ones(1), 8.0, 1.5, 0.75, 5, None, live[:3], lambda: calls.append(1))[3] \
        is not None and not calls  # the full pass: its own scores, the fallback not called
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)  # the pruned paths: no candidate scores of their own
    assert lt.listed_top_scored(ix, ["t0", "t1"], np.ones(2), 8.0, 1.5, 0.75, 5, None, live[:3])[3] is None
    order = []
    real = lt._pruned
    monkeypatch.setattr(lt, "_pruned", lambda *a: order.append("pass") or real(*a))
    got = lt.listed_top_scored(ix, ["t0", "t1"], np.ones(2), 8.0, 1.5, 0.75, 5, None, live[:3],
                               lambda: order.append("score") or np.arange(3.0))
    assert got[3].tolist() == [0.0, 1.0, 2.0] and order == ["score", "pass"]  # scored while their postings are warm
