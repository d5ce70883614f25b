"""The chunks of one shard that can be in an exact min-max fusion's top-k, whatever the corpus-wide
ranges (exact mode in one round, ``ExactMixin.exact_minmax``).

Weighted min-max fusion with weights >= 0 is non-decreasing in each score, also in float64 (every
IEEE operation it performs is monotone), and ranks equal fused scores by chunk id. So a chunk y
*certainly* ranks ahead of x, whatever ranges and weights the frontend fuses with, when
``d_y >= d_x``, ``l_y >= l_x`` and either ``id_y < id_x`` or ``l_y > l_x + tol``
(:func:`second_margin`: a BM25 gap that fuses strictly higher whatever the ranges). A y better on
both scores by less, with a larger id, is not counted: rounding, or a zero weight, can make both
fuse equal, and then x wins the tie. A chunk with k such chunks on its shard is not in the top-k;
:func:`band` keeps a superset of the others (a k-skyband, Papadias et al., TODS 2005, section 6),
from which the frontend fuses the top-k exactly. With one weight 0 that score is left out
(passed as zeros).

Dense scores may be approximate (within ``err`` of the canonical ones): "y has at least x's
score" is then only taken when ``d_y - d_x >= e2`` (``e2`` covers twice ``err`` and the rounding of
the difference), so the kept set is a superset of the one the canonical scores give.

Cost: a chunk below a block of the highest first scores is first tested against the block's
chunks alone (O(n log m)); the block and the chunks that pass (at 12K chunks about a tenth) are
sorted by the first score and swept (O(C log C), a few steps per chunk).
"""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def _sweep(order, p1, p2, r, k, e2, tol):
    """bool[N]: ``keep`` of the positions in ``order`` (sorted by ``p1`` desc; with ``e2`` 0 then
    by ``p2`` desc, ``r`` asc): fewer than k earlier kept positions y with ``p1[y] - p1[x] >= e2``
    (every earlier one when ``e2`` is 0), ``p2[y] >= p2[x]`` and either ``r[y] < r[x]`` or
    ``p2[y] > p2[x] + tol``. A chunk not kept is left out of the witnesses: whatever it would
    count, the k chunks that outrank it count too (the relation is transitive). The witnesses
    are held by ``p2`` descending and scanned while ``p2 >= p2[x]``: past ``p2[x] + tol`` every
    one counts, so most chunks are decided in k steps."""
    keep = np.zeros(p1.size, np.bool_)
    w2, wr = np.empty(order.size, np.float64), np.empty(order.size, np.int64)
    nw, j = 0, 0
    for i in range(order.size):
        x = order[i]
        while j < i and (e2 == 0.0 or p1[order[j]] - p1[x] >= e2):
            y = order[j]
            j += 1
            if keep[y]:
                at = nw
                while at > 0 and w2[at - 1] < p2[y]:
                    w2[at], wr[at] = w2[at - 1], wr[at - 1]
                    at -= 1
                w2[at], wr[at] = p2[y], r[y]
                nw += 1
        rx, px = r[x], p2[x]
        c = 0
        for w in range(nw):
            if w2[w] < px or c >= k:
                break
            c += (w2[w] - px > tol) or (wr[w] < rx)
        keep[x] = c < k
    return keep


@njit(cache=True, nogil=True)
def _split(p1, p2, r, t, br, b2, k, tol):
    """Positions int64[] left to sweep: first score ``>= t`` (the block and its e2 margin), or
    fewer than k block chunks (id ranks ``br`` ascending, second scores ``b2``) with a smaller
    id rank and at least its second score, and fewer than k above it by more than ``tol``.
    ``kth[j]``: the k-th highest ``b2`` of the first j."""
    m = br.size
    kth = np.full(m + 1, -np.inf)
    best = np.full(k, -np.inf)  # the k highest so far, descending
    for j in range(m):
        v = b2[j]
        if v > best[k - 1]:
            at = k - 1
            while at > 0 and best[at - 1] < v:
                best[at] = best[at - 1]
                at -= 1
            best[at] = v
        kth[j + 1] = best[k - 1]
    out = np.empty(p1.size, np.int64)
    n = 0
    for i in range(p1.size):
        if p1[i] < t and (kth[m] - p2[i] > tol or kth[np.searchsorted(br, r[i])] >= p2[i]):
            continue
        out[n] = i
        n += 1
    return out[:n]


def _top(p1: np.ndarray, m: int) -> float:
    """The m-th highest of ``p1``."""
    return float(np.partition(p1, p1.size - m)[p1.size - m])


def band(p1: np.ndarray, p2: np.ndarray, r: np.ndarray, k: int, e2: float = 0.0, tol: float = np.inf) -> np.ndarray:
    """Positions (int64, ascending) of a superset of the chunks that fewer than k others certainly
    outrank (module docstring).

    :param p1: float64[N] first score (``e2`` > 0: approximate); :param p2: float64[N] second
        score (exact); :param r: int64[N] distinct id ranks (ascending = chunk id ascending).
    :param tol: a second score higher by more than ``tol`` (and a first score not lower) fuses
        strictly higher whatever the ids (:func:`second_margin`); inf: never assumed.
    """
    p1 = np.ascontiguousarray(p1, dtype=np.float64)
    p2 = np.ascontiguousarray(p2, dtype=np.float64)
    r = np.ascontiguousarray(r, dtype=np.int64)
    n, k = p1.size, int(k)
    if k <= 0:
        return np.zeros(0, np.int64)
    if n <= k or not (np.isfinite(p1).all() and np.isfinite(p2).all()):
        return np.arange(n, dtype=np.int64)
    # below the block of the m highest first scores by >= e2: outranked by the block's chunks
    # with a smaller id rank and at least its second score (most chunks at scale, those without
    # a query term); the block and the others are swept
    t = _top(p1, min(n, max(8 * k, 256)))
    blk = np.flatnonzero(p1 >= t)
    blk = blk[np.argsort(r[blk])]
    pos = _split(p1, p2, r, t - e2, r[blk], p2[blk], k, float(tol))
    # ties of the first score need the full order only when they count (e2 = 0)
    order = pos[np.lexsort((r[pos], -p2[pos], -p1[pos]))] if e2 == 0.0 else pos[np.argsort(-p1[pos])]
    return np.flatnonzero(_sweep(order, p1, p2, r, k, float(e2), float(tol)))


def second_margin(wd: float, wl: float, lspan_max: float) -> float:
    """How much higher a BM25 score must be (the dense one not lower) to fuse strictly higher in
    float64, whatever ranges the frontend normalises with, given an upper bound ``lspan_max`` of
    the BM25 span. Each normalised score errs by at most ~3u (u = 2^-53), its weighted value by
    ~4u w, the sum by u (wd + wl): a normalised gap above 10.1u (wd + wl) / wl is enough; the
    margin is 8 eps = 16u times that bound (and covers the rounding of the difference). inf when
    the BM25 weight is 0 or so small that its products could underflow."""
    if not (wl >= 1e-290 and np.isfinite(lspan_max)):
        return np.inf
    return 8.0 * np.finfo(np.float64).eps * lspan_max * (wd + wl) / wl


def warm() -> None:
    """Compile (or load from the cache) the kernels (:func:`_split`, :func:`_sweep`)."""
    band(np.arange(4.0), np.arange(4.0)[::-1].copy(), np.arange(4), 1, 0.0)
