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
def _insert(ks, vs, nw, key, val, up):
    """Insert ``(key, val)`` into the first ``nw`` entries of ``ks``/``vs``, sorted by ``ks``
    ascending (``up``) or descending."""
    at = nw
    while at > 0 and ((ks[at - 1] > key) if up else (ks[at - 1] < key)):
        ks[at], vs[at] = ks[at - 1], vs[at - 1]
        at -= 1
    ks[at], vs[at] = key, val


@njit(cache=True, nogil=True)
def _sweep(order, p1, p2, r, k, e2):
    """bool[N]: ``keep`` of the positions in ``order`` (sorted by ``p1`` desc; with ``e2`` 0 then
    by ``p2`` desc, ``r`` asc): fewer than k earlier kept positions y with ``p1[y] - p1[x] >= e2``
    (every earlier one when ``e2`` is 0), ``p2[y] >= p2[x]`` and ``r[y] < r[x]``. A chunk not
    kept is left out of the witnesses: whatever it would count, the k chunks that outrank it
    count too. The witnesses are held twice, by id rank ascending and by ``p2`` descending, and
    scanned in both orders in turn: the first to run out of candidates gives the exact count
    (a chunk with a small id rank, or a high ``p2``, is decided in a few steps)."""
    keep = np.zeros(p1.size, np.bool_)
    ar, a2 = np.empty(order.size, np.int64), np.empty(order.size, np.float64)  # by id rank
    b2, br = np.empty(order.size, np.float64), np.empty(order.size, np.int64)  # by p2 desc
    nw, j = 0, 0
    for i in range(order.size):
        x = order[i]
        while j < i and (e2 == 0.0 or p1[order[j]] - p1[x] >= e2):
            y = order[j]
            j += 1
            if keep[y]:
                _insert(ar, a2, nw, r[y], p2[y], True)
                _insert(b2, br, nw, p2[y], r[y], False)
                nw += 1
        rx, px = r[x], p2[x]
        ca = cb = ia = ib = 0
        while True:
            if ia == nw or ar[ia] >= rx:
                keep[x] = True  # every witness with a smaller id rank seen: fewer than k
                break
            ca += a2[ia] >= px
            ia += 1
            if ca >= k:
                break
            if ib == nw or b2[ib] < px:
                keep[x] = True  # every witness with at least its p2 seen: fewer than k
                break
            cb += br[ib] < rx
            ib += 1
            if cb >= k:
                break
    return keep


@njit(cache=True, nogil=True)
def _split(p1, p2, r, t, br, b2, k):
    """Positions int64[] left to sweep: first score ``>= t`` (the block and its e2 margin), or
    fewer than k block chunks (id ranks ``br`` ascending, second scores ``b2``) with a smaller
    id rank and at least its second score. ``kth[j]``: the k-th highest ``b2`` of the first j."""
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
        if p1[i] < t and kth[np.searchsorted(br, r[i])] >= p2[i]:
            continue
        out[n] = i
        n += 1
    return out[:n]


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
    # below the block of the m highest first scores by >= e2: outranked by the block's chunks
    # with a smaller id rank and at least its second score (most chunks at scale, those without
    # a query term); the block and the others are swept
    t = _top(p1, min(n, max(8 * k, 256)))
    blk = np.flatnonzero(p1 >= t)
    blk = blk[np.argsort(r[blk])]
    pos = _split(p1, p2, r, t - e2, r[blk], p2[blk], k)
    # ties of the first score need the full order only when they count (e2 = 0)
    order = pos[np.lexsort((r[pos], -p2[pos], -p1[pos]))] if e2 == 0.0 else pos[np.argsort(-p1[pos])]
    return np.flatnonzero(_sweep(order, p1, p2, r, k, float(e2)))


def warm() -> None:
    """Compile (or load from the cache) the kernels (:func:`_split`, :func:`_sweep`)."""
    band(np.arange(4.0), np.arange(4.0)[::-1].copy(), np.arange(4), 1, 0.0)
