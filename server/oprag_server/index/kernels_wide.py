"""A shard's BM25 top-m when some query terms are in a large part of the segment (rank_bm25's
idf floor gives every term with df > N/2 the same positive weight, ~1.8 on SciFact + WikiText,
so "the", "of", "in" can no longer be left unread by MaxScore, :mod:`.kernels_topm`): the same
result as :func:`.kernels_exact.bm25_listed_top` for an unfiltered query whose idf are all >= 0.

Layout: a *wide* term (``df >= span / WIDE_DIV`` in the segment, max tf <= 255) gets a dense
``uint8[span]`` row of its term frequencies by slot (0 where absent), built from its postings
the first time a query uses it and kept until the segment is replaced
(:class:`.bm25.listed_top._Scratch`); the rows live in one ``calloc``'d ``uint8[R, span]`` array,
so rows never used cost no memory. ``span`` is the segment's last slot + 1.

Query: one pass over the slots below ``span`` in blocks of :data:`_BLOCK`. For each block, (1) the
other ("narrow") lists' segment postings in the block (each list is ascending by slot: one
cursor per list) are added to a block-sized float32 scratch with the pass's float32 operations
(the lengths from the uint16 segment copy), and every term's delta-layer postings in the block
with ``score_all``'s; (2) the block computes, for every slot, the wide terms' sum in float32
(contiguous rows, vectorised: numpy's error model, no per-posting branches) plus its partial
score, clears the partial score, counts the non-zero scores, and keeps the slots whose
approximate score reaches the threshold, raising it to the m-th largest of what it kept whenever
its buffer fills. The partial scores are streamed with the rows rather than looked up per
touched chunk (a random read of each wide row per chunk cost ~10x the pass at 500K chunks), and
they never leave the cache (a per-slot scratch over the whole segment, written at random and
read back by the pass, cost ~5% more at 500K chunks); only delta postings past ``span`` go to
the per-slot scratch ``acc``. After the pass,
the delta chunks past ``span`` (added since the segment) join the candidates; every
candidate whose approximate score reaches the final threshold (relative slack :data:`_APPROX`,
far above float32 rounding of a sum of a few hundred terms) is scored again from 0.0 in
query-term order with the operations of ``PostingsIndex.score_all`` (rank_bm25's values, bit
for bit), and the top-m of those exact scores is returned. Every list is in effect read, so
``listed`` (the chunks with a non-zero score) is exact.

Block bounds (:func:`.kernels_wide_keep.wide_pass`): each row also keeps, per :data:`SUB` slots,
its largest tf and largest tf / dl (:func:`fill_row`), which bound every slot's term there
whatever k1, b and avgdl (:func:`.kernels_wide_keep._bounds`). The pass starts from a lower bound
of the m-th largest score (the dense candidates' BM25, computed before it) and skips a block of
:data:`SUB` slots whose bound plus its largest narrow/delta partial score is below the running
threshold: it only counts the block's non-zero scores (a read of the rows, no arithmetic). At 500K
chunks a shard, SciFact queries: ~50-70% of the blocks skipped, ~0.17 ms less per shard search
(bench/RESULTS.md, session 45); the result is the same list, bit for bit.

Measured at 500K chunks per shard (``bench.topm_probe``; bench/RESULTS.md): the BM25 top-64 of
SciFact queries under rank_bm25's idf floor in ~1/3 of MaxScore's time at p50 and ~1/6 at p95.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _JIT, _kth_largest
from .warm_inputs import postings_variants

#: a term is wide when its segment list holds at least span / WIDE_DIV postings
WIDE_DIV = 16
#: relative slack between float32 approximations and float64 thresholds
_APPROX = 1e-4
_BLOCK = 2048
#: slots per block of the pass's bounds and noted maxima (:mod:`.kernels_wide_keep`; divides _BLOCK)
SUB = 128


@njit(**_JIT)
def fill_row(rows, bmax, bratio, r, t, offsets, pslots, ptf, seg_len):
    """Write term ``t``'s segment term frequencies into ``rows[r]``, and per :data:`SUB` slots
    the largest of them into ``bmax[r]`` (uint8) and the largest tf / dl into ``bratio[r]``
    (float32, ``dl`` from ``seg_len``; rounded up), all zero on entry
    (:func:`.kernels_wide_keep._bounds`). :returns: False (all left zero) when a tf exceeds 255."""
    lo, hi = offsets[t], offsets[t + 1]
    for p in range(lo, hi):
        if ptf[p] > 255:
            for q in range(lo, p):
                rows[r, np.int64(pslots[q])] = 0
            bmax[r, :] = 0
            bratio[r, :] = 0.0
            return False
        x = np.int64(pslots[p])
        v = np.uint8(ptf[p])
        rows[r, x] = v
        g = x // SUB
        if bmax[r, g] < v:
            bmax[r, g] = v
        dl = np.float64(seg_len[x])
        q = np.float32(np.float64(v) / dl * (1.0 + 1e-6)) if dl > 0.0 else np.float32(np.inf)
        if bratio[r, g] < q:
            bratio[r, g] = q
    return True


@njit(inline="always", error_model="numpy")
def _norm32(a0, a1, dl):
    """The float32 length normalisation ``k1 * (1 - b + b * dl / avgdl)`` as ``a0 + a1 * dl``,
    floored at 1e-30 (never a 0 denominator)."""
    return max(a0 + a1 * np.float32(dl), np.float32(1e-30))


@njit(inline="always", error_model="numpy")
def _term32(w, t, k1p, nv):
    """One posting's float32 contribution (``t`` its tf as float32, ``nv`` :func:`_norm32`)."""
    return w * (t * k1p / (t + nv))


@njit(cache=True, nogil=True, error_model="numpy")
def _block(rows, base, wrow, w32, k1p32, dl, wh, a, seg_code, a0, a1, thr32, sv, nv, bq):
    """One block of the pass (slots ``base`` on; ``dl``, ``wh``, ``a`` are that block's lengths,
    layer codes and partial scores, all >= 0): ``sv`` = the wide terms' float32 sum per slot (0
    outside the segment) plus the partial score, and ``a`` zeroed; returns the count of non-zero
    scores and ``k``, with ``bq[:k]`` the slots whose score reaches ``thr32`` (float32, at most
    the float64 threshold). numpy's error model (no ZeroDivisionError check) lets LLVM vectorise
    the divisions; a denominator is never 0 (:func:`_norm32` is floored at 1e-30, a tf is >= 0)."""
    n = sv.size
    for q in range(n):
        nv[q] = _norm32(np.float32(a0), np.float32(a1), dl[q])
        sv[q] = np.float32(0.0)
    for j in range(wrow.size):
        row = rows[wrow[j], base:base + n]
        w = w32[j]
        for q in range(n):
            sv[q] += _term32(w, np.float32(row[q]), k1p32, nv[q])
    # branch-free from here on: a slot's non-zero score is a coin toss the branch predictor
    # loses (~1.5 ms of a 500K-slot pass with branches)
    cnt = 0
    hit = 0
    for q in range(n):
        v = sv[q] * np.float32(wh[q] == seg_code) + a[q]  # wide terms: segment chunks only
        sv[q] = v
        a[q] = np.float32(0.0)  # the scratch is zero again once the pass is by
        cnt += np.int32(v > np.float32(0.0))
        hit += np.int32(v >= thr32)  # a count, not a running maximum: the loop stays vectorised
    k = 0
    if hit == 0:  # most blocks once the threshold has risen: nothing to pick
        return cnt, k
    for q in range(n):  # bq has n + 1 entries
        bq[k] = q
        k += (sv[q] >= thr32) & (sv[q] > np.float32(0.0))
    return cnt, k


@njit(cache=True, nogil=True, error_model="numpy")
def _narrow(p, hi, stop, base, pslots, ptf, where, seg_code, seg_len, w, k1p, a0, a1, la):
    """Add one term's (weight ``w``) segment postings from ``p`` on, below ``hi`` and at slots below
    ``stop``, to the block scratch ``la`` (slot ``base`` at 0), with the pass's float32
    operations (:func:`_norm32`, :func:`_term32`) and the segment length copy; returns the next
    posting."""
    while p < hi and pslots[p] < stop:
        x = np.int64(pslots[p])
        if where[x] == seg_code:
            la[x - base] += _term32(w, np.float32(ptf[p]), k1p, _norm32(a0, a1, seg_len[x]))
        p += 1
    return p


@njit(**_JIT)
def _compact(bx, bv, nb, m, thr):
    """Raise ``thr`` to the m-th largest of ``bv[:nb]`` (less the slack) and keep the entries
    at or above it; returns ``(nb, thr)``."""
    if nb >= m:
        th = _kth_largest(bv[:nb], m) * (1.0 - _APPROX)
        if th > thr:
            thr = th
    c = 0
    for j in range(nb):
        if bv[j] >= thr:
            bx[c], bv[c] = bx[j], bv[j]
            c += 1
    return c, thr


_NO_BOUNDS = (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.float32))


def bm25_top_wide(where, seg_code, doc_len, seg_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf,
                  is_wide, wide_row, rows, span, m, avgdl, k1, b, acc, seen, bmax=None, bratio=None, thr0=0.0):
    """The BM25 top-m of an unfiltered query with every ``idf >= 0`` (module docstring).

    Arguments as :func:`.kernels_topm.bm25_top_pruned`, plus ``seg_len`` (uint16 or float32[span]:
    the segment chunks' lengths), ``is_wide`` (bool[P]: position i's segment list is read from
    ``rows[wide_row[i]]``, uint8[R, span], not its postings) and ``span`` (the segment's last
    slot + 1). Scratch ``acc`` (float32[S]: partial scores of delta chunks past ``span``) / ``seen`` zero on
    entry and return.

    :returns: ``(slots int64[C], scores float64[C], listed)``: every chunk with a non-zero
        score at least the m-th largest (C >= min(m, listed)), and the exact listed count.

    The pass is :func:`.kernels_wide_keep.wide_pass` (steps 1-3; the block maxima it also notes
    are for a widening round, unused here) and the exact rescoring
    :func:`.kernels_wide_keep.wide_finish` (step 4): one compiled copy of each step.
    """
    from .kernels_wide_keep import wide_finish, wide_pass  # noqa: PLC0415 - it imports this module's block steps

    if bmax is None:
        bmax, bratio = _NO_BOUNDS
    cx, cv, listed, _, _ = wide_pass(where, seg_code, doc_len, seg_len, tids, idf, offsets, pslots, ptf, d_off,
                                     d_slots, d_tf, is_wide, wide_row, rows, span, m, avgdl, k1, b, acc, seen, bmax,
                                     bratio, float(thr0))
    slots, scores = wide_finish(cx, cv, m, where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots,
                                d_tf, is_wide, wide_row, rows, span, avgdl, k1, b)
    return slots, scores, listed


def warm() -> None:
    """Compile (or load from numba's cache) the signatures a shard passes."""
    s = np.arange(3, dtype=np.int64)
    for _, (where, doc_len, off, ps, tf) in postings_variants():
        rows = np.zeros((1, 3), np.uint8)
        fill_row(rows, np.zeros((1, 1), np.uint8), np.zeros((1, 1), np.float32), 0, 0, off, ps, tf,
                 doc_len.astype(np.uint16))
        for dl in (doc_len.astype(np.uint16),):  # (float32 lengths, above 65,535 tokens: compiled when met)
            bm25_top_wide(where, 1, doc_len, dl, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                          s, doc_len, np.ones(1, np.bool_), np.zeros(1, np.int64), rows, 3, 2, 1.0, 1.5, 0.75,
                          np.zeros(3, np.float32), np.zeros(3, np.uint8))
