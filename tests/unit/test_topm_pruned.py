"""MaxScore BM25 top-m (index/kernels_topm.py) against the kernel that reads every list
(index/kernels_exact.py ``bm25_listed_top``, itself tested against ``PostingsIndex.score_all``): the
same top-m by (score desc, id asc), bit-identical scores, and a cut that does happen on
Zipf-distributed text."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index import kernels_exact
from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.bm25.merging import _SEG
from oprag_server.index.bm25.postings import PostingsIndex
from oprag_server.index.fusion import top_k_order


def _zipf_docs(rng, n, vocab, doc_len):
    w = 1.0 / np.arange(1, vocab + 1) ** 1.1
    w /= w.sum()
    return [[f"t{j}" for j in rng.choice(vocab, int(rng.integers(1, doc_len)), p=w)] for _ in range(n)]


def _uniform_docs(rng, n, vocab, doc_len):
    return [[f"t{j}" for j in rng.integers(0, vocab, int(rng.integers(1, doc_len)))] for _ in range(n)]


def _index(rng, docs, merge_at, deletes):
    ix = PostingsIndex()
    for s, toks in enumerate(docs):
        ix.add(s, toks)
        if merge_at is not None and s == merge_at:
            ix.merge()
    for s in rng.choice(len(docs), deletes, replace=False):
        ix.remove(int(s))
    return ix


def _full(ix, terms, idf, avgdl, k1, b, m):
    """bm25_listed_top over every list (the path the pruned one must equal)."""
    old = lt._PRUNE
    lt._PRUNE = False
    try:
        return lt.listed_top(ix, terms, idf, avgdl, k1, b, m)
    finally:
        lt._PRUNE = old


@pytest.mark.parametrize("make,merge_at,seed", [(_zipf_docs, 700, 0), (_zipf_docs, None, 1), (_uniform_docs, 300, 2),
                                                (_zipf_docs, 1199, 3)])
def test_pruned_top_m_equals_the_full_kernel(make, merge_at, seed, monkeypatch):
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)  # small corpora: the pruned path all the same
    monkeypatch.setattr(lt, "_WIDE", False)  # MaxScore itself (the wide-term path: test_topm_wide.py)
    rng = np.random.default_rng(seed)
    docs = make(rng, 1200, 400, 40)
    ix = _index(rng, docs, merge_at, deletes=60)
    ids = np.array([f"c{s:05d}" for s in range(len(docs))], dtype=object)
    cuts = 0
    for _ in range(40):
        # rare and common terms mixed, a repeated term, an absent one
        terms = [f"t{j}" for j in rng.integers(0, 400, int(rng.integers(1, 9)))] + ["t0", "t0", "nope"][: int(rng.integers(0, 4))]
        df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
        idf = np.log((len(docs) - df + 0.5) / (df + 0.5)).clip(0.05)  # >= 0: the pruned path
        k1, b, avgdl, m = float(rng.uniform(0.5, 2)), float(rng.uniform(0, 1)), float(rng.uniform(5, 25)), int(rng.integers(1, 80))
        s, sc, listed = lt.listed_top(ix, terms, idf, avgdl, k1, b, m)
        fs, fsc, flisted = _full(ix, terms, idf, avgdl, k1, b, m)
        ref = dict(zip(fs.tolist(), fsc.tolist()))
        assert all(ref[x] == y for x, y in zip(s.tolist(), sc.tolist()))  # score_all's values, bit for bit
        got = [(int(s[i]), sc[i].tobytes()) for i in top_k_order(sc, ids, m, rows=s)]
        assert got == [(int(fs[i]), fsc[i].tobytes()) for i in top_k_order(fsc, ids, m, rows=fs)]
        assert listed == flisted or (listed > m and s.size <= flisted)  # exact, or "more than the top-m"
        cuts += listed != flisted or s.size < fs.size
    if make is _zipf_docs:
        assert cuts > 0  # the common terms' lists were left unread on some queries


def test_kernel_cut_reads_fewer_lists_and_resets_scratch():
    rng = np.random.default_rng(7)
    ix = _index(rng, _zipf_docs(rng, 3000, 300, 60), 2999, deletes=0)
    seg = ix._seg
    from oprag_server.index import kernels_topm as kt
    v = seg.offsets.size - 1
    mt, md = np.full(v, np.nan), np.full(v, np.nan)
    tids = np.array([seg.vocab["t250"], seg.vocab["t0"], seg.vocab["t1"]], np.int64)
    idf = np.array([6.0, 0.05, 0.06])
    cap = ix._doc_len.size
    acc, seen = np.zeros(cap), np.zeros(cap, np.uint8)
    e = np.zeros(0, np.int64)
    s, sc, listed, cut = kt.bm25_top_pruned(ix._where, _SEG, ix._doc_len, tids, idf, seg.offsets, seg.slots, seg.tf,
                                            np.zeros(4, np.int64), e, np.zeros(0), mt, md, ix._seg_df, 5, 20.0, 1.5, 0.75,
                                            acc, seen)
    assert cut and listed > 5
    assert not acc.any() and not seen.any()
    assert not np.isnan(mt[tids]).any() and np.isnan(mt).sum() == v - 3  # bounds of the query's terms only
    fs, fsc, _, _ = kernels_exact.bm25_listed_top(ix._where, _SEG, ix._doc_len, tids, idf, seg.offsets, seg.slots,
                                                  seg.tf, np.zeros(4, np.int64), e, np.zeros(0), e, True, 5, 20.0, 1.5,
                                                  0.75, e)
    assert sorted(zip(sc.tolist(), s.tolist())) == sorted(zip(fsc.tolist(), fs.tolist()))
