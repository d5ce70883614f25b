"""Compiled BM25 over every posting of the query terms (numba): a shard's full BM25 top-m
(:func:`bm25_listed_top`, the path of queries with few postings; with the BM25 of given chunks
read from the same accumulator: a hybrid query's dense candidates) and exact mode's BM25 of every
chunk (:func:`bm25_at`, ``full_hybrid``: :meth:`..shards.exact.ExactMixin._exact_scores`).

Both are :meth:`.bm25.postings.PostingsIndex.score_all`'s values bit for bit: per chunk one
addition per query position ``i``, in query order, from 0.0, of ``idf[i] * (tf * (k1 + 1) / (tf +
k1 * (1 - b + b * doc_len / avgdl)))``, the operations of its numpy expression (rank_bm25's
``get_scores`` values). The numpy path stays the reference they are tested against
(``tests/unit/test_kernels.py``, ``tests/unit/test_kernels_exact.py``).

Arguments shared by the kernels: ``tids`` int64[T], the segment term id per query position (-1:
none); ``offsets`` int64[V+1], ``pslots`` int32[P], ``ptf`` uint16/uint32[P]: the CSR segment (a
posting is live where ``where[slot] == seg_code``); ``d_off`` int64[T+1], ``d_slots`` int64[Q],
``d_tf`` float64[Q]: per query position the live postings of the delta layers (a chunk is in the
segment or in one layer). Every slot is below ``doc_len.size``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _JIT, _kth_largest


@njit(**_JIT)
def _accumulate(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, avgdl, k1, b,
                acc, seen, touched, norm, t1):
    """Add every live posting's term weight to float64 ``acc[slot]`` (module docstring); with a
    non-empty int64 ``touched``, also list each slot first reached there (``seen`` uint8 marks).
    With non-empty ``norm`` and ``t1`` (:func:`bm25_norms` of these ``doc_len``, ``avgdl``,
    ``k1``, ``b``) a posting reads its chunk's length normaliser from ``norm`` and, when its
    term frequency is 1, its whole weight factor from ``t1``: the same operations on the same
    values, done once per chunk instead of once per posting (two divisions each).
    :returns: how many slots were listed."""
    track = touched.size > 0
    pre = norm.size > 0
    nt = 0
    one_b, k1p = 1.0 - b, k1 + 1.0
    for i in range(tids.size):
        w, t = idf[i], tids[i]
        for layer in range(2):
            lo, hi = (offsets[t], offsets[t + 1]) if layer == 0 and t >= 0 else (0, 0)
            if layer == 1:
                lo, hi = d_off[i], d_off[i + 1]
            for p in range(lo, hi):
                if layer == 0:
                    x = np.int64(pslots[p])
                    if where[x] != seg_code:
                        continue
                    tf = np.float64(ptf[p])
                else:
                    x, tf = d_slots[p], d_tf[p]
                if pre:
                    if tf == 1.0:
                        acc[x] += w * t1[x]
                    else:
                        acc[x] += w * (tf * k1p / (tf + norm[x]))
                else:
                    nm = k1 * (one_b + b * doc_len[x] / avgdl)
                    acc[x] += w * (tf * k1p / (tf + nm))
                if track and seen[x] == 0:
                    seen[x] = 1
                    touched[nt] = x
                    nt += 1
    return nt


@njit(**_JIT)
def bm25_norms(doc_len, avgdl, k1, b):
    """Per chunk of float64[S] ``doc_len``: ``(norm, t1)`` float64[S], its length normaliser
    ``k1 * (1 - b + b * doc_len / avgdl)`` and the weight factor of a term frequency of 1,
    ``1 * (k1 + 1) / (1 + norm)``: the operations :func:`_accumulate` does per posting, in
    the same order (so the same values bit for bit), for :func:`bm25_listed_top_pre`."""
    n = doc_len.size
    norm = np.empty(n, np.float64)
    t1 = np.empty(n, np.float64)
    one_b, k1p = 1.0 - b, k1 + 1.0
    for x in range(n):
        nm = k1 * (one_b + b * doc_len[x] / avgdl)
        norm[x] = nm
        t1[x] = 1.0 * k1p / (1.0 + nm)
    return norm, t1


@njit(**_JIT)
def bm25_listed_top(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, allowed,
                    every, m, avgdl, k1, b, at):
    """:func:`bm25_listed_top_pre` computing each posting's weight from ``doc_len`` (no
    per-chunk factors)."""
    e = np.zeros(0, np.float64)
    return bm25_listed_top_pre(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf,
                               allowed, every, m, avgdl, k1, b, at, e, e)


@njit(**_JIT)
def bm25_listed_top_pre(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, allowed,
                        every, m, avgdl, k1, b, at, norm, t1):
    """BM25 of every chunk holding a query term, the listed ones (score != 0) of the allowed
    chunks, and those that can be in their top-m.

    :param allowed: int64[A] sorted allowed slots (read unless ``every``).
    :param at: int64[C] slots whose score is also returned (any order; may be empty).
    :returns: ``(slots int64[K], scores float64[K], listed, at_scores float64[C])``: every listed
        allowed chunk whose score is >= the m-th largest (K >= min(m, listed); ties are the
        caller's, by chunk id), how many listed allowed chunks there are, and the score of each
        slot of ``at`` (0.0 for one holding no query term).
    :param norm, t1: :func:`bm25_norms` of ``doc_len``, ``avgdl``, ``k1``, ``b`` (both empty:
        computed per posting; the same scores).
    """
    cap = doc_len.size
    acc = np.zeros(cap, np.float64)
    n_post = d_slots.size
    for t in tids:
        if t >= 0:
            n_post += offsets[t + 1] - offsets[t]
    # many postings for the shard's size: no first-touch list (a branch per posting that
    # mispredicts); every slot is read afterwards instead (a chunk not reached scores 0.0)
    scan = 4 * n_post >= cap
    seen = np.zeros(0 if scan else cap, np.uint8)
    touched = np.empty(0 if scan else max(cap, 1), np.int64)  # (each slot is listed once: seen)
    nt = _accumulate(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, avgdl, k1, b,
                     acc, seen, touched, norm, t1)
    if scan:
        nt = cap
    at_sc = np.empty(at.size, np.float64)
    for j in range(at.size):
        at_sc[j] = acc[at[j]]
    keep = np.empty(nt, np.int64)
    c = 0
    for j in range(nt):
        x = j if scan else touched[j]
        if acc[x] != 0.0:
            if not every:
                pos = np.searchsorted(allowed, x)
                if pos >= allowed.size or allowed[pos] != x:
                    continue
            keep[c] = x
            c += 1
    keep, sc = keep[:c], acc[keep[:c]]
    if c <= m:
        return keep, sc, c, at_sc
    sel = np.flatnonzero(sc >= _kth_largest(sc, m))
    return keep[sel], sc[sel], c, at_sc


@njit(**_JIT)
def bm25_at(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, at, avgdl, k1, b):
    """float64[A]: the BM25 score of each slot of int64[A] ``at`` (0.0 for a chunk holding no
    query term, or not live)."""
    acc = np.zeros(doc_len.size, np.float64)
    e = np.zeros(0, np.float64)
    _accumulate(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, avgdl, k1, b,
                acc, np.zeros(0, np.uint8), np.zeros(0, np.int64), e, e)
    out = np.empty(at.size, np.float64)
    for j in range(at.size):
        out[j] = acc[at[j]]
    return out


def warm() -> None:
    """Compile (or load from numba's cache) both kernels for the postings types a shard passes
    (:func:`.warm_inputs.postings_variants`)."""
    from .warm_inputs import postings_variants  # noqa: PLC0415

    s = np.arange(3, dtype=np.int64)
    for ro, (where, doc_len, off, ps, tf) in postings_variants():
        bm25_listed_top(where, 1, doc_len, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                        s, doc_len, s, ro, 2, 1.0, 1.5, 0.75, s)
        bm25_at(where, 1, doc_len, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                s, doc_len, s, 1.0, 1.5, 0.75)
        norm, t1 = bm25_norms(doc_len, 1.0, 1.5, 0.75)
        bm25_listed_top_pre(where, 1, doc_len, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                            s, doc_len, s, ro, 2, 1.0, 1.5, 0.75, s, norm, t1)
