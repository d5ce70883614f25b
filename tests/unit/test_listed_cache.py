"""The widening-round cache of a shard's BM25 top-m (index/bm25/listed_cache.py,
index/kernels_wide_keep.py): a round-1 call on the wide path keeps what its pass left, and a
later call for the same query with a larger m (a dense-first widening round, 4m, 16m) is
answered from it. Checked on many random small corpora: element for element the uncached
path's result (``kernels_wide.bm25_top_wide``), the numpy reference's top-m
(``listed_top_reference``: ``PostingsIndex.score_all``) and rank_bm25's scores; that the
widening rounds did come from the kept entry (block rescan) on most queries; and that no
write (apply, delete, a merge's start or install) lets a kept list be served."""

from __future__ import annotations

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from oprag_server.index import kernels_wide, kernels_wide_keep
from oprag_server.index.bm25 import listed_cache
from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.fusion import top_k_order
from test_topm_wide import _index, _stop_words, _zipf


def _same(a, b) -> bool:
    return (a[2] == b[2] and a[0].dtype == b[0].dtype and np.array_equal(a[0], b[0])
            and a[1].tobytes() == b[1].tobytes())


def _query(rng, ix, n, q):
    terms = [f"t{j}" for j in rng.integers(0, 6 if q % 3 == 0 else 300, int(rng.integers(1, 9)))]
    terms += ["t0", "t1", "nope"][: int(rng.integers(0, 4))]
    df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
    idf = np.log((n - df + 0.5) / (df + 0.5))
    return terms, np.where(idf < 0, 0.25 * float(rng.uniform(1, 4)), idf)


@pytest.fixture
def wide_only(monkeypatch):
    """Small corpora take the wide path (as 500K-chunk shards do); the rescans are counted."""
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    monkeypatch.setattr(lt, "_WIDE_GAIN", 10 ** 6)
    calls = {"rescan": 0, "old": 0}
    real_r, real_o = kernels_wide_keep.wide_rescan, kernels_wide.bm25_top_wide
    monkeypatch.setattr(kernels_wide_keep, "wide_rescan", lambda *a: calls.__setitem__("rescan", calls["rescan"] + 1)
                        or real_r(*a))
    monkeypatch.setattr(kernels_wide, "bm25_top_wide", lambda *a: calls.__setitem__("old", calls["old"] + 1)
                        or real_o(*a))
    return calls


@pytest.mark.parametrize("make,seed,deletes,late", [(_stop_words, 1, 300, 400), (_zipf, 0, 500, 200),
                                                    (_stop_words, 3, 0, 0), (_zipf, 4, 0, 900)])
def test_widening_from_the_kept_pass_equals_the_uncached_path(make, seed, deletes, late, wide_only):
    rng = np.random.default_rng(seed)
    n = 14000  # 110 blocks of 128 slots: rescans for 4m and 16m up to 48
    docs = make(rng, n)
    ix = _index(rng, docs, n - 1 - late, deletes, late)
    ids = np.array([f"c{s:05d}" for s in range(n)], dtype=object)
    lc = listed_cache.of(ix)
    for q in range(30):
        terms, idf = _query(rng, ix, n, q)
        k1, b, avgdl = float(rng.uniform(0.5, 2)), float(rng.uniform(0, 1)), float(rng.uniform(3, 25))
        m = int(rng.integers(1, 13))
        for mm in (m, 4 * m, 16 * m, m):  # round 1, two widening rounds, and a smaller m again
            got = lt.listed_top_scored(ix, terms, idf, avgdl, k1, b, mm, cache_version=7)
            want = lt.listed_top_scored(ix, terms, idf, avgdl, k1, b, mm)  # uncached: bm25_top_wide
            assert _same(got, want), (q, mm)
            rs, rsc, rl = lt.listed_top_reference(ix, terms, idf, avgdl, k1, b, mm)
            assert got[2] == rl
            top = top_k_order(got[1], ids, mm, rows=got[0])
            ref = top_k_order(rsc, ids, mm, rows=rs)
            assert [(int(got[0][i]), got[1][i]) for i in top] == [(int(rs[i]), rsc[i]) for i in ref]
    assert lc.hits >= 45 and wide_only["rescan"] >= 25  # widening rounds did come from the kept entries


def test_scores_are_rank_bm25s(wide_only):
    rng = np.random.default_rng(8)
    docs = _stop_words(rng, 12000)
    ix = _index(rng, docs, 6000, 0, 0)  # a segment and a delta layer
    bm = BM25Okapi(docs)
    for q in range(15):
        terms = [f"t{j}" for j in rng.integers(0, 40, int(rng.integers(1, 6)))] + ["t0"]
        idf = np.array([bm.idf.get(t, 0.0) for t in terms])
        ref = bm.get_scores(terms)
        for m in (5, 20, 80):
            s, sc, listed = lt.listed_top_scored(ix, terms, idf, bm.avgdl, bm.k1, bm.b, m, cache_version=1)[:3]
            np.testing.assert_allclose(sc, ref[s], rtol=1e-12)
            assert listed == int(np.count_nonzero(ref))
            want = np.sort(ref)[::-1][:m]
            np.testing.assert_allclose(np.sort(sc)[::-1][:m], want, rtol=1e-12)
    assert wide_only["rescan"] >= 10


def _top(ix, terms, idf, m, version):
    return lt.listed_top_scored(ix, terms, idf, 10.0, 1.2, 0.75, m, cache_version=version)


@pytest.mark.parametrize("write", ["remove", "add", "replace", "merge_start", "merge_install"])
def test_no_kept_list_is_served_after_a_write(write, wide_only):
    """Round 1 keeps the pass; a write changes the top-4m; the widening round must be the
    uncached path's over the index as it is now (a stale entry gives the old list)."""
    rng = np.random.default_rng(21)
    docs = _stop_words(rng, 12000)
    ix = _index(rng, docs, 11999, 0, 0)
    terms, idf = ["t0", "t1", "t2"], np.array([1.0, 0.8, 0.6])
    version = 3
    first = _top(ix, terms, idf, 8, version)
    old4 = lt.listed_top_scored(ix, terms, idf, 10.0, 1.2, 0.75, 32)
    best = int(first[0][np.argmax(first[1])])
    if write == "remove":
        ix.remove(best)
    elif write == "add":
        ix.add(12000, ["t0"] * 9 + ["t1"] * 9 + ["t2"] * 9)
    elif write == "replace":
        ix.remove(best)
        ix.add(best, ["t5"])
    elif write == "merge_start":  # the delta frozen for a background merge: layers replaced
        ix.add(12000, ["t0"] * 9 + ["t1"] * 9 + ["t2"] * 9)
        ix.merge(background=True)
        assert ix._frozen is not None
    else:  # a merge installed: a new segment (the counter left as it was: the layers alone tell)
        ix.remove(best)
        ix.merge()
    if write != "merge_install":
        version += 1  # ChunkStore.version grows on every apply and delete
    now = _top(ix, terms, idf, 32, version)
    fresh = lt.listed_top_scored(ix, terms, idf, 10.0, 1.2, 0.75, 32)
    assert _same(now, fresh)
    assert not _same(fresh, old4)  # the write did change the list
    ix.wait_merge()


def test_entries_are_bounded_and_keyed_by_the_whole_query(wide_only):
    rng = np.random.default_rng(4)
    ix = _index(rng, _stop_words(rng, 3000), 2999, 0, 0)
    lc = listed_cache.of(ix)
    for j in range(listed_cache.CAP + 10):
        _top(ix, ["t0", f"t{5 + j}"], np.array([1.0, 2.0]), 4, 1)
    assert len(lc.entries) == listed_cache.CAP
    _top(ix, ["t0", "t5"], np.array([1.0, 2.0]), 4, 1)  # dropped (least recently used): a miss
    assert lc.misses == listed_cache.CAP + 11 and lc.hits == 0
    for idf, kw in ((np.array([1.0, 2.5]), {}), (np.array([1.0, 2.0]), {"b": 0.5})):
        a = lt.listed_top_scored(ix, ["t0", "t5"], idf, 10.0, 1.2, kw.get("b", 0.75), 16, cache_version=1)
        assert _same(a, lt.listed_top_scored(ix, ["t0", "t5"], idf, 10.0, 1.2, kw.get("b", 0.75), 16))
    assert lc.hits == 0
