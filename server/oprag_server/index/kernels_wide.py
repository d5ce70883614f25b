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

Measured at 500K chunks per shard (``bench.topm_probe``; bench/RESULTS.md): the BM25 top-64 of
SciFact queries under rank_bm25's idf floor in ~1/3 of MaxScore's time at p50 and ~1/6 at p95.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _JIT, _kth_largest
from .kernels_topm import _f, _probe
from .warm_inputs import postings_variants

#: a term is wide when its segment list holds at least span / WIDE_DIV postings
WIDE_DIV = 16
#: relative slack between float32 approximations and float64 thresholds
_APPROX = 1e-4
_BLOCK = 2048


@njit(**_JIT)
def fill_row(rows, r, t, offsets, pslots, ptf):
    """Write term ``t``'s segment term frequencies into ``rows[r]`` (all zero on entry).
    :returns: False (row left zero) when a tf exceeds 255."""
    lo, hi = offsets[t], offsets[t + 1]
    for p in range(lo, hi):
        if ptf[p] > 255:
            for q in range(lo, p):
                rows[r, np.int64(pslots[q])] = 0
            return False
        rows[r, np.int64(pslots[p])] = np.uint8(ptf[p])
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


@njit(**_JIT)
def bm25_top_wide(where, seg_code, doc_len, seg_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf,
                  is_wide, wide_row, rows, span, m, avgdl, k1, b, acc, seen):
    """The BM25 top-m of an unfiltered query with every ``idf >= 0`` (module docstring).

    Arguments as :func:`.kernels_topm.bm25_top_pruned`, plus ``seg_len`` (uint16 or float32[span]:
    the segment chunks' lengths), ``is_wide`` (bool[P]: position i's segment list is read from
    ``rows[wide_row[i]]``, uint8[R, span], not its postings) and ``span`` (the segment's last
    slot + 1). Scratch ``acc`` (float32[S]: partial scores of delta chunks past ``span``) / ``seen`` zero on
    entry and return.

    :returns: ``(slots int64[C], scores float64[C], listed)``: every chunk with a non-zero
        score at least the m-th largest (C >= min(m, listed)), and the exact listed count.
    """
    n_pos = tids.size
    one_b, k1p = 1.0 - b, k1 + 1.0
    a0, a1 = k1 * one_b, k1 * b / avgdl
    k1p32, a032, a132 = np.float32(k1p), np.float32(a0), np.float32(a1)
    total = 0
    nw = 0
    for i in range(n_pos):
        total += d_off[i + 1] - d_off[i]
        nw += is_wide[i]
    wide_pos, wrow = np.empty(nw, np.int64), np.empty(nw, np.int64)
    # (1) cursors into the narrow lists' segment postings and every term's delta postings (both
    # ascending by slot): the pass below adds each block's share to a block-sized scratch
    c = 0
    cur_s, end_s = np.empty(n_pos, np.int64), np.empty(n_pos, np.int64)
    cur_d = d_off[:n_pos].copy()
    w32n = np.empty(n_pos, np.float32)
    for i in range(n_pos):
        t = tids[i]
        if is_wide[i]:
            wide_pos[c], wrow[c] = i, wide_row[i]
            c += 1
        cur_s[i], end_s[i] = (offsets[t], offsets[t + 1]) if t >= 0 and not is_wide[i] else (0, 0)
        w32n[i] = np.float32(idf[i])
    # (2) the pass over the slots below span, block by block: the block's partial scores (the
    # narrow postings with the pass's float32 operations and the segment length copy, the delta
    # postings with score_all's), then the wide sums (float32) plus those; the threshold rises to
    # the m-th largest kept approximation whenever the buffer fills
    thr = 0.0
    cap = max(8 * m, 4096)
    bx, bv = np.empty(cap, np.int64), np.empty(cap, np.float64)
    nb = 0
    lim = 4 * m
    listed = 0
    w32 = w32n[wide_pos]
    s = np.empty(_BLOCK, np.float32)
    nrm = np.empty(_BLOCK, np.float32)
    la = np.zeros(_BLOCK, np.float32)
    bq = np.empty(_BLOCK + 1, np.int64)
    for base in range(0, span, _BLOCK):
        n = min(_BLOCK, span - base)
        for i in range(n_pos):
            cur_s[i] = _narrow(cur_s[i], end_s[i], base + n, base, pslots, ptf, where, seg_code, seg_len, w32n[i],
                               k1p32, a032, a132, la)
            p = cur_d[i]
            while p < d_off[i + 1] and d_slots[p] < base + n:
                x = d_slots[p]
                la[x - base] += _f(idf[i], d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
                p += 1
            cur_d[i] = p
        thr32 = np.float32(thr * (1.0 - 1e-7))  # rounded to float32 (<= 6e-8 up): still <= thr
        cnt, k = _block(rows, base, wrow, w32, k1p32, seg_len[base:base + n], where[base:base + n], la[:n], seg_code,
                        a0, a1, thr32, s[:n], nrm[:n], bq)
        listed += cnt
        for j in range(k):  # appended (the hot loops are in _block: no array reassigned there)
            q = bq[j]
            if s[q] < thr:
                continue
            if nb == bx.size:
                nb, thr = _compact(bx, bv, nb, m, thr)
                if nb * 2 > bx.size:  # ties at the threshold: grow
                    bx2, bv2 = np.empty(bx.size * 2, np.int64), np.empty(bx.size * 2, np.float64)
                    bx2[:nb], bv2[:nb] = bx[:nb], bv[:nb]
                    bx, bv = bx2, bv2
            bx[nb], bv[nb] = base + q, np.float64(s[q])
            nb += 1
        if nb >= lim:  # keep the threshold near the m-th largest so far: most blocks then pick nothing
            nb, thr = _compact(bx, bv, nb, m, thr)
            lim = max(4 * m, 2 * nb)
    # the delta postings past span (chunks added since the segment) into ``acc``, those chunks noted
    past = np.empty(total, np.int64)
    npast = 0
    for i in range(n_pos):
        for p in range(cur_d[i], d_off[i + 1]):
            x = d_slots[p]
            acc[x] += _f(idf[i], d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
            if seen[x] == 0:
                seen[x] = 1
                past[npast] = x
                npast += 1
    # (3) candidates: the kept chunks and the delta chunks past span
    nc = nb
    for j in range(npast):
        nc += acc[past[j]] != 0.0
    cx, cv = np.empty(nc, np.int64), np.empty(nc, np.float64)
    c = 0
    for j in range(nb):
        cx[c], cv[c] = bx[j], bv[j]
        c += 1
    for j in range(npast):
        x = past[j]
        if acc[x] != 0.0:
            cx[c], cv[c] = x, np.float64(acc[x])
            c += 1
        acc[x], seen[x] = 0.0, 0
    listed += c - nb
    if c > m:
        th = _kth_largest(cv, m) * (1.0 - _APPROX)
        keep = np.flatnonzero(cv >= th)
        cx = cx[keep]
    ex = np.zeros(cx.size, np.float64)
    for i in range(n_pos):
        for j in range(cx.size):
            x = cx[j]
            if is_wide[i]:  # the row holds the segment posting's tf (a binary search of a long list costs ~20 misses)
                tf = rows[wide_row[i], x] if x < span and where[x] == seg_code else 0
                if tf > 0:
                    ex[j] += _f(idf[i], np.float64(tf), doc_len[x], avgdl, k1, b, one_b, k1p)
                    continue
                v, hit = _probe(i, idf[i], -1, x, offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code,
                                doc_len, avgdl, k1, b)
            else:
                v, hit = _probe(i, idf[i], tids[i], x, offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code,
                                doc_len, avgdl, k1, b)
            if hit:
                ex[j] += v
    keep = np.flatnonzero(ex != 0.0)
    cx, ex = cx[keep], ex[keep]
    if cx.size <= m:
        return cx, ex, listed
    sel = np.flatnonzero(ex >= _kth_largest(ex, m))
    return cx[sel], ex[sel], listed


def warm() -> None:
    """Compile (or load from numba's cache) the signatures a shard passes."""
    s = np.arange(3, dtype=np.int64)
    for _, (where, doc_len, off, ps, tf) in postings_variants():
        rows = np.zeros((1, 3), np.uint8)
        fill_row(rows, 0, 0, off, ps, tf)
        for dl in (doc_len.astype(np.uint16),):  # (float32 lengths, above 65,535 tokens: compiled when met)
            bm25_top_wide(where, 1, doc_len, dl, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                          s, doc_len, np.ones(1, np.bool_), np.zeros(1, np.int64), rows, 3, 2, 1.0, 1.5, 0.75,
                          np.zeros(3, np.float32), np.zeros(3, np.uint8))
