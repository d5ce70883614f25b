"""Which of a shard's k-skyband chunks can be in a weighted min-max fusion's top-k (issue 13 hot
path): the stored fields a dense-first hybrid search reply carries (``Searcher.search``).

The k-skyband (:func:`.fusion.skyband`) holds every chunk of a shard that can be in the top-k of
*some* monotone fusion of its two lists. Min-max fusion with weights ``w_d, w_l`` and the
frontend's global ranges orders chunks as ``d + rho * l`` does, with
``rho = (w_l / lspan) / (w_d / dspan)`` (a positive affine map of the fused score). The shard
does not know the global spans, but bounds them:

* ``dspan >= max(d) - min(dense_min, min(d))`` over its own lists (the frontend's dense range is
  ``[min(union, every shard's minimum), union max]`` and the union holds this shard's lists);
* ``lspan <= sum_t |idf_t| (k1 + 1)``: each term adds ``idf tf (k1 + 1) / (tf + norm)``, between
  ``min(0, idf) (k1 + 1)`` and ``max(0, idf) (k1 + 1)``, so every BM25 score and 0 lie in an
  interval of that width.

So ``rho >= rho_lo = (w_l / w_d) dspan_lo / lspan_hi`` (shrunk by 1e-6 for rounding), and a chunk
x can be in the top-k only if, for some ``rho >= rho_lo``, fewer than k chunks y of the skyband
have ``d_y + rho l_y > d_x + rho l_x``. :func:`cone_keep` tests that at ``rho_lo``, at every
crossing point ``rho_xy >= rho_lo`` and beyond the last one (the count is constant between
crossings, and at a crossing the two are equal, so those points hold the minimum), counting y
only when it is ahead by more than a tolerance far above float64 rounding (so it keeps a
superset). The frontend still fetches a hit whose fields did not come along
(``Retriever._materialise``), so a chunk left out can cost a round trip, never a result.
"""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from .fusion import lexical_span_bound
from numba import njit  # noqa: E402

#: relative tolerance of "ahead": float64 fused scores err by ~1e-15 relative
TOL = 1e-7


@njit(cache=True, nogil=True)
def _count_ahead(d, lx, x, rho, k, tol):
    fx = d[x] + rho * lx[x]
    c = 0
    for y in range(d.size):
        if d[y] + rho * lx[y] > fx + tol:
            c += 1
            if c >= k:
                break
    return c


@njit(cache=True, nogil=True)
def cone_keep(d, lx, k, rho_lo):
    """bool[S]: which chunks of float64[S] dense ``d`` and BM25 ``lx`` scores can be in the
    top-k of ``d + rho l`` for some ``rho >= rho_lo`` (module docstring; a superset)."""
    s = d.size
    keep = np.zeros(s, np.bool_)
    if s <= k:
        keep[:] = True
        return keep
    dmax, lmax = 0.0, 0.0
    for i in range(s):
        dmax = max(dmax, abs(d[i]))
        lmax = max(lmax, abs(lx[i]))
    big = rho_lo
    for x in range(s):
        for y in range(s):
            dl = lx[y] - lx[x]
            if dl != 0.0:
                r = (d[x] - d[y]) / dl
                if r > big:
                    big = r
    big = 2.0 * big + 1.0
    for x in range(s):
        tol = TOL * (1.0 + dmax + rho_lo * (1.0 + lmax))
        if _count_ahead(d, lx, x, rho_lo, k, tol) < k:
            keep[x] = True
            continue
        tol = TOL * (1.0 + dmax + big * (1.0 + lmax))
        if _count_ahead(d, lx, x, big, k, tol) < k:
            keep[x] = True
            continue
        for y in range(s):
            dl = lx[y] - lx[x]
            if dl == 0.0:
                continue
            r = (d[x] - d[y]) / dl
            if r >= rho_lo and _count_ahead(d, lx, x, r, k, TOL * (1.0 + dmax + r * (1.0 + lmax))) < k:
                keep[x] = True
                break
    return keep


def rho_floor(weights, d_all: np.ndarray, dense_min: float, idf: np.ndarray, k1: float) -> float:
    """``rho_lo`` (module docstring) from the request's ``(w_d, w_l)``, this shard's dense scores
    of both lists ``d_all``, its dense minimum and the query's idf; 0 (no narrowing) when a
    value is not finite or a weight is 0."""
    wd, wl = float(weights[0]), float(weights[1])
    if not (wd > 0.0 and wl > 0.0) or not d_all.size or np.isnan(dense_min):
        return 0.0
    lo = min(float(d_all.min()), float(dense_min))
    dspan = float(d_all.max()) - lo
    lspan = lexical_span_bound(idf, k1)
    if not (np.isfinite(dspan) and np.isfinite(lspan) and dspan > 0.0 and lspan > 0.0):
        return 0.0
    return (wl / wd) * dspan / lspan * (1.0 - 1e-6)


def warm() -> None:
    """Compile (or load from the cache) :func:`cone_keep`."""
    cone_keep(np.arange(4, dtype=np.float64), np.arange(4, dtype=np.float64)[::-1].copy(), 1, 0.5)
