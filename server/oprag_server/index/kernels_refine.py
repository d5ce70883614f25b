"""The dense candidate step of a flat shard with a second, tighter filter before the canonical
scores (issue 13 hot path, shard side).

:func:`.kernels.dense_step` scores canonically every row whose approximate (int8,
:mod:`.kernels_scan`) score is within ``2 err`` of the n-th largest: at 5K x 384 rows and
N = 256 about 700 rows for 256 wanted, and the canonical score (a pairwise float64 fold) is most
of the step. :func:`dense_step_fast` first computes, for those rows only, a float64 dot product
summed in any order (``fastmath`` reassoc / contract / nsz: vectorised), whose distance to the
canonical score is at most ``err2 = 2 gamma64_D vmax |q|`` doubled (both sum the same exact
float64 products of float32 values, each erring by at most ``gamma_D sum |v_j q_j| <= gamma_D
|v| |q|``; ``vmax`` bounds every row's L2 norm), and scores canonically only the rows within
``2 err2`` of the n-th largest of those. A row left out has a canonical score strictly below
the n-th largest canonical score of the kept rows (at least n of them are within ``err2`` of a
fast score >= the n-th fast one), so the top-n by (canonical score desc, chunk id asc), its
scores and the ties reported are those of :func:`.kernels.dense_step` (tested against it).

The first filter can also take each row's own int8 bound (:func:`.kernels_scan.row_bounds`:
its own residual and quantised norms instead of the largest ones): a row is kept when its upper
bound reaches the n-th largest lower bound (at least n rows have canonical scores at or above
that lower bound, so a row below it cannot be in the top-n). Fewer float32 rows are then read
for the second filter (what costs most once other processes have evicted the caches).
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .fusion import top_k_order
from .kernels import NOT_FINITE, OK, _argsort_desc, _canonical, _kth_largest, _sample_low
from .kernels_scan import gamma64, query_norm, row_factor, scan_bound, scan_int
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _fast_dots(vecs, rows, all_rows, short, q64, out):
    """float64 ``out[p]``: the dot product of row ``short[p]`` (a position of ``rows``, or a row
    when ``all_rows``) with ``q64``, summed in any order (module docstring)."""
    for p in range(short.size):
        v = vecs[short[p] if all_rows else rows[short[p]]]
        acc = 0.0
        for j in range(v.size):
            acc += np.float64(v[j]) * q64[j]
        out[p] = acc
    return out


@njit(cache=True, nogil=True)
def fast_bound(vmax, d, qn):
    """:func:`fast_error` from ``|q|`` (``qn``): also what :func:`flat_top_one` uses."""
    return 2.0 * (2.0 * gamma64(d) * vmax * qn) * (1.0 + 1e-6) + 1e-15


def fast_error(vmax: float, d: int, q: np.ndarray, qn: float | None = None) -> float:
    """``err2`` (module docstring) for float32[D] ``q`` and row norms <= ``vmax`` (``qn``: ``|q|``
    in float64, :func:`.kernels_scan.query_norm`, when the caller has it)."""
    return fast_bound(float(vmax), int(d), query_norm(q) if qn is None else float(qn))


@njit(cache=True, nogil=True)
def dense_step_fast(vecs, rows, all_rows, approx, q, err, n, sample, err2, rb, rf):
    """:func:`.kernels.dense_step` (same arguments and results) with the second filter of the
    module docstring (``err2``: :func:`fast_error`): ``short`` / ``exact`` then hold only the
    rows that passed both filters. ``rb`` float64[N] (may be empty: ``err`` for every row):
    per-row bounds, row r's approximate score within ``rf rb[r] + 1e-12`` (<= ``err``) of its
    canonical one (``Int8Rows.rb``, ``row_scale``); the first filter then keeps the rows whose
    upper bound reaches the n-th largest lower bound (the same argument per row)."""
    m = approx.size
    q64 = q.astype(np.float64)
    buf64 = np.empty(max(q.size, 1), np.float64)
    empty_i, empty_f = np.zeros(0, np.int64), np.zeros(0, np.float64)
    finite, low = _sample_low(vecs, rows, all_rows, approx, err, sample, q64, buf64)
    if not finite:
        return empty_i, empty_f, empty_i, False, np.inf, NOT_FINITE
    kk = min(n, m)
    if kk <= 0:
        return empty_i, empty_f, empty_i, False, low, OK
    if rb.size:  # per-row bounds: U_i >= the kk-th largest L_j
        e = np.empty(m, np.float64)
        lo_b = np.empty(m, np.float64)
        for i in range(m):
            e[i] = min(rf * rb[i if all_rows else rows[i]] + 1e-12, err)
            lo_b[i] = np.float64(approx[i]) - e[i]
        lam = _kth_largest(lo_b, kk)
        for i in range(m):
            lo_b[i] = np.float64(approx[i]) + e[i] - lam  # >= 0: kept
    else:
        cut = _kth_largest(approx, kk) - 2.0 * err
        lo_b = np.empty(m, np.float64)
        for i in range(m):
            lo_b[i] = np.float64(approx[i]) - cut
    p = 0
    for i in range(m):
        if lo_b[i] >= 0.0:
            p += 1
    short = np.empty(p, np.int64)
    p = 0
    for i in range(m):
        if lo_b[i] >= 0.0:
            short[p] = i
            p += 1
    if p > kk:  # the second filter
        fast = _fast_dots(vecs, rows, all_rows, short, q64, np.empty(p, np.float64))
        cut2 = _kth_largest(fast, kk) - 2.0 * err2
        c = 0
        for i in range(p):
            if fast[i] >= cut2:
                short[c] = short[i]
                c += 1
        short = short[:c]
    exact = np.empty(short.size, np.float64)
    for i in range(short.size):
        exact[i] = _canonical(vecs[short[i] if all_rows else rows[short[i]]], q64, buf64)
    order = _argsort_desc(exact, np.flatnonzero(exact >= _kth_largest(exact, kk)))
    ties = False
    for j in range(1, order.size):
        if exact[order[j]] == exact[order[j - 1]]:
            ties = True
            break
    return short, exact, order, ties, low, OK


#: :func:`flat_top_one`'s status for a query with a NaN or infinite value (the caller's numpy path reports it)
QUERY_NOT_FINITE = -1


@njit(cache=True, nogil=True)
def flat_top_one(vecs, codes, scale, rb, e, c, q, n, sample):
    """One unfiltered query's :func:`dense_step_fast` over every row of a flat index from its int8
    copy (``codes`` int8[N, D], ``scale`` float32[N], per-row bounds ``rb`` float64[N] and the
    ``(E, C)`` of :class:`.kernels_scan.Int8Rows`), in one call: ``|q|``, the integer scan
    (:func:`.kernels_scan.scan_int`), its bound (``Int8Rows.error``), the second filter's
    (:func:`fast_error`) and the per-row factor (``Int8Rows.row_scale``), through the compiled
    formulas those steps call (the Python glue of those steps was ~12% of a 5K-chunk shard's
    hybrid search; bench/RESULTS.md, session 34). ``sample``: int64[N] 0 .. N-1 (the minimum over
    every row). :returns: ``dense_step_fast``'s tuple, or status :data:`QUERY_NOT_FINITE` (the rest
    empty) when ``q`` is not finite."""
    d = q.size
    qn2 = 0.0
    for j in range(d):
        x = np.float64(q[j])
        qn2 += x * x
    if not np.isfinite(qn2):
        return np.zeros(0, np.int64), np.zeros(0, np.float64), np.zeros(0, np.int64), False, np.inf, QUERY_NOT_FINITE
    qn = np.sqrt(qn2)
    approx = scan_int(codes, scale, q, np.empty(codes.shape[0], np.float32))
    return dense_step_fast(vecs, np.zeros(0, np.int64), True, approx, q, scan_bound(e, c, d, qn), n, sample,
                           fast_bound(c + e, d, qn), rb, row_factor(qn))


def warm(d: int = 8) -> None:
    """Compile (or load from the cache) :func:`dense_step_fast` and :func:`_rank_order` for the types a
    shard passes."""
    vecs = np.full((4, d), 1.0 / np.sqrt(d), np.float32)
    q = vecs[0].copy()
    rows = np.arange(4, dtype=np.int64)
    rb = np.full(4, 1e-7)
    dense_step_fast(vecs, rows, True, vecs @ q, q, 1e-6, 2, rows, 1e-12, rb, 2.0)
    dense_step_fast(vecs, rows, False, vecs @ q, q, 1e-6, 2, rows[:0], 1e-12, rb[:0], 2.0)
    _rank_order(np.array([2.0, 1.0, 0.5]), 2)
    codes, scale = np.ones((4, d), np.int8), np.full(4, 0.01, np.float32)
    flat_top_one(vecs, codes, scale, rb, 1e-3, 1.0, q, 2, rows)
    _ = kernels


@njit(cache=True, nogil=True)
def _rank_order(s, kk):
    """``(order, ok)``: the first ``kk`` (1 <= kk <= size) positions of float64 ``s`` by score
    descending in a stable sort (``np.argsort(-s, kind="stable")[:kk]``), and whether no score is
    NaN and no two of the first ``kk + 1`` are equal (then that is the order by (score desc,
    chunk id asc) whatever the ids)."""
    for i in range(s.size):
        if s[i] != s[i]:
            return np.zeros(0, np.int64), False
    o = np.argsort(-s, kind="mergesort")
    for j in range(1, min(kk + 1, s.size)):
        if s[o[j]] == s[o[j - 1]]:
            return o[:kk], False
    return o[:kk], True


def rank_top(scores: np.ndarray, chunk_ids, m: int, rows=None) -> np.ndarray:
    """:func:`.fusion.top_k_order` (indices of the top-m by score desc, chunk id asc; ``rows``
    as there) as int64, reading no chunk id when no score is NaN and no two scores among the
    top-m and the first one after it are equal (then the stable descending order is that order:
    :func:`_rank_order`, compiled); else ``top_k_order`` itself."""
    s = np.ascontiguousarray(scores, dtype=np.float64)
    kk = min(int(m), s.size)
    if kk > 0:
        o, ok = _rank_order(s, kk)
        if ok:
            return o
    return np.asarray(top_k_order(s, chunk_ids, m, rows=rows), np.int64)
