"""A shard's BM25 top-m with MaxScore pruning (Turtle & Flood 1995, "Query evaluation:
strategies and optimizations", the max-score method): the same result as
:func:`.kernels_exact.bm25_listed_top` for an unfiltered query whose idf are all >= 0, without
reading the postings of the query's common terms in full.

Each query position ``i`` has an upper bound ``ub[i]`` on one chunk's BM25 contribution:
``idf[i] * f(max tf, min doc length)`` of its postings, where ``f(tf, dl) = tf * (k1 + 1) /
(tf + k1 * (1 - b + b * dl / avgdl))`` rises with ``tf`` and falls with ``dl``. Lists are read
whole in order of decreasing bound, accumulating partial scores. After each list, with
``theta`` the m-th largest partial score and ``R`` the sum of the bounds of the lists not yet
read, a chunk in none of the lists read scores at most ``R``; once ``R < theta`` no such chunk
can reach the top-m, so the remaining lists are only probed (binary search) for the chunks
whose partial score plus ``R`` reaches ``theta``. Every candidate's score is then computed again
from scratch in query-term order, the operations of ``PostingsIndex.score_all`` (rank_bm25's
values), so the scores returned are bit-for-bit those of :func:`.kernels_exact.bm25_listed_top`.

The ``listed`` count (chunks with a non-zero score) is exact when every list was read. After a
cut it is the largest of the chunks seen, the longest list's live postings and ``m + 1``: "the
top-m is not the whole list", which keeps the threshold bound of dense-first hybrid
(:mod:`oprag_server.operators.hybrid`) an upper bound. It can then say "some chunk scores 0"
when every chunk in fact holds a query term but no single term is in all of them; exact mode's
BM25 normalisation range then starts at 0 where it would start at the lowest score.

Scratch arrays (``acc`` float64, ``seen`` uint8, one entry per slot) are the caller's, all zero
on entry and left so on return, so that a query does not allocate and fault in megabytes of
zeroed pages. The per-term bounds are computed the first time a query uses the term (one pass
over its list) and kept by the caller until the segment is replaced.

Lists are cut only when probing is cheaper: when the candidates times the unread lists, times a
binary search's cost (counted as 6 postings read; chosen at 500K chunks per shard), is below the
unread lists' postings. The unread lists are probed one at a time, in order of decreasing bound, and after each one the
candidates that can no longer reach the m-th partial score are dropped.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _JIT, _kth_largest
from .warm_inputs import postings_variants

#: relative slack on bounds and thresholds, far above float64 rounding of a sum of <= 10^3 terms
_SLACK = 1e-9


@njit(**_JIT)
def _f(w, tf, dl, avgdl, k1, b, one_b, k1p):
    """One posting's contribution, the operations of ``PostingsIndex.score_all``."""
    norm = k1 * (one_b + b * dl / avgdl)
    return w * (tf * k1p / (tf + norm))


@njit(**_JIT)
def _term_bounds(t, offsets, pslots, ptf, where, seg_code, doc_len, seg_maxtf, seg_mindl):
    """Fill ``seg_maxtf[t]`` (max tf over the term's postings) and ``seg_mindl[t]`` (min doc
    length over its live postings; ``inf`` when none) if not yet known (NaN): once per term and
    segment, as a live segment posting's chunk keeps its length until the segment is replaced."""
    if not np.isnan(seg_maxtf[t]):
        return
    a, z = 0.0, np.inf
    for p in range(offsets[t], offsets[t + 1]):
        tf = np.float64(ptf[p])
        if tf > a:
            a = tf
        x = np.int64(pslots[p])
        if where[x] == seg_code and doc_len[x] < z:
            z = doc_len[x]
    seg_mindl[t] = z
    seg_maxtf[t] = a


@njit(**_JIT)
def _find(slots, lo, hi, x):
    """Position of ``x`` in the ascending ``slots[lo:hi]``, or -1."""
    end = hi
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(slots[mid]) < x:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < end and np.int64(slots[lo]) == x else -1


@njit(**_JIT)
def _read(i, w, t, offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code, doc_len, avgdl, k1, b, acc, seen,
          touched, nt):
    """Add position ``i``'s whole list (segment + delta) to the partial scores; returns the new
    count of touched chunks and the largest partial score it produced."""
    one_b, k1p = 1.0 - b, k1 + 1.0
    best = 0.0
    lo, hi = (offsets[t], offsets[t + 1]) if t >= 0 else (0, 0)
    for p in range(lo, hi):
        x = np.int64(pslots[p])
        if where[x] != seg_code:
            continue
        acc[x] += _f(w, np.float64(ptf[p]), doc_len[x], avgdl, k1, b, one_b, k1p)
        best = max(best, acc[x])
        if seen[x] == 0:
            seen[x] = 1
            touched[nt] = x
            nt += 1
    for p in range(d_off[i], d_off[i + 1]):
        x = d_slots[p]
        acc[x] += _f(w, d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
        best = max(best, acc[x])
        if seen[x] == 0:
            seen[x] = 1
            touched[nt] = x
            nt += 1
    return nt, best


@njit(**_JIT)
def _probe(i, w, t, x, offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code, doc_len, avgdl, k1, b):
    """Position ``i``'s contribution to chunk ``x`` and whether ``x`` is in its list: binary
    searches of the segment list and of the delta list (ascending per position)."""
    if t >= 0 and where[x] == seg_code:
        p = _find(pslots, offsets[t], offsets[t + 1], x)
        if p >= 0:
            return _f(w, np.float64(ptf[p]), doc_len[x], avgdl, k1, b, 1.0 - b, k1 + 1.0), True
    p = _find(d_slots, d_off[i], d_off[i + 1], x)
    if p >= 0:
        return _f(w, d_tf[p], doc_len[x], avgdl, k1, b, 1.0 - b, k1 + 1.0), True
    return 0.0, False


@njit(**_JIT)
def bm25_top_pruned(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf,
                    seg_maxtf, seg_mindl, seg_df, m, avgdl, k1, b, acc, seen):
    """:func:`.kernels_exact.bm25_listed_top` of an unfiltered query with every ``idf >= 0`` (module
    docstring). Arguments as there, plus the per-term bounds ``seg_maxtf``, ``seg_mindl``
    (float64[V], NaN until :func:`_term_bounds` fills them), ``seg_df`` (live postings per
    segment term) and the scratch ``acc`` float64[S] / ``seen`` uint8[S] (zero on entry and
    on return).

    :returns: ``(slots int64[C], scores float64[C], listed, cut)``: every chunk with a non-zero
        score at least the m-th largest (C >= min(m, listed)), the listed count (exact unless
        ``cut``) and whether lists were left unread (only probed).
    """
    n_pos = tids.size
    one_b, k1p = 1.0 - b, k1 + 1.0
    ub = np.zeros(n_pos, np.float64)
    length = np.zeros(n_pos, np.int64)
    total, listed_lb = 0, 0
    for i in range(n_pos):
        t, w = tids[i], idf[i]
        mt, md, live = 0.0, np.inf, 0
        if t >= 0:
            _term_bounds(t, offsets, pslots, ptf, where, seg_code, doc_len, seg_maxtf, seg_mindl)
            mt, md, live = seg_maxtf[t], seg_mindl[t], np.int64(seg_df[t])
            length[i] = offsets[t + 1] - offsets[t]
        for p in range(d_off[i], d_off[i + 1]):
            mt = max(mt, d_tf[p])
            md = min(md, doc_len[d_slots[p]])
        length[i] += d_off[i + 1] - d_off[i]
        live += d_off[i + 1] - d_off[i]
        total += length[i]
        if w > 0.0 and mt > 0.0:
            ub[i] = _f(w, mt, min(md, 1e300), avgdl, k1, b, one_b, k1p) * (1.0 + _SLACK)
            listed_lb = max(listed_lb, live)
    order = np.argsort(-ub)
    rest = np.zeros(n_pos + 1, np.float64)  # rest[k]: bounds of order[k:]
    left = np.zeros(n_pos + 1, np.int64)    # left[k]: postings of order[k:]
    for k in range(n_pos - 1, -1, -1):
        rest[k] = rest[k + 1] + ub[order[k]]
        left[k] = left[k + 1] + length[order[k]]
    touched = np.empty(total, np.int64)
    nt, best, read = 0, 0.0, n_pos
    cand = np.empty(0, np.int64)
    part = np.empty(0, np.float64)
    # theta_up bounds the m-th largest partial score: the last one computed plus the bounds of
    # the lists read since (a chunk's partial score grows by at most ub[i] per list), so the
    # O(touched) selection is skipped while no cut is possible (common lists, low idf floor)
    theta_up = np.inf
    for k in range(n_pos):
        i = order[k]
        nt, bk = _read(i, idf[i], tids[i], offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code, doc_len,
                       avgdl, k1, b, acc, seen, touched, nt)
        best = max(best, bk)
        theta_up += ub[i]
        r = rest[k + 1]
        if k + 1 < n_pos and nt >= m and r * (1.0 + _SLACK) < best and theta_up * (1.0 + _SLACK) > r:
            vals = np.empty(nt, np.float64)
            for j in range(nt):
                vals[j] = acc[touched[j]]
            theta = _kth_largest(vals, m)
            theta_up = theta
            floor = theta - _SLACK * (theta + r) - r
            if theta <= 0.0 or r * (1.0 + _SLACK) >= theta * (1.0 - _SLACK):
                continue
            nc = 0
            for j in range(nt):
                nc += vals[j] >= floor
            # probing the unread lists for nc chunks, against reading them whole
            if nc * (n_pos - k - 1) * 6 < left[k + 1]:
                cand, part = np.empty(nc, np.int64), np.empty(nc, np.float64)
                c = 0
                for j in range(nt):
                    if vals[j] >= floor:
                        cand[c], part[c] = touched[j], vals[j]
                        c += 1
                read = k + 1
                break
    cut = read < n_pos
    n_listed = 0
    for j in range(nt):
        n_listed += acc[touched[j]] != 0.0
    if not cut:  # every list read: the partial scores are the scores (up to rounding)
        theta = -np.inf
        if n_listed > m:
            vals = np.empty(n_listed, np.float64)
            c = 0
            for j in range(nt):
                if acc[touched[j]] != 0.0:
                    vals[c] = acc[touched[j]]
                    c += 1
            theta = _kth_largest(vals, m)
            theta -= _SLACK * abs(theta)
        c = 0
        cand = np.empty(nt, np.int64)
        for j in range(nt):
            x = touched[j]
            if acc[x] != 0.0 and acc[x] >= theta:
                cand[c] = x
                c += 1
        cand = cand[:c]
    for j in range(nt):
        acc[touched[j]], seen[touched[j]] = 0.0, 0
    if cut:
        # the unread lists, probed for the candidates; a candidate that can no longer reach the
        # m-th partial score is dropped after each list
        for k in range(read, n_pos):
            i = order[k]
            for j in range(cand.size):
                v, _ = _probe(i, idf[i], tids[i], cand[j], offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code,
                              doc_len, avgdl, k1, b)
                part[j] += v
            r = rest[k + 1]
            if cand.size > m:
                theta = _kth_largest(part, m)
                keep = part >= theta - _SLACK * (theta + r) - r
                cand, part = cand[keep], part[keep]
    # exact scores of the candidates, from 0.0 in query-term order (score_all's operations)
    ex = np.zeros(cand.size, np.float64)
    for i in range(n_pos):
        for j in range(cand.size):
            v, hit = _probe(i, idf[i], tids[i], cand[j], offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code,
                            doc_len, avgdl, k1, b)
            if hit:
                ex[j] += v
    keep = np.flatnonzero(ex != 0.0)
    cand, ex = cand[keep], ex[keep]
    listed = max(n_listed, listed_lb, m + 1) if cut else n_listed
    if cand.size <= m:
        return cand, ex, listed, cut
    sel = np.flatnonzero(ex >= _kth_largest(ex, m))
    return cand[sel], ex[sel], listed, cut


def warm() -> None:
    """Compile (or load from numba's cache) the signatures a shard passes (writable and
    read-only postings, uint16 term frequencies)."""
    s = np.arange(3, dtype=np.int64)
    for _, (where, doc_len, off, ps, tf) in postings_variants():
        mt, md = np.full(1, np.nan), np.full(1, np.nan)
        _term_bounds(0, off, ps, tf, where, 1, doc_len, mt, md)  # (called alone by a merge's thread: listed_top.successor)
        mt[:], md[:] = np.nan, np.nan
        bm25_top_pruned(where, 1, doc_len, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                        s, doc_len, mt, md, np.ones(1, np.int32), 2, 1.0, 1.5, 0.75, np.zeros(3), np.zeros(3, np.uint8))
