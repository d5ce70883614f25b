"""Compiled helpers of the dense-first merge (:func:`.hybrid.merge_union`).

:func:`union_cols` lays out the union of every shard's dense and BM25 lists (per shard in reply
order: the dense list, then the BM25 list's chunks that are not in it, :func:`not_in`) as four
columns, with the minimum and maximum of each score column and each shard's list minima. The
merge did this with ~15 numpy calls and a Python ``set`` per shard and query (~100-300 us on the
frontend's event loop); this is one call, with the same values in the same order. Minima and
maxima follow numpy's ``min`` / ``max`` (NaN when any value is NaN); where numpy's choice of a
zero's sign is not defined by the values (a column holding both 0.0 and -0.0) the union's ranges
are flagged and the caller takes numpy's. :func:`fuse_rank` also bounds the unseen rows (the
threshold bound of :mod:`.hybrid`) in the same call. Served, each native call costs 10-40 us
(caches emptied by the shards between requests, bench/RESULTS.md fast16), so fewer calls pay."""

from __future__ import annotations

import numpy as np

from ..index import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from ..index.kernels_merge import fuse_top, hit_ranks  # noqa: E402
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def not_in(ds, ls):
    """int64 positions ``i`` (ascending) of ``ls`` whose value is not among ``ds`` (both int64[:])."""
    srt = np.sort(ds)
    n = srt.size
    out = np.empty(ls.size, np.int64)
    k = 0
    for i in range(ls.size):
        x = ls[i]
        lo, hi = 0, n
        while lo < hi:  # first position with srt[pos] >= x
            mid = (lo + hi) >> 1
            if srt[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        if lo == n or srt[lo] != x:
            out[k] = i
            k += 1
    return out[:k]


@njit(cache=True, nogil=True)
def _lo_hi(a):
    """(min, max) of a non-empty float64[:] as numpy's: NaN when any value is NaN."""
    lo = hi = a[0]
    for i in range(1, a.size):
        x = a[i]
        if x != x:
            return np.nan, np.nan
        if x < lo:
            lo = x
        if x > hi:
            hi = x
    if lo != lo:
        return np.nan, np.nan
    return lo, hi


@njit(cache=True, nogil=True)
def _signed_zeros(a):
    """Whether float64[:] ``a`` holds both 0.0 and -0.0 (numpy's min / max may then return
    either sign of zero: no scalar loop is sure to agree)."""
    pos = neg = False
    for i in range(a.size):
        if a[i] == 0.0:
            if np.signbit(a[i]):
                neg = True
            else:
                pos = True
    return pos and neg


@njit(cache=True, nogil=True)
def union_cols(shards, ds, dd, dl, ls, ld, ll):
    """The union of S shards' lists (tuples of S arrays each: dense-list slots ``ds``, dense
    ``dd`` and BM25 ``dl`` scores; BM25-list slots ``ls``, scores ``ld``, ``ll``; ``shards``
    int64[S] their shard ids). :returns: ``(shard, slot, dense, lexical)`` of the union,
    ``extra`` (per shard, the positions of its BM25 list's chunks not in its dense list, back to
    back) with ``offsets`` int64[S + 1] into it, per shard ``dmin`` (its dense list's
    minimum, NaN when empty), ``lmin`` (its BM25 list's, NaN when empty), ``ranges`` float64[4]
    (the union's dense min, max, BM25 min, max as numpy's; NaN when empty) and whether they are
    numpy's bit for bit (False: a column holds both signs of zero, :func:`_signed_zeros`)."""
    S = len(ds)
    offsets = np.zeros(S + 1, np.int64)
    parts = []
    for s in range(S):
        e = not_in(ds[s], ls[s]) if ls[s].size else np.zeros(0, np.int64)
        parts.append(e)
        offsets[s + 1] = offsets[s] + e.size
    m = 0
    for s in range(S):
        m += ds[s].size + parts[s].size
    shard = np.empty(m, np.int64)
    slot = np.empty(m, np.int64)
    dense = np.empty(m, np.float64)
    lexical = np.empty(m, np.float64)
    extra = np.empty(offsets[S], np.int64)
    dmin = np.full(S, np.nan)
    lmin = np.full(S, np.nan)
    r = 0
    for s in range(S):
        a, b, c = ds[s], dd[s], dl[s]
        for i in range(a.size):
            shard[r], slot[r], dense[r], lexical[r] = shards[s], a[i], b[i], c[i]
            r += 1
        e, a, b, c = parts[s], ls[s], ld[s], ll[s]
        for k in range(e.size):
            i = e[k]
            extra[offsets[s] + k] = i
            shard[r], slot[r], dense[r], lexical[r] = shards[s], a[i], b[i], c[i]
            r += 1
        if dd[s].size:
            dmin[s] = _lo_hi(dd[s])[0]
        if ll[s].size:
            lmin[s] = _lo_hi(ll[s])[0]
    ranges = np.full(4, np.nan)
    exact = True
    if m:
        ranges[0], ranges[1] = _lo_hi(dense)
        ranges[2], ranges[3] = _lo_hi(lexical)
        exact = not (_signed_zeros(dense) or _signed_zeros(lexical))
    return shard, slot, dense, lexical, extra, offsets, dmin, lmin, ranges, exact


@njit(cache=True, nogil=True)
def fuse_rank(d, lx, dlo, dhi, llo, lhi, dw, lw, k, n, bd, bl):
    """:func:`..index.kernels_merge.fuse_top` and, when its top-k is strict, the two
    :func:`..index.kernels_merge.hit_ranks` of those rows (dense, then BM25), in one call:
    ``(scores, top, strict, dense ranks, dense exact, BM25 ranks, BM25 exact, ub, finite)`` (the
    ranks are empty and not exact when the top-k is not strict: the caller orders it with ids
    first). ``ub`` is the threshold bound of the shards' bounds float64[S'] ``bd`` (N-th dense
    score), ``bl`` (BM25 bound): the largest fused score of them as numpy's ``max`` (NaN when one
    is NaN); inf and ``finite`` False when a bound is not finite; -inf when there is none."""
    ub = -np.inf
    finite = True
    if bd.size:
        for i in range(bd.size):
            if not (np.isfinite(bd[i]) and np.isfinite(bl[i])):
                finite = False
        if finite:
            bs = fuse_top(bd, bl, dlo, dhi, llo, lhi, dw, lw, 0)[0]
            ub = bs[0]
            for i in range(1, bs.size):
                x = bs[i]
                if x != x or ub != ub:
                    ub = np.nan
                    break
                if x > ub:
                    ub = x
        else:
            ub = np.inf
    scores, top, strict = fuse_top(d, lx, dlo, dhi, llo, lhi, dw, lw, k)
    if not strict:
        z = np.zeros(0, np.int64)
        return scores, top, False, z, False, z, False, ub, finite
    dr, ok_d = hit_ranks(d, top, n, False)
    lr, ok_l = hit_ranks(lx, top, n, True)
    return scores, top, True, dr, ok_d, lr, ok_l, ub, finite


def warm() -> None:
    """Compile (or load from numba's cache) :func:`not_in` for the merge's argument types."""
    z = np.zeros(1, np.int64)
    not_in(z, z)
    f = np.zeros(2, np.float64)
    fuse_rank(f, f, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5, 1, 1, f, f)
    for n in (1, 2):
        warm_shards(n)


def warm_shards(n: int) -> None:
    """Compile (or load) :func:`union_cols` for ``n`` shards (numba specialises on tuple length)."""
    i, f = (np.zeros(1, np.int64),) * n, (np.zeros(1, np.float64),) * n
    union_cols(np.zeros(n, np.int64), i, f, f, i, f, f)
    _lo_hi(np.zeros(1))
