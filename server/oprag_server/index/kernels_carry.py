"""The chunks a dense-first hybrid search reply carries the fields of, in one compiled call
(issue 13 hot path, shard side): the union of the dense candidates and the BM25 list
(deduplicated, the dense list first), its k-skyband (:func:`.kernels.skyband`) and, for a
weighted min-max fusion, the skyband chunks that can be in its top-k (:mod:`.kernels_cone`,
``rho_floor`` then ``cone_keep``). The same operations in the same order as the numpy / Python
steps it replaces (``Searcher._skyband_slots``), so the same slots (tested against them)."""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from .fusion import lexical_span_bound, skyband
from .kernels_cone import cone_keep, rho_floor
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def carry_band(cs, cd, cl, ls, ld, ll, k, wd, wl, dmin, lspan):
    """Slots of the carried chunks: the k-skyband of ``cs`` (int64[M] slots, ``cd`` dense and
    ``cl`` BM25 float64[M]) followed by the chunks of ``ls`` (the BM25 list, same layout) not in
    ``cs``, narrowed by the min-max cone when ``wd``, ``wl`` > 0 (``dmin``: the shard's dense
    minimum; ``lspan``: :func:`.fusion.lexical_span_bound` of the query; NaN ``dmin``: no cone).

    :returns: ``(slots int64, True)``, or ``(empty, False)`` when a score is not finite (the
        caller takes the reference path)."""
    m0 = cs.size
    srt = np.sort(cs)
    take = np.zeros(ls.size, np.bool_)
    extra = 0
    for j in range(ls.size):
        p = np.searchsorted(srt, ls[j])
        if not (p < m0 and srt[p] == ls[j]):
            take[j] = True
            extra += 1
    m = m0 + extra
    slots = np.empty(m, np.int64)
    d = np.empty(m, np.float64)
    lx = np.empty(m, np.float64)
    slots[:m0], d[:m0], lx[:m0] = cs, cd, cl
    i = m0
    for j in range(ls.size):
        if take[j]:
            slots[i], d[i], lx[i] = ls[j], ld[j], ll[j]
            i += 1
    band, finite = kernels.skyband(d, lx, k)
    if not finite:
        return np.zeros(0, np.int64), False
    if band.size > k and wd > 0.0 and wl > 0.0 and m > 0 and not np.isnan(dmin):  # kernels_cone.rho_floor
        lo = min(d.min(), dmin)
        dspan = d.max() - lo
        if np.isfinite(dspan) and np.isfinite(lspan) and dspan > 0.0 and lspan > 0.0:
            rho = (wl / wd) * dspan / lspan * (1.0 - 1e-6)
            if rho > 0.0:
                band = band[cone_keep(d[band], lx[band], k, rho)]
    return slots[band], True


_NO_I, _NO_F = np.zeros(0, np.int64), np.zeros(0, np.float64)


def band_slots(c, lex, k: int, cone=None) -> np.ndarray:
    """Slots of the chunks a reply carries the fields of (module docstring): ``c`` the dense
    candidates, ``lex`` the BM25 list or None (each with ``slots`` int64, ``dense`` and
    ``lexical`` float64 arrays), ``cone`` ``(weights, dense minimum, idf, k1)`` of a min-max
    fusion or None. :func:`carry_band`, or the numpy steps when a score is not finite."""
    ls, ld, ll = (lex.slots, lex.dense, lex.lexical) if lex is not None else (_NO_I, _NO_F, _NO_F)
    wd, wl, dmin, span = (float(cone[0][0]), float(cone[0][1]), float(cone[1]), lexical_span_bound(cone[2], cone[3])) \
        if cone else (0.0, 0.0, np.nan, 0.0)
    out, ok = carry_band(c.slots, c.dense, c.lexical, ls, ld, ll, int(k), wd, wl, dmin, span)
    return out if ok else band_slots_reference(c, lex, k, cone)


def band_slots_reference(c, lex, k: int, cone=None) -> np.ndarray:
    """:func:`band_slots` in numpy and Python (the steps :func:`carry_band` compiles)."""
    if lex is None or not len(lex.slots):
        slots, d, lx = c.slots, c.dense, c.lexical
    else:
        seen = set(c.slots.tolist())
        extra = np.asarray([x not in seen for x in lex.slots.tolist()], dtype=bool)
        slots = np.concatenate([c.slots, lex.slots[extra]])
        d, lx = np.concatenate([c.dense, lex.dense[extra]]), np.concatenate([c.lexical, lex.lexical[extra]])
    band = skyband(d, lx, k)
    if cone and band.size > k:
        rho = rho_floor(cone[0], d, cone[1], cone[2], cone[3])
        if rho > 0.0:
            band = band[cone_keep(np.ascontiguousarray(d[band], np.float64),
                                  np.ascontiguousarray(lx[band], np.float64), k, rho)]
    return slots[band]


def warm() -> None:
    """Compile (or load from the cache) :func:`carry_band` for the types a shard passes."""
    s, f = np.arange(3, dtype=np.int64), np.arange(3.0)
    carry_band(s, f, f[::-1].copy(), s + 1, f, f, 1, 0.5, 0.5, 0.0, 1.0)
