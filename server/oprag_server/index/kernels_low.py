"""Compiled HNSW searches over an int8 copy of the graph's vectors (issue 13,
:class:`.dense_low.LowSeeds`): the dense minimum's bottom-layer search and the dense top-n's.

FAISS's ``IndexHNSW.search_level_0`` reads every vector it scores as D float32 (1.5 KB at D 384;
~0.9 ms per query at 500K vectors a shard, most of it memory traffic). :func:`low_search` walks the
same graph (FAISS's level-0 neighbour lists, read in place) the same way, but scores an int8 copy
(:func:`.kernels_scan.quantize`: per-row scale, codes in [-127, 127]; a quarter of the bytes).
Its scores are approximate, within the bound ``err`` of :func:`.kernels_scan.error_bound` of the
canonical ones: they steer the walk and choose which vectors get canonical scores afterwards (the
caller: those within ``2 err`` of the lowest approximate score kept, the k = 1 argument of
``refine_top``), so the value reported is still the exact lowest canonical score over a set of
real live vectors, never below the true minimum.

The walk is FAISS's (``search_level_0`` with ``search_type`` 1, ``HNSW::search_from_candidates``,
for the lowest score instead of the largest): one search per entry, in the order given, sharing
the visited marks; each keeps a pool of at most ``ef`` candidates whose expanded entries keep
their score (FAISS's ``MinimaxHeap``: a new score enters a full pool only below its largest, in
that one's place) and stops when ``ef`` of the pool's scores are below the one just taken, or the
pool has nothing left to expand. The live vectors scored (``ann_slot`` >= 0; dead ones are walked
through, never kept) go to a result pool of the ``ef`` lowest. Linear scans instead of heaps:
``ef`` is 16-64 here. ``stamp`` marks visited vectors with the call's ``mark`` (never cleared).

:func:`top_search` is the dense top-n's graph search on the same int8 copy (FAISS's
``IndexHNSW.search`` with an unbounded candidate queue: greedy descent of the upper levels, then a
level-0 search keeping the ``ef`` best live vectors, binary heaps). Its scores only steer the walk
and choose the ``ef`` vectors kept: the caller rescores those in float32
(:meth:`.dense_low.LowSeeds.top`), so what leaves it is FAISS's contract (float32 scores of real
live vectors, descending), and each top-n is still refined canonically by the shard. Which
vectors it finds differs from FAISS's walk on float32 scores by the int8 rounding (the recall of
the exact top-N is measured: bench/RESULTS.md, "the dense side on an int8 copy").
"""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from numba import njit  # noqa: E402

_FM = {"reassoc", "contract", "nsz"}  # as kernels_scan.scan: the sum in any order (its bound)


@njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _score(codes, scale, r, q):
    """``fl(sum_j codes[r, j] q[j]) * scale[r]`` (:func:`.kernels_scan.scan` for one row)."""
    acc = np.float32(0.0)
    for j in range(codes.shape[1]):
        acc += np.float32(codes[r, j]) * q[j]
    return acc * scale[r]


@njit(cache=True, nogil=True, inline="always")
def _keep(r, d, ri, rd, nr, ef):
    """Put vector r of score d into the result pool ``ri`` / ``rd`` (``nr`` held; full: in place of
    its largest score, if d is lower). :returns: the new ``nr``."""
    if nr < ef:
        rd[nr], ri[nr] = d, r
        return nr + 1
    w = 0
    for t in range(1, nr):
        if rd[t] > rd[w]:
            w = t
    if d < rd[w]:
        rd[w], ri[w] = d, r
    return nr


@njit(cache=True, nogil=True, inline="always")
def _cand(r, d, cd, ci, cv, n, nvalid, ef):
    """FAISS's ``MinimaxHeap::push`` for the lowest score: :returns: ``(n, nvalid)``."""
    if n < ef:
        cd[n], ci[n], cv[n] = d, r, True
        return n + 1, nvalid + 1
    w = 0
    for t in range(1, n):
        if cd[t] > cd[w]:
            w = t
    if d >= cd[w]:
        return n, nvalid
    if not cv[w]:
        nvalid += 1
    cd[w], ci[w], cv[w] = d, r, True
    return n, nvalid


@njit(cache=True, nogil=True, fastmath=_FM)
def low_search(nbr, offsets, width, codes, scale, ann_slot, q, entries, ef, stamp, mark, out_i, out_d):
    """The walk of the module docstring, for the lowest approximate score of float32[D] ``q``.

    :param nbr: int32[*] FAISS's neighbour lists: vector r's level-0 list is ``nbr[offsets[r] :
        offsets[r] + width]``, -1 padded; ``offsets`` int64[A + 1] (FAISS's ``size_t`` offsets viewed as
        int64). :param codes: int8[>= A, D] and ``scale`` float32[>= A]:
        the int8 copy of the graph's A vectors. :param ann_slot: int64[>= A] (< 0: dead).
    :param entries: int64[E] start vectors (graph ids < A). :param stamp: int32[>= A] visited
        marks; ``mark`` this call's. :param out_i: int64[ef] and ``out_d`` float32[ef]: filled
        with the live vectors kept and their approximate scores.
    :returns: how many were kept (the first that many of ``out_i`` / ``out_d``).
    """
    cd = np.empty(ef, np.float32)
    ci = np.empty(ef, np.int64)
    cv = np.zeros(ef, np.bool_)
    nr = 0
    for e in range(entries.size):
        r = entries[e]
        if stamp[r] == mark:
            continue
        stamp[r] = mark
        d = _score(codes, scale, r, q)
        if ann_slot[r] >= 0:
            nr = _keep(r, d, out_i, out_d, nr, ef)
        n, nvalid = _cand(r, d, cd, ci, cv, 0, 0, ef)
        while nvalid > 0:
            b = -1
            for t in range(n):
                if cv[t] and (b < 0 or cd[t] < cd[b]):
                    b = t
            d0, c = cd[b], ci[b]
            cv[b] = False
            nvalid -= 1
            below = 0
            for t in range(n):
                if cd[t] < d0:
                    below += 1
            if below >= ef:
                break
            base = offsets[c]
            for t in range(width):
                r = nbr[base + t]
                if r < 0:
                    break
                if stamp[r] == mark:
                    continue
                stamp[r] = mark
                d = _score(codes, scale, r, q)
                if ann_slot[r] >= 0:
                    nr = _keep(r, d, out_i, out_d, nr, ef)
                n, nvalid = _cand(r, d, cd, ci, cv, n, nvalid, ef)
    return nr


def warm() -> None:
    """Compile (or load from numba's cache) :func:`low_search` for the types a shard passes."""
    codes, scale = np.ones((3, 4), np.int8), np.ones(3, np.float32)
    nbr = np.array([1, 2, 0, 2, 0, 1], np.int32)
    low_search(nbr, np.array([0, 2, 4, 6], np.int64), 2, codes, scale, np.arange(3, dtype=np.int64),
               np.ones(4, np.float32), np.zeros(1, np.int64), 2, np.zeros(3, np.int32), 1,
               np.empty(2, np.int64), np.empty(2, np.float32))


# ---------------------------------------------------------------- the top-n search (int8 walk)
@njit(cache=True, nogil=True, inline="always")
def _sift_up(hd, hi, i, sign):
    """Restore a binary heap (``sign`` 1: min-heap, -1: max-heap) after setting slot i."""
    d, r = hd[i], hi[i]
    while i > 0:
        p = (i - 1) >> 1
        if sign * hd[p] <= sign * d:
            break
        hd[i], hi[i] = hd[p], hi[p]
        i = p
    hd[i], hi[i] = d, r


@njit(cache=True, nogil=True, inline="always")
def _sift_down(hd, hi, n, sign):
    """Restore a binary heap of n entries after setting its root."""
    d, r = hd[0], hi[0]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and sign * hd[c + 1] < sign * hd[c]:
            c += 1
        if sign * hd[c] >= sign * d:
            break
        hd[i], hi[i] = hd[c], hi[c]
        i = c
    hd[i], hi[i] = d, r


@njit(cache=True, nogil=True, fastmath=_FM)
def top_search(nbr, offsets, cum, levels, entry, max_level, codes, scale, ann_slot, q, ef, stamp, mark,
               cd, ci, out_i, out_d):
    """HNSW search for the *largest* approximate scores of float32[D] ``q`` on the int8 copy: a
    greedy descent of the upper levels from ``entry`` (FAISS's ``greedy_update_nearest``), then the
    level-0 search with an unbounded candidate heap and a result heap of the ``ef`` best live
    vectors (FAISS's ``search_from_candidate_unbounded``; Malkov and Yashunin, Algorithm 2).

    :param cum: int64[L + 2] FAISS's ``cum_nneighbor_per_level``. :param levels: int32[A] each
        vector's level count. :param cd: float32[C] and ``ci`` int64[C] the candidate heap's
        storage (a candidate that would not fit is dropped). :param out_i: int64[ef] and
        ``out_d`` float32[ef]: the kept vectors and their scores (a heap, not sorted).
    :returns: how many were kept.
    """
    c = entry
    dc = _score(codes, scale, c, q)
    for lev in range(max_level, 0, -1):
        if levels[c] <= lev:
            continue
        moved = True
        while moved:
            moved = False
            base = offsets[c]
            for t in range(cum[lev], cum[lev + 1]):
                r = nbr[base + t]
                if r < 0:
                    break
                d = _score(codes, scale, r, q)
                if d > dc:
                    c, dc, moved = r, d, True
    cap = cd.size
    stamp[c] = mark
    cd[0], ci[0] = dc, c
    nc = 1
    nr = 0
    if ann_slot[c] >= 0:
        out_d[0], out_i[0] = dc, c
        nr = 1
    w0, w1 = cum[0], cum[1]
    while nc > 0:
        d0, c = cd[0], ci[0]  # the best candidate (max-heap on the score)
        nc -= 1
        if nc > 0:
            cd[0], ci[0] = cd[nc], ci[nc]
            _sift_down(cd, ci, nc, -1)
        if nr == ef and d0 < out_d[0]:
            break
        base = offsets[c]
        for t in range(w0, w1):
            r = nbr[base + t]
            if r < 0:
                break
            if stamp[r] == mark:
                continue
            stamp[r] = mark
            d = _score(codes, scale, r, q)
            if nr < ef or d > out_d[0]:
                if nc < cap:
                    cd[nc], ci[nc] = d, r
                    _sift_up(cd, ci, nc, -1)
                    nc += 1
                if ann_slot[r] >= 0:  # results: a min-heap of the ef best (root: the worst kept)
                    if nr < ef:
                        out_d[nr], out_i[nr] = d, r
                        _sift_up(out_d, out_i, nr, 1)
                        nr += 1
                    else:
                        out_d[0], out_i[0] = d, r
                        _sift_down(out_d, out_i, nr, 1)
    return nr
