"""Parity of oprag_server.index.bm25 with rank_bm25 0.2.2 BM25Okapi.

Every expected score comes from ``rank_bm25.BM25Okapi(corpus).get_scores(query)``;
nothing is hard-coded.
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

try:
    from oprag_server.index import bm25 as B
except ImportError:  # package not installed in the venv: import from the source tree
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "server"))
    from oprag_server.index import bm25 as B

TOL = 1e-9
K1, BB, EPS = 1.5, 0.75, 0.25


def build(corpus, n_shards=1, assign=None):
    """Index ``corpus`` (list of token lists) as slots 0..n-1 across shards.

    Returns (shards, stats, slot_to_shard)."""
    shards = [B.PostingsIndex() for _ in range(n_shards)]
    where = {}
    for slot, doc in enumerate(corpus):
        k = assign(slot) if assign else slot % n_shards
        shards[k].add(slot, doc)
        where[slot] = k
    stats = B.CorpusStats.merge_full(s.full_stats() for s in shards)
    return shards, stats, where


def ours_score(shards, stats, where, query, slots):
    idf = stats.query_idf(query, EPS)
    out = np.zeros(len(slots))
    for k, sh in enumerate(shards):
        mask = np.array([where[s] == k for s in slots], dtype=bool)
        if mask.any():
            out[mask] = sh.score(np.asarray(slots, np.int64)[mask], query, idf, stats.avgdl, K1, BB)
    return out


def ours_score_all(shards, stats, query):
    idf = stats.query_idf(query, EPS)
    res = {}
    for sh in shards:
        s, v = sh.score_all(query, idf, stats.avgdl, K1, BB)
        assert s.dtype == np.int64 and v.dtype == np.float64 and s.shape == v.shape
        assert np.all(np.diff(s) > 0)  # ascending, unique
        for a, c in zip(s.tolist(), v.tolist()):
            assert a not in res  # a chunk lives in one shard only
            res[a] = c
    return res


def check_parity(corpus, query, slots=None, shard_splits=(1, 2, 3)):
    """Compare score / score_all against rank_bm25 on ``corpus`` (slot i = doc i)."""
    ref = BM25Okapi(corpus, k1=K1, b=BB, epsilon=EPS).get_scores(query)
    if slots is None:
        slots = list(range(len(corpus)))
    for n in shard_splits:
        shards, stats, where = build(corpus, n)
        got = ours_score(shards, stats, where, query, slots)
        np.testing.assert_allclose(got, ref[slots], rtol=0, atol=TOL)
        res = ours_score_all(shards, stats, query)
        for slot in range(len(corpus)):
            if slot in res:
                assert abs(res[slot] - ref[slot]) <= TOL, (slot, res[slot], ref[slot])
                assert any(t in corpus[slot] for t in query)
            else:
                assert ref[slot] == 0.0, (slot, ref[slot])
                assert not any(t in corpus[slot] for t in query)
    return ref


SMALL_CORPORA = [
    [
        "hello there good man".split(),
        "it is quite windy in london".split(),
        "how is the weather today".split(),
    ],
    [
        "the cat sat on the mat".split(),
        "the dog sat on the log".split(),
        "cats and dogs are pets pets pets".split(),
        "a mat for the cat and a log for the dog".split(),
        "bm25 ranks documents by term frequency".split(),
    ],
    [list("abcaab"), list("bbc"), list("cdd"), list("a"), list("eeeeeeeeeeee"), list("ab")],
]
QUERIES = [
    "windy london".split(),
    "the cat".split(),
    "pets dog mat".split(),
    ["a", "b"],
    ["c", "d", "e", "zzz"],
    ["nope"],
    "the the cat".split(),
]


@pytest.mark.parametrize("ci", range(len(SMALL_CORPORA)))
@pytest.mark.parametrize("qi", range(len(QUERIES)))
def test_small_corpora(ci, qi):
    check_parity(SMALL_CORPORA[ci], QUERIES[qi])


def test_some_scores_nonzero():
    # guard against a vacuous parity (everything 0 on both sides)
    ref = check_parity(SMALL_CORPORA[1], "pets dog mat".split())
    assert (ref > 0).sum() >= 3


def test_subset_and_unordered_slots():
    corpus = SMALL_CORPORA[1]
    check_parity(corpus, "the cat dog".split(), slots=[4, 0, 2, 2])


def test_idf_zero_half_documents():
    corpus = [["x", "a"], ["x", "b"], ["c"], ["d", "d"]]
    bm = BM25Okapi(corpus)
    assert bm.idf["x"] == 0.0  # precondition: exactly half the docs
    ref = check_parity(corpus, ["x"])
    assert np.all(ref == 0.0)
    check_parity(corpus, ["x", "a"])
    _, stats, _ = build(corpus)
    assert stats.query_idf(["x"], EPS)[0] == 0.0  # not floored


def test_negative_idf_epsilon_floor():
    corpus = [["shared", "alpha"], ["shared", "beta", "beta"]]
    bm = BM25Okapi(corpus)
    raw = math.log(2 - 2 + 0.5) - math.log(2 + 0.5)
    assert raw < 0 and bm.idf["shared"] == pytest.approx(EPS * bm.average_idf)
    ref = check_parity(corpus, ["shared"])
    assert np.all(ref != 0)
    check_parity(corpus, ["shared", "beta"])
    _, stats, _ = build(corpus)
    assert stats.average_idf == pytest.approx(bm.average_idf, abs=1e-12)
    assert stats.query_idf(["shared"], EPS)[0] == pytest.approx(bm.idf["shared"], abs=1e-12)


def test_all_terms_negative_average():
    # every term in every doc: average idf < 0, so the floor is negative too
    corpus = [["a", "b"], ["b", "a", "a"]]
    bm = BM25Okapi(corpus)
    assert bm.average_idf < 0
    ref = check_parity(corpus, ["a", "b", "a"])
    assert np.all(ref < 0)


def test_repeated_query_term():
    corpus = SMALL_CORPORA[1]
    single = check_parity(corpus, ["cat"])
    double = check_parity(corpus, ["cat", "cat"])
    assert np.any(single != 0)
    np.testing.assert_allclose(double, 2 * single, atol=TOL)


def test_empty_document():
    corpus = [[], ["a", "b"], ["b", "c", "c"], [], ["a"]]
    check_parity(corpus, ["a", "c"])
    check_parity(corpus, ["b"])


def test_empty_query():
    corpus = SMALL_CORPORA[1]
    ref = check_parity(corpus, [])
    assert np.all(ref == 0.0)
    shards, stats, _ = build(corpus, 2)
    assert stats.query_idf([], EPS).shape == (0,)
    for sh in shards:
        s, v = sh.score_all([], np.zeros(0), stats.avgdl)
        assert s.size == 0 and v.size == 0


def test_empty_corpus():
    with pytest.raises(ZeroDivisionError):
        BM25Okapi([])  # the reference itself cannot handle it
    shards, stats, _ = build([], 2)
    assert stats.n_docs == 0 and stats.avgdl == 0.0 and stats.average_idf == 0.0
    idf = stats.query_idf(["a", "b"], EPS)
    assert idf.dtype == np.float64 and np.all(idf == 0)
    for sh in shards:
        s, v = sh.score_all(["a", "b"], idf, stats.avgdl)
        assert s.size == 0 and v.size == 0
        assert sh.score(np.zeros(0, np.int64), ["a", "b"], idf, stats.avgdl).shape == (0,)


def test_all_documents_empty():
    with pytest.raises(ZeroDivisionError):
        BM25Okapi([[], []])  # rank_bm25: no terms -> average_idf = 0/0
    shards, stats, _ = build([[], []], 1)
    assert stats.avgdl == 0.0
    idf = stats.query_idf(["a"], EPS)
    with np.errstate(all="raise"):
        out = shards[0].score(np.array([0, 1]), ["a"], idf, stats.avgdl)
        assert np.all(out == 0) and not np.any(np.isnan(out))
        s, _ = shards[0].score_all(["a"], idf, stats.avgdl)
        assert s.size == 0


def test_okapi_idf_matches_reference():
    corpus = SMALL_CORPORA[1]
    bm = BM25Okapi(corpus)
    _, stats, _ = build(corpus)
    terms = list(stats.df)
    raw = B.okapi_idf(stats.n_docs, np.array([stats.df[t] for t in terms]))
    assert raw.dtype == np.float64
    floored = B.okapi_idf_floor(raw, stats.average_idf, EPS)
    np.testing.assert_allclose(floored, [bm.idf[t] for t in terms], atol=1e-12)
    np.testing.assert_allclose(stats.query_idf(terms, EPS), [bm.idf[t] for t in terms], atol=1e-12)
    assert stats.average_idf == pytest.approx(bm.average_idf, abs=1e-12)
    with pytest.raises(ValueError):
        B.okapi_idf(3, np.array([4]))


def test_average_idf_cached_per_version():
    st_ = B.CorpusStats(4, 10, {"a": 1, "b": 3})
    v0 = st_.version
    avg = st_.average_idf
    assert st_._avg_cache == (v0, avg)
    st_.apply_delta(0, 0, {})
    assert st_.version == v0  # empty delta: no change
    st_.apply_delta(1, 2, {"a": 1, "c": 1})
    assert st_.version == v0 + 1
    assert st_.average_idf != avg  # recomputed after the change
    ref = B.CorpusStats(5, 12, {"a": 2, "b": 3, "c": 1})
    assert st_ == ref and st_.average_idf == pytest.approx(ref.average_idf, abs=1e-15)
    st_.apply_delta(-1, -2, {"a": -1, "c": -1})
    assert "c" not in st_.df  # df reached 0 -> dropped
    with pytest.raises(ValueError):
        st_.apply_delta(0, 0, {"zzz": -1})
    assert st_ == B.CorpusStats(4, 10, {"a": 1, "b": 3})  # failed delta changed nothing


def test_postings_api_errors_and_deletes():
    ix = B.PostingsIndex()
    ix.add(3, ["a", "b", "a"])
    ix.add(0, ["b"])
    assert len(ix) == 2 and ix.has_slot(3) and not ix.has_slot(1)
    np.testing.assert_array_equal(ix.doc_len(np.array([3, 0])), [3.0, 1.0])
    assert ix.doc_len(np.array([3])).dtype == np.float64
    with pytest.raises(ValueError):
        ix.add(3, ["x"])
    with pytest.raises(ValueError):
        ix.add(-1, ["x"])
    with pytest.raises(KeyError):
        ix.remove(1)
    with pytest.raises(KeyError):
        ix.doc_len(np.array([1]))
    with pytest.raises(KeyError):
        ix.score(np.array([99]), ["a"], np.ones(1), 1.0)
    with pytest.raises(ValueError):
        ix.score_all(["a"], np.ones(2), 1.0)
    with pytest.raises(ValueError):
        ix.score_all(["a"], np.ones(1), -1.0)
    idf = np.ones(1)
    s, _ = ix.score_all(["a"], idf, 2.0)
    assert s.tolist() == [3]
    ix.remove(3)
    assert not ix.has_slot(3)
    with pytest.raises(KeyError):
        ix.remove(3)  # already removed
    s, _ = ix.score_all(["a"], idf, 2.0)
    assert s.size == 0  # deleted slot never appears (cached arrays invalidated)
    s, _ = ix.score_all(["b"], idf, 2.0)
    assert s.tolist() == [0]
    ix.add(3, ["c"])  # slot reuse after removal
    s, _ = ix.score_all(["a", "b", "c"], np.ones(3), 2.0)
    assert s.tolist() == [0, 3]
    assert ix.drain_delta() == (2, 2, {"b": 1, "c": 1})
    assert ix.drain_delta() == (0, 0, {})
    assert ix.full_stats() == (2, 2, {"b": 1, "c": 1})


def test_dense_and_sparse_accumulators_agree(monkeypatch):
    rng = np.random.default_rng(0)
    vocab = [f"t{i}" for i in range(30)]
    corpus = [list(rng.choice(vocab, size=rng.integers(0, 12))) for _ in range(300)]
    query = ["t1", "t2", "t3", "t1", "t29", "missing"]
    for ratio in (10**9, 0):  # force dense, then force sparse
        monkeypatch.setattr(B.PostingsIndex, "_DENSE_RATIO", ratio)
        check_parity(corpus, query, shard_splits=(1, 2))


# ---------------------------------------------------------------------------------
# Property test: random add/remove on 2 shards vs a from-scratch rank_bm25
# ---------------------------------------------------------------------------------
VOCAB = ["a", "b", "c", "d", "e", "f"]
doc_st = st.lists(st.sampled_from(VOCAB), min_size=0, max_size=6)
op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 11), doc_st, st.integers(0, 1)),
    st.tuples(st.just("remove"), st.integers(0, 11)),
    st.tuples(st.just("drain"), st.integers(0, 1)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=40),
    query=st.lists(st.sampled_from(VOCAB + ["zz"]), min_size=0, max_size=4),
)
def test_property_random_updates(ops, query):
    shards = [B.PostingsIndex(), B.PostingsIndex()]
    synced = B.CorpusStats()
    live: dict[int, tuple[list[str], int]] = {}
    for op in ops:
        if op[0] == "add":
            _, slot, doc, k = op
            if slot in live:
                continue
            shards[k].add(slot, doc)
            live[slot] = (doc, k)
        elif op[0] == "remove":
            slot = op[1]
            if slot not in live:
                with pytest.raises(KeyError):
                    shards[0].remove(slot)
                continue
            shards[live.pop(slot)[1]].remove(slot)
        else:
            synced.apply_delta(*shards[op[1]].drain_delta())
    for sh in shards:
        synced.apply_delta(*sh.drain_delta())
    full = B.CorpusStats.merge_full(sh.full_stats() for sh in shards)
    assert synced == full
    assert synced.average_idf == pytest.approx(full.average_idf, abs=1e-12)
    assert sum(len(sh) for sh in shards) == len(live)

    slots = sorted(live)
    corpus = [live[s][0] for s in slots]
    idf = synced.query_idf(query, EPS)
    got_all: dict[int, float] = {}
    for sh in shards:
        s, v = sh.score_all(query, idf, synced.avgdl, K1, BB)
        assert all(x in live and live[x][1] == shards.index(sh) for x in s.tolist())
        got_all.update(zip(s.tolist(), v.tolist()))
    if not corpus or not any(corpus):
        # rank_bm25 raises ZeroDivisionError here; ours: everything scores 0 / nothing hits
        assert got_all == {}
        return
    ref = BM25Okapi(corpus, k1=K1, b=BB, epsilon=EPS).get_scores(query)
    for i, slot in enumerate(slots):
        sh = shards[live[slot][1]]
        got = sh.score(np.array([slot], np.int64), query, idf, synced.avgdl, K1, BB)[0]
        assert abs(got - ref[i]) <= TOL
        if slot in got_all:
            assert abs(got_all[slot] - ref[i]) <= TOL
        else:
            assert ref[i] == 0.0


def test_average_idf_does_not_depend_on_the_order_terms_came_in():
    """trial31: a term deleted and added again moved to the end of ``df`` and changed the last bit of
    ``average_idf`` (so of every floored idf and the BM25 scores of common terms) between two servers
    holding the same documents. Equal statistics, the same bits, in any order; rank_bm25's value."""
    rng = np.random.default_rng(31)
    words = np.array([f"w{i}" for i in range(4000)])
    p = 1.0 / np.arange(1, 4001) ** 0.8  # Zipf-like: document frequencies from 1 to most documents
    docs = [list(rng.choice(words, size=int(rng.integers(1, 60)), p=p / p.sum())) for _ in range(1500)]
    bm = BM25Okapi(docs)
    df: dict[str, int] = {}
    for d in docs:
        for t in set(d):
            df[t] = df.get(t, 0) + 1
    n, total = len(docs), sum(map(len, docs))
    items = list(df.items())
    got = set()
    for _ in range(6):
        rng.shuffle(items)
        got.add(B.CorpusStats(n, total, dict(items)).average_idf)
    assert len(got) == 1
    assert got.pop() == pytest.approx(bm.average_idf, abs=1e-12)
    # the trial's sequence: delete and re-add a term (dict order changes, the statistics do not)
    st_ = B.CorpusStats(n, total, dict(df))
    before = st_.average_idf
    t0 = next(iter(df))
    st_.apply_delta(0, 0, {t0: -df[t0]})
    st_.apply_delta(0, 0, {t0: df[t0]})
    assert list(st_.df)[-1] == t0
    assert st_.average_idf == before


def test_an_average_idf_of_exactly_zero_floors_common_terms_to_zero():
    """Five chunks sharing six terms and a sixth holding one new word: six idfs log(1.5/5.5) and six
    log(5.5/1.5), whose exact sum is 0. The exact sum gives 0.0, so the floored idf of a term in
    more than half the chunks is 0 and those chunks are in no BM25 list (README "Lexical ranks");
    rank_bm25's running sum leaves -3.7e-17 (within 1e-12, as every average here). CI found the
    served case (tests/integration/test_fuzz.py, session 32)."""
    docs = [f"baseline document {i} about orchards and pears".split() for i in range(5)] + [["zebra"]]
    df: dict[str, int] = {}
    for d in docs:
        for t in set(d):
            df[t] = df.get(t, 0) + 1
    stats = B.CorpusStats(len(docs), sum(map(len, docs)), df)
    bm = BM25Okapi(docs)
    assert stats.average_idf == 0.0 and bm.average_idf == pytest.approx(0.0, abs=1e-12) and bm.average_idf != 0.0
    assert stats.query_idf(["orchards", "pears", "zebra"]).tolist()[:2] == [0.0, 0.0]
    assert stats.query_idf(["zebra"])[0] == pytest.approx(bm.idf["zebra"], abs=1e-12) and bm.idf["zebra"] > 0
