"""The wide BM25 pass's block skipping (index/kernels_wide_keep.py ``wide_pass`` with the rows'
block bounds of index/bm25/wide_rows.py and a starting threshold from the dense candidates):
a block of ``kernels_wide.SUB`` slots whose upper bound is below the pass's threshold is not
scored. Checked against the same pass with no bounds and no starting threshold (itself checked
against the kernel that reads every list, tests/unit/test_topm_wide.py): the same top-m, scores
bit for bit, the same exact ``listed`` count; the block bounds at least every block's largest
approximate score (so no skipped block held a chunk the pass keeps) for k1 and b across their
range; ``fill_row``'s per-block maxima against numpy; and, through ``listed_top_scored`` as a
shard calls it, widening rounds answered from the kept pass. Corpora: Zipf, stop words in most
chunks, ties, and topic runs (the bounds differ block to block, as an ingest in document order
leaves them), with deletes and a delta layer."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index import kernels_wide
from oprag_server.index import kernels_wide_keep as kk
from oprag_server.index.bm25 import listed_cache, wide_rows
from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.fusion import top_k_order
from test_topm_pruned import _full
from test_topm_wide import _index, _stop_words, _ties, _zipf

SUB = kernels_wide.SUB


def _topics(rng, n):
    """Runs of 300 consecutive chunks on one of 8 topics: content words from the topic's own 40,
    and 6 common words whose presence and tf depend on the topic."""
    out = []
    for s in range(n):
        topic = (s // 300) % 8
        toks = [f"t{20 + topic * 40 + j}" for j in rng.integers(0, 40, int(rng.integers(2, 30)))]
        for c in range(6):
            if rng.random() < 0.35 + 0.08 * ((topic + c) % 8):
                toks += [f"t{c}"] * int(rng.integers(1, 2 + (topic * c) % 7))
        out.append(toks)
    return out


def _query(rng, ix, n, q):
    lo, hi = (0, 6) if q % 3 == 0 else (0, 340)
    terms = [f"t{j}" for j in rng.integers(lo, hi, int(rng.integers(1, 9)))]
    terms += ["t0", "t1", "nope"][: int(rng.integers(0, 4))]
    df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
    idf = np.log((n - df + 0.5) / (df + 0.5))
    idf = np.where(idf < 0, 0.25 * float(rng.uniform(1, 4)), idf)  # rank_bm25's floor: >= 0
    if q % 11 == 0:
        idf[0] = 0.0
    return terms, idf


def _pass(ix, w, terms, idf, m, avgdl, k1, b, bounds, thr0, keep_narrow=True):
    """``(wide_finish's (slots, scores), listed, sub_max)`` of one pass over ``ix``'s segment."""
    seg = ix._seg  # noqa: SLF001
    tids, d_off, ds, dt = lt._query_arrays(ix, terms)  # noqa: SLF001
    is_wide, row, _ = w.positions(tids)
    if not keep_narrow:  # the wide rows alone
        tids = np.where(is_wide, tids, -1)
        d_off, ds, dt = np.zeros(len(terms) + 1, np.int64), ds[:0], dt[:0]
    cap = ix._doc_len.size  # noqa: SLF001
    q = (tids, idf, seg.offsets, seg.slots, seg.tf, d_off, ds, dt, is_wide, row, w.rows, w.span)
    bmax, bratio = (w.bmax, w.bratio) if bounds else kernels_wide._NO_BOUNDS  # noqa: SLF001
    cx, cv, listed, mx, _ = kk.wide_pass(ix._where, lt._SEG, ix._doc_len, w.seg_len, *q, m, avgdl, k1, b,  # noqa: SLF001
                                         np.zeros(cap, np.float32), np.zeros(cap, np.uint8), bmax, bratio, thr0)
    got = kk.wide_finish(cx, cv, m, ix._where, lt._SEG, ix._doc_len, *q, avgdl, k1, b)  # noqa: SLF001
    return got, int(listed), mx


def _ordered(got, ids, m):
    slots, scores = got
    o = top_k_order(scores, ids[slots], m)
    return slots[o], scores[o]


@pytest.mark.parametrize("make,seed,deletes,late", [(_topics, 0, 200, 150), (_stop_words, 1, 100, 300),
                                                    (_zipf, 2, 150, 0), (_ties, 3, 50, 50), (_topics, 4, 0, 0)])
def test_skipping_pass_equals_the_full_pass(make, seed, deletes, late):
    rng = np.random.default_rng(seed)
    n = 6000
    docs = make(rng, n)
    ix = _index(rng, docs, n - 1 - late, deletes, late)
    ids = np.array([f"c{s:05d}" for s in range(n)], dtype=object)
    w = wide_rows.WideRows(ix._seg, ix._doc_len)  # noqa: SLF001
    live = np.array([s for s in range(n) if ix.has_slot(s)], np.int64)
    skipped = scored = 0
    for q in range(40):
        terms, idf = _query(rng, ix, n, q)
        k1, b = float(rng.uniform(0.3, 2.5)), float(rng.choice([0.0, 1.0, rng.uniform(0, 1)]))
        avgdl, m = float(rng.uniform(4, 30)), int(rng.integers(1, 80))
        ref, ref_listed, ref_mx = _pass(ix, w, terms, idf, m, avgdl, k1, b, False, 0.0)
        want = _ordered(ref, ids, m)
        # starting thresholds: none, some live chunks' scores, the true top-m's (the highest allowed)
        top = want[0][:m]
        for at in (None, rng.choice(live, min(300, live.size), replace=False), top):
            thr0 = 0.0 if at is None else wide_rows.start(ix.score(at, terms, idf, avgdl, k1, b), m)
            got, listed, mx = _pass(ix, w, terms, idf, m, avgdl, k1, b, True, thr0)
            g = _ordered(got, ids, m)
            assert np.array_equal(g[0], want[0]) and g[1].tobytes() == want[1].tobytes(), (q, thr0)
            assert listed == ref_listed
            assert np.all(ref_mx[0] <= mx[1])  # every block's largest approximate score is under its noted bound
            assert np.all(mx[0] <= mx[1])
            skip = mx[1] > mx[0]
            assert np.array_equal(mx[0][~skip], ref_mx[0][~skip])  # a scored block notes its true maximum
            skipped, scored = skipped + int(skip.sum()), scored + int((~skip).sum())
    assert skipped > (0.2 if make is _topics else 0.0) * (skipped + scored), (skipped, scored)  # blocks are skipped


@pytest.mark.parametrize("k1,b", [(1.5, 0.75), (0.01, 0.5), (3.0, 0.0), (1.2, 1.0), (0.0, 0.3), (2.0, 0.99)])
def test_block_bounds_hold_for_the_wide_rows(k1, b):
    rng = np.random.default_rng(int(k1 * 100 + b * 10))
    n = 5000
    docs = _topics(rng, n)
    ix = _index(rng, docs, n - 1, 100, 0)
    w = wide_rows.WideRows(ix._seg, ix._doc_len)  # noqa: SLF001
    for q in range(25):
        terms, idf = _query(rng, ix, n, q)
        avgdl = float(rng.uniform(3, 40))
        (_, _), _, mx = _pass(ix, w, terms, idf, 10, avgdl, k1, b, False, 0.0, keep_narrow=False)
        tids = lt._query_arrays(ix, terms)[0]  # noqa: SLF001
        is_wide, row, _ = w.positions(tids)
        a0, a1 = k1 * (1.0 - b), k1 * b / avgdl
        ub = kk._bounds(w.bmax, w.bratio, row[is_wide], idf[is_wide].astype(np.float32), a0, a1, k1 + 1.0,  # noqa: SLF001
                        1.0 + 1e-6 * (int(is_wide.sum()) + 8))
        assert np.all(mx[0] <= ub), (q, float((mx[0] - ub).max()))


def test_fill_row_block_maxima():
    rng = np.random.default_rng(7)
    n = 3000
    ix = _index(rng, _topics(rng, n), n - 1, 0, 0)
    w = wide_rows.WideRows(ix._seg, ix._doc_len)  # noqa: SLF001
    seg = ix._seg  # noqa: SLF001
    terms = np.flatnonzero(w.row_of >= 0)
    assert terms.size >= 4
    w.positions(terms)
    dl = np.asarray(w.seg_len, np.float64)
    for t in terms.tolist():
        r = int(w.row_of[t])
        lo, hi = seg.offsets[t], seg.offsets[t + 1]
        x, tf = np.asarray(seg.slots[lo:hi], np.int64), np.asarray(seg.tf[lo:hi], np.float64)
        tmax, qmax = np.zeros(w.bmax.shape[1]), np.zeros(w.bmax.shape[1])
        np.maximum.at(tmax, x // SUB, tf)
        np.maximum.at(qmax, x // SUB, tf / dl[x])
        assert np.array_equal(w.bmax[r], tmax.astype(np.uint8))
        assert np.all(w.bratio[r] >= qmax) and np.all(w.bratio[r] <= qmax * (1 + 1e-5))


def test_widening_from_a_skipping_pass_through_listed_top(monkeypatch):
    """As a shard calls it: the BM25 of the dense candidates first (the starting threshold), the
    pass kept for a widening round at 4m, both equal to the kernel that reads every list."""
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)
    monkeypatch.setattr(lt, "_WIDE_GAIN", 10 ** 6)
    seen = []
    real = kk.wide_pass
    monkeypatch.setattr(kk, "wide_pass", lambda *a: seen.append(real(*a)) or seen[-1])
    rng = np.random.default_rng(11)
    n = 8000
    docs = _topics(rng, n)
    ix = _index(rng, docs, n - 1 - 200, 150, 200)
    ids = np.array([f"c{s:05d}" for s in range(n)], dtype=object)
    live = np.array([s for s in range(n) if ix.has_slot(s)], np.int64)
    lc = listed_cache.of(ix)
    for q in range(30):
        terms, idf = _query(rng, ix, n, q)
        if not (idf > 0).any():
            continue
        m = int(rng.integers(4, 40))
        at = rng.choice(live, 256, replace=False)
        for mm in (m, 4 * m):
            got = lt.listed_top_scored(ix, terms, idf, 12.0, 1.5, 0.75, mm, None, at,
                                       lambda: ix.score(at, terms, idf, 12.0, 1.5, 0.75), cache_version=q)
            fs, fsc, flisted = _full(ix, terms, idf, 12.0, 1.5, 0.75, mm)
            o, fo = top_k_order(got[1], ids[got[0]], mm), top_k_order(fsc, ids[fs], mm)
            assert np.array_equal(got[0][o], fs[fo]) and got[1][o].tobytes() == fsc[fo].tobytes(), (q, mm)
            assert got[2] == flisted
            assert got[3].tobytes() == ix.score(at, terms, idf, 12.0, 1.5, 0.75).tobytes()
        lc.entries.clear()
    assert seen and sum(int((mx[1] > mx[0]).sum()) for *_, mx, _ in seen) > 0
    assert lc.hits > 0  # the 4m rounds came from the kept pass
