"""The wide-term BM25 top-m (index/kernels_wide.py: dense tf rows for terms in a large part of
the segment, one float32 pass, exact rescoring) against the kernel that reads every list
(``bm25_listed_top``, itself tested against ``PostingsIndex.score_all``): the same top-m by
(score desc, id asc), bit-identical scores, the exact listed count; on corpora built several
ways (Zipf, a few stop words in almost every chunk, equal-length chunks full of ties), with
deletes, delta layers on top of the segment, repeated and absent terms, and a tf above 255."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index import kernels_wide
from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.bm25.postings import PostingsIndex
from oprag_server.index.fusion import top_k_order
from test_topm_pruned import _full  # every list read: the reference path


def _zipf(rng, n):
    w = 1.0 / np.arange(1, 301) ** 1.1
    w /= w.sum()
    return [[f"t{j}" for j in rng.choice(300, int(rng.integers(1, 40)), p=w)] for _ in range(n)]


def _stop_words(rng, n):
    """Rare content words plus 4 stop words each in ~60-90% of the chunks (rank_bm25's idf
    floor case): the top-m is decided by the stop words for many queries."""
    out = []
    for _ in range(n):
        toks = [f"t{j}" for j in rng.integers(5, 2000, int(rng.integers(1, 12)))]
        for s, p in zip(range(4), (0.9, 0.8, 0.7, 0.6)):
            toks += [f"t{s}"] * int(rng.random() < p) * int(rng.integers(1, 6))
        out.append(toks or ["t9"])
    return out


def _ties(rng, n):
    """Equal-length chunks over 12 terms: most scores tie with many others."""
    return [[f"t{j}" for j in rng.integers(0, 12, 6)] for _ in range(n)]


def _index(rng, docs, merge_at, deletes, late):
    ix = PostingsIndex()
    for s, toks in enumerate(docs):
        ix.add(s, toks)
        if s == merge_at:
            ix.merge()
    for s in rng.choice(len(docs), deletes, replace=False):
        ix.remove(int(s))
    for j, s in enumerate(rng.choice(len(docs), late, replace=False)):  # replaced: now in the delta
        if ix.has_slot(int(s)):
            ix.remove(int(s))
        ix.add(int(s), docs[(int(s) + j + 1) % len(docs)])
    return ix


@pytest.mark.parametrize("make,seed,deletes,late", [(_zipf, 0, 80, 40), (_stop_words, 1, 50, 100), (_ties, 2, 30, 20),
                                                    (_stop_words, 3, 0, 0)])
def test_wide_top_m_equals_the_full_kernel(make, seed, deletes, late, monkeypatch):
    rng = np.random.default_rng(seed)
    docs = make(rng, 1500)
    ix = _index(rng, docs, len(docs) - 1, deletes, late)
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)  # small corpora: the pruned paths all the same
    calls = []
    real = kernels_wide.bm25_top_wide
    monkeypatch.setattr(kernels_wide, "bm25_top_wide", lambda *a: calls.append(1) or real(*a))
    ids = np.array([f"c{s:05d}" for s in range(len(docs))], dtype=object)
    for q in range(40):
        terms = [f"t{j}" for j in rng.integers(0, 6 if q % 3 == 0 else 300, int(rng.integers(1, 9)))]
        terms += ["t0", "t1", "nope"][: int(rng.integers(0, 4))]
        df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
        idf = np.log((len(docs) - df + 0.5) / (df + 0.5))
        idf = np.where(idf < 0, 0.25 * float(rng.uniform(1, 4)), idf)  # rank_bm25's floor: >= 0
        if q % 7 == 0:
            idf[0] = 0.0
        k1, b, avgdl, m = float(rng.uniform(0.5, 2)), float(rng.uniform(0, 1)), float(rng.uniform(3, 25)), int(rng.integers(1, 80))
        s, sc, listed = lt.listed_top(ix, terms, idf, avgdl, k1, b, m)
        fs, fsc, flisted = _full(ix, terms, idf, avgdl, k1, b, m)
        ref = dict(zip(fs.tolist(), fsc.tolist()))
        assert all(ref[x] == y for x, y in zip(s.tolist(), sc.tolist()))  # score_all's values, bit for bit
        got = [(int(s[i]), sc[i].tobytes()) for i in top_k_order(sc, ids, m, rows=s)]
        assert got == [(int(fs[i]), fsc[i].tobytes()) for i in top_k_order(fsc, ids, m, rows=fs)]
        assert listed == flisted
        assert s.size >= min(m, flisted)
    assert len(calls) >= 10  # the wide path did run


def test_row_with_tf_above_255_is_not_used(monkeypatch):
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    rng = np.random.default_rng(5)
    docs = _stop_words(rng, 400)
    docs[3] = ["t0"] * 300 + ["t7"]
    ix = _index(rng, docs, len(docs) - 1, 0, 0)
    idf = np.array([1.5, 1.2])
    s, sc, listed = lt.listed_top(ix, ["t0", "t1"], idf, 10.0, 1.2, 0.75, 5)
    fs, fsc, flisted = _full(ix, ["t0", "t1"], idf, 10.0, 1.2, 0.75, 5)
    assert sorted(zip(sc.tolist(), s.tolist())) == sorted(zip(fsc.tolist(), fs.tolist())) and listed == flisted
    w = ix.__dict__["_topm_scratch"].wide
    assert w.state[w.row_of[ix._seg.vocab["t0"]]] == 2 and w.state[w.row_of[ix._seg.vocab["t1"]]] == 1
    assert not w.rows[w.row_of[ix._seg.vocab["t0"]]].any()


def test_built_rows_count_in_postings_bytes(monkeypatch):
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    rng = np.random.default_rng(9)
    ix = _index(rng, _stop_words(rng, 600), 599, 0, 0)
    before = ix.nbytes()["postings"]
    lt.listed_top(ix, ["t0", "t1", "t2"], np.array([1.0, 1.0, 1.0]), 8.0, 1.5, 0.75, 10)
    w = ix.__dict__["_topm_scratch"].wide
    built = int((w.state == 1).sum())
    assert built == 3
    assert ix.nbytes()["postings"] >= before + built * w.span + w.seg_len.nbytes


@pytest.mark.parametrize("seed", [11, 12])
def test_candidate_scores_from_rows_equal_the_postings_path(seed, monkeypatch):
    """PostingsIndex.score (BM25 of the dense candidates) reads a built wide row instead of
    searching the long list: the same floats, bit for bit, with deletes and delta chunks."""
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    rng = np.random.default_rng(seed)
    docs = _stop_words(rng, 900)
    ix = _index(rng, docs, 899, 40, 60)
    terms = ["t0", "t1", "t7", "t2", "t0", "t33"]
    idf = np.array([1.7, 1.7, 5.0, 1.7, 1.7, 6.0])
    lt.listed_top(ix, terms, idf, 9.0, 1.2, 0.75, 20)  # builds the rows of t0, t1, t2
    tids = np.array([ix._seg.vocab.get(t, -1) for t in terms], np.int64)
    rowmap, _, _ = lt.wide_rows(ix, tids)
    assert (rowmap >= 0).sum() >= 4
    live = np.array([s for s in range(len(docs)) if ix.has_slot(s)], np.int64)
    slots = rng.choice(live, 300, replace=True)
    with_rows = ix.score(slots, terms, idf, 9.0, 1.2, 0.75)
    ix.__dict__["_topm_scratch"].wide = None
    assert (lt.wide_rows(ix, tids)[0] < 0).all()
    without = ix.score(slots, terms, idf, 9.0, 1.2, 0.75)
    assert with_rows.tobytes() == without.tobytes()
    assert (with_rows > 0).mean() > 0.5


def test_lengths_above_uint16_use_float32(monkeypatch):
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    rng = np.random.default_rng(21)
    docs = _stop_words(rng, 300)
    docs[5] = [f"u{j}" for j in range(66000)] + ["t0", "t1"]  # one chunk longer than 65,535 tokens
    ix = _index(rng, docs, len(docs) - 1, 0, 0)
    terms, idf = ["t0", "t1", "t2", "t9"], np.array([1.5, 1.5, 1.5, 4.0])
    s, sc, listed = lt.listed_top(ix, terms, idf, 250.0, 1.2, 0.75, 7)
    fs, fsc, flisted = _full(ix, terms, idf, 250.0, 1.2, 0.75, 7)
    assert ix.__dict__["_topm_scratch"].wide.seg_len.dtype == np.float32
    assert sorted(zip(sc.tolist(), s.tolist())) == sorted(zip(fsc.tolist(), fs.tolist())) and listed == flisted


@pytest.mark.parametrize("make,seed", [(_stop_words, 11), (_ties, 12)])
def test_threshold_raised_by_the_buffer_keeps_the_top_m(make, seed, monkeypatch):
    """More listed chunks than the pass's buffer (max(8m, 4096)): the threshold then comes only from
    compactions of what the pass kept (with ties at it on the ties corpus), and the top-m must
    still be the full kernel's."""
    rng = np.random.default_rng(seed)
    docs = make(rng, 10_000)
    ix = _index(rng, docs, len(docs) - 1, 200, 50)
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    calls = []
    real = kernels_wide.bm25_top_wide
    monkeypatch.setattr(kernels_wide, "bm25_top_wide", lambda *a: calls.append(1) or real(*a))
    ids = np.array([f"c{s:05d}" for s in range(len(docs))], dtype=object)
    for q in range(12):
        terms = [f"t{j}" for j in rng.integers(0, 12, int(rng.integers(2, 6)))] + ["t0"]
        df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
        idf = np.log((len(docs) - df + 0.5) / (df + 0.5))
        idf = np.where(idf < 0, 0.25 * float(rng.uniform(1, 4)), idf)
        m = int((1, 5, 64)[q % 3])
        s, sc, listed = lt.listed_top(ix, terms, idf, 12.0, 1.5, 0.75, m)
        fs, fsc, flisted = _full(ix, terms, idf, 12.0, 1.5, 0.75, m)
        assert listed == flisted > 4096 + 8 * m  # the buffer filled: compactions set the threshold
        got = [(int(s[i]), sc[i].tobytes()) for i in top_k_order(sc, ids, m, rows=s)]
        assert got == [(int(fs[i]), fsc[i].tobytes()) for i in top_k_order(fsc, ids, m, rows=fs)]
    assert len(calls) == 12
