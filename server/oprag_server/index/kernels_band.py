"""The chunks of one shard that can be in an exact min-max fusion's top-k, whatever the corpus-wide
ranges (exact mode in one round, ``ExactMixin.exact_minmax``).

Weighted min-max fusion with weights >= 0 is non-decreasing in each score, also in float64 (every
IEEE operation it performs is monotone), and ranks equal fused scores by chunk id. So a chunk y
*certainly* ranks ahead of x, whatever ranges and weights the frontend fuses with, when
``d_y >= d_x``, ``l_y >= l_x`` and ``id_y < id_x``. (A y better on both scores with a larger id is
not counted: rounding, or a zero weight, can make both fuse equal, and then x wins the tie.) A
chunk with k such chunks on its shard is not in the top-k; :func:`band` keeps a superset of the
others (the k-skyband of (dense, BM25, -id rank), Papadias et al., TODS 2005, section 6), from
which the frontend fuses the top-k exactly. With one weight 0 that score is left out (passed as
zeros).

Dense scores may be approximate (within ``err`` of the canonical ones): "y has at least x's
score" is then only taken when ``d_y - d_x >= e2`` (``e2`` covers twice ``err`` and the rounding of
the difference), so the kept set is a superset of the canonical one; the caller refines the kept
chunks to canonical scores and calls :func:`band` again on them with ``e2 = 0``.

Cost: the chunks below a block of the highest first scores are first tested against the block's
chunks alone (O(n) at the lowest second score, where most chunks are: a chunk there is kept only
when fewer than k chunks of the block have a smaller id rank); the block and the chunks that
pass go through the sweep (sorted, O(C log C)). At 500K chunks, 10 ms (50K with a BM25 score).
"""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def _sweep(order, p1, p2, r, k, e2):
    """bool[N]: ``keep`` of the positions in ``order`` (sorted by ``p1`` desc, ``p2`` desc, ``r``
    asc): fewer than k earlier kept positions y with ``p1[y] - p1[x] >= e2`` (every earlier
    one when ``e2`` is 0), ``p2[y] >= p2[x]`` and ``r[y] < r[x]``. A chunk not kept is left out
    of the witnesses: whatever it would count, the k chunks that outrank it count too."""
    keep = np.zeros(p1.size, np.bool_)
    wr = np.empty(order.size, np.int64)  # witnesses (kept, inserted) by id rank ascending
    w2 = np.empty(order.size, np.float64)
    nw, j = 0, 0
    for i in range(order.size):
        x = order[i]
        while j < i and (e2 == 0.0 or p1[order[j]] - p1[x] >= e2):
            y = order[j]
            j += 1
            if keep[y]:
                at = nw
                while at > 0 and wr[at - 1] > r[y]:
                    wr[at], w2[at] = wr[at - 1], w2[at - 1]
                    at -= 1
                wr[at], w2[at] = r[y], p2[y]
                nw += 1
        c = 0
        for w in range(nw):
            if wr[w] >= r[x] or c >= k:
                break
            if w2[w] >= p2[x]:
                c += 1
        keep[x] = c < k
    return keep


@njit(cache=True, nogil=True)
def _outranked(br, b2, r, p2, k):
    """bool[N]: which of the chunks (id ranks ``r``, second scores ``p2``) have k block chunks
    (id ranks ``br`` ascending, second scores ``b2``) with a smaller id rank and ``b2 >= p2``."""
    out = np.zeros(r.size, np.bool_)
    for i in range(r.size):
        c = 0
        for w in range(br.size):
            if br[w] >= r[i]:
                break
            if b2[w] >= p2[i]:
                c += 1
                if c >= k:
                    out[i] = True
                    break
    return out


@njit(cache=True, nogil=True)
def _split(p1, p2, r, t, low, rk):
    """One pass over the chunks: ``(keep bool[N], inside int64[], rest int64[])``: first score
    ``>= t`` (the block and its e2 margin) inside; below it at the lowest second score ``low``,
    kept when the id rank is ``<= rk``; the others left to test (``rest``)."""
    keep = np.zeros(p1.size, np.bool_)
    inside = np.empty(p1.size, np.int64)
    rest = np.empty(p1.size, np.int64)
    ni = nr = 0
    for i in range(p1.size):
        if p1[i] >= t:
            inside[ni] = i
            ni += 1
        elif p2[i] == low:
            keep[i] = r[i] <= rk
        else:
            rest[nr] = i
            nr += 1
    return keep, inside[:ni], rest[:nr]


def _top(p1: np.ndarray, m: int) -> float:
    """The m-th highest of ``p1``."""
    return float(np.partition(p1, p1.size - m)[p1.size - m])


def band(p1: np.ndarray, p2: np.ndarray, r: np.ndarray, k: int, e2: float = 0.0) -> np.ndarray:
    """Positions (int64, ascending) of a superset of the chunks that fewer than k others certainly
    outrank (module docstring).

    :param p1: float64[N] first score (``e2`` > 0: approximate); :param p2: float64[N] second
        score (exact); :param r: int64[N] distinct id ranks (ascending = chunk id ascending).
    """
    p1 = np.ascontiguousarray(p1, dtype=np.float64)
    p2 = np.ascontiguousarray(p2, dtype=np.float64)
    r = np.ascontiguousarray(r, dtype=np.int64)
    n, k = p1.size, int(k)
    if k <= 0:
        return np.zeros(0, np.int64)
    if n <= k or not (np.isfinite(p1).all() and np.isfinite(p2).all()):
        return np.arange(n, dtype=np.int64)
    m = min(n, max(8 * k, 256))
    # below the block of the m highest first scores by >= e2: outranked by every block chunk
    # with a smaller id rank and at least its second score. At the lowest second score (most
    # chunks) that is every block chunk with a smaller id rank; the others are tested against
    # the block of the chunks above that score (_outranked), and those left go through the sweep
    t = _top(p1, m)
    keep, inside, rest = _split(p1, p2, r, t - e2, p2.min(), np.partition(r[p1 >= t], k - 1)[k - 1])
    if rest.size > m:
        up = np.flatnonzero(p2 > p2.min())
        tu = _top(p1[up], m)
        bo = up[p1[up] >= tu]
        bo = bo[np.argsort(r[bo], kind="stable")]
        rest = rest[p1[rest] < tu - e2]
        out = _outranked(r[bo], p2[bo], r[rest], p2[rest], k)
        pos = np.union1d(np.union1d(inside, up[p1[up] >= tu - e2]), rest[~out])
    else:
        pos = np.union1d(inside, rest)
    # ties of the first score need the full order only when they count (e2 = 0)
    order = pos[np.lexsort((r[pos], -p2[pos], -p1[pos]))] if e2 == 0.0 else pos[np.argsort(-p1[pos])]
    keep |= _sweep(order, p1, p2, r, k, float(e2))
    return np.flatnonzero(keep)


def warm() -> None:
    """Compile (or load from the cache) the kernels (:func:`_split`, :func:`_outranked`, :func:`_sweep`)."""
    band(np.arange(4.0), np.arange(4.0)[::-1].copy(), np.arange(4), 1, 0.0)
    _outranked(np.arange(2), np.ones(2), np.arange(2), np.ones(2), 1)
