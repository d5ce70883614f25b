"""The approximate dense scan of a flat shard from an int8 copy of its vectors (issue 13 hot path).

The candidate step (:func:`.kernels.dense_step`) needs, for every row, an approximate score
within a known bound ``err`` of its canonical score; it then scores canonically only the rows
within ``2 err`` of the n-th approximate score, so the exact top-n does not depend on how the
approximation was made. A float32 BLAS scan reads 4 bytes per coordinate (a 6K x 384 shard:
9.2 MB, 0.45 ms with warm caches, 2.5-3 ms after other processes evicted them on this VM); an
int8 copy reads a quarter of that and a vectorised loop over it takes ~0.1-0.2 ms.

Quantisation (per row r, :func:`quantize`): ``s_r = max_j |v_rj| / 127`` (float32) and
``c_rj = round(v_rj / s_r)`` in [-127, 127]. The float scan (:func:`scan`) computes
``a_r = fl(fl(sum_j c_rj q_j) * s_r)`` in float32 with the sum in any order (LLVM reassociates
it into vector lanes: ``fastmath`` reassoc / contract / nsz only; finite inputs are checked by
the caller). The integer scan (:func:`scan_int`, what :meth:`Int8Rows.scores` runs: ~1.5x
faster, the products summed exactly in integers) first rounds the query to 16-bit integers,
``t = max_j |q_j| / Q``, ``k_j = round(q_j / t)`` (``Q = min(32767, (2^31 - 1) // (127 D))``: no
integer sum can overflow), and computes ``a_r = fl32(fl(fl(sum_j c_rj k_j) * fl(s_r t)))``.
Their distance to the exact inner product ``x_r = v_r . q``:

* quantisation of the row: ``|s_r c_r . q - v_r . q| <= |s_r c_r - v_r| |q| <= E |q|``
  (Cauchy-Schwarz) with ``E = max_r |s_r c_r - v_r|`` computed exactly in float64 by
  :func:`quantize`;
* float scan, rounding: any float32 summation order of D products plus the final product errs by
  at most ``gamma_{D+1} sum_j |s_r c_rj q_j| <= gamma_{D+1} C |q|``, ``gamma_n = n u / (1 - n u)``,
  ``u = 2^-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1; a
  fused multiply-add only removes roundings), ``C = max_r |s_r c_r|``;
* integer scan, the query's rounding: ``|k_j t - q_j| <= t (1/2 + 2 u64 Q)`` (the division
  rounds), so ``|s_r c_r . (t k - q)| <= C sqrt(D) t (1/2 + 2 u64 Q) <= C |q| sqrt(D) (1/2 + 2 u64 Q) / Q``
  (``t Q = max_j |q_j| <= |q|``), and the three roundings after the exact sum at most
  ``(u + 3 u64) C |t k| <= (u + 3 u64) C |q| (1 + sqrt(D) / Q)``: ``kappa_D C |q|`` in all
  (:func:`_rounding`, ~3e-4 C |q| at D = 384 against gamma_{D+1} = 2.3e-5);
* the canonical score (float64 products of float32 values, exact, folded pairwise in float64)
  differs from ``x_r`` by at most ``gamma^(64)_D (C + E) |q|``.

:func:`error_bound` returns twice their sum with the larger of the two scans' rounding terms
(so either scan may run; doubled for safety, as :meth:`.dense.DenseIndex.score_error`) plus
1e-12, so the shortlist argument of ``refine_top`` holds and the candidates, scores and dense
minimum are the same as from the BLAS scan (tested bit for bit against the numpy path in
``tests/unit/test_kernels.py`` and ``tests/unit/test_kernels_scan.py``).
"""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from numba import njit  # noqa: E402

from .kernels_low import _prefetch  # noqa: E402

_JIT = dict(cache=True, nogil=True)
#: rows ahead whose cache lines a scan prefetches: a cold 16,384 x 384 scan (the ANN check's sample at 1M chunks)
#: took 241 us without, 191 with 16 (bench/RESULTS.md, session 59); the hardware prefetcher alone stops at page ends
AHEAD = 16
_U32, _U64 = 2.0 ** -24, 2.0 ** -53


@njit(**_JIT)
def _qmax(d):
    """``Q`` of the integer scan (module docstring): |sum_j c_rj k_j| <= 127 D Q < 2^31."""
    return min(32767, (2 ** 31 - 1) // (127 * max(d, 1)))


@njit(**_JIT)
def _rounding(d):
    """The rounding term per unit of ``C |q|``: the larger of the float scan's ``gamma_{D+1}``
    and the integer scan's ``kappa_D`` (module docstring; 1% margin)."""
    g32 = (d + 1) * _U32 / (1.0 - (d + 1) * _U32)
    qm = _qmax(d)
    root = np.sqrt(np.float64(max(d, 1)))
    kappa = root * (0.5 + 2.0 * _U64 * qm) / qm + (_U32 + 3.0 * _U64) * (1.0 + root / qm)
    return max(g32, kappa * 1.01)


@njit(**_JIT)
def quantize(vecs, codes, scale):
    """Fill int8[N, D] ``codes`` and float32[N] ``scale`` from float32[N, D] ``vecs`` (module
    docstring). :returns: ``(E, C)``: the largest L2 norm of a row's residual
    ``s_r c_r - v_r`` and of a quantised row ``s_r c_r`` (float64, exact products)."""
    n, d = vecs.shape
    e_max, c_max = 0.0, 0.0
    for r in range(n):
        m = 0.0
        for j in range(d):
            m = max(m, abs(np.float64(vecs[r, j])))
        s = np.float32(m / 127.0)
        scale[r] = s
        e2, c2 = 0.0, 0.0
        for j in range(d):
            v = np.float64(vecs[r, j])
            c = 0.0 if s == 0 else min(127.0, max(-127.0, np.rint(v / np.float64(s))))
            codes[r, j] = np.int8(c)
            w = c * np.float64(s)  # exact: an 8-bit integer times a float32
            e2 += (w - v) * (w - v)
            c2 += w * w
        e_max = max(e_max, np.sqrt(e2))
        c_max = max(c_max, np.sqrt(c2))
    # the float64 sums above round: one ulp of margin per term, at most
    return e_max * (1.0 + 2.0 * d * _U64) + 1e-30, c_max * (1.0 + 2.0 * d * _U64)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def scan(codes, scale, q, out):
    """float32[N] ``out``: ``fl(sum_j codes[r, j] q[j]) * scale[r]`` for every row r of int8[N,
    D] ``codes`` and float32[D] ``q`` (sum in any order: module docstring)."""
    n, d = codes.shape
    for r in range(n):
        if r + AHEAD < n:
            for c in range(0, d, 64):
                _prefetch(codes, r + AHEAD, c)
        acc = np.float32(0.0)
        for j in range(d):
            acc += np.float32(codes[r, j]) * q[j]
        out[r] = acc * scale[r]
    return out


@njit(**_JIT)
def _query_int(q, k):
    """Fill int16[D] ``k`` with the query rounded to integers (module docstring); :returns: ``t``."""
    d = q.size
    m = 0.0
    for j in range(d):
        m = max(m, abs(np.float64(q[j])))
    if m == 0.0:
        k[:] = 0
        return 1.0
    qm = _qmax(d)
    t = m / qm
    for j in range(d):
        k[j] = np.int16(min(qm, max(-qm, np.rint(np.float64(q[j]) / t))))
    return t


@njit(**_JIT)
def _scan_k(codes, scale, rows, all_rows, k, t, out):
    """The integer scan's loop over the rows (every row, or ``rows``) with the integer query
    ``k``. The sums are stored as int32 first (exact: ``Q`` keeps them below 2^31): LLVM then
    sums in 32-bit vector lanes (``vpmaddwd``); converting each to float in the same loop kept
    it to 64-bit scalar sums, 3.5x slower."""
    d = codes.shape[1]
    acc = np.empty(out.size, np.int32)
    for i in range(out.size):
        r = i if all_rows else rows[i]
        if i + AHEAD < out.size:  # (the cache lines of the row AHEAD places on: module constant)
            ra = i + AHEAD if all_rows else rows[i + AHEAD]
            for c in range(0, d, 64):
                _prefetch(codes, ra, c)
        a = np.int32(0)
        for j in range(d):
            a += np.int32(k[j]) * np.int32(codes[r, j])
        acc[i] = a
    for i in range(out.size):
        r = i if all_rows else rows[i]
        out[i] = np.float32(np.float64(acc[i]) * (np.float64(scale[r]) * t))
    return out


@njit(**_JIT)
def scan_int(codes, scale, q, out):
    """:func:`scan` with the integer query (module docstring): float32[N] ``out``, row r's
    ``fl32(fl(sum_j codes[r, j] k_j) * fl(scale[r] t))``, the sum exact."""
    k = np.empty(codes.shape[1], np.int16)
    t = _query_int(q, k)
    return _scan_k(codes, scale, np.zeros(0, np.int64), True, k, t, out)


@njit(**_JIT)
def scan_int_rows(codes, scale, rows, q, out):
    """:func:`scan_int` of the rows int64[M] only (``out`` float32[M])."""
    k = np.empty(codes.shape[1], np.int16)
    t = _query_int(q, k)
    return _scan_k(codes, scale, rows, False, k, t, out)


@njit(**_JIT)
def row_bounds(vecs, codes, scale, out):
    """float64[N] ``out``: per row r, ``b_r = E_r + rho_D C_r + gamma64_D (C_r + E_r)`` with the
    row's own residual and quantised norms (:func:`quantize`'s E and C for that row, the same ulp
    margins; ``rho_D``: :func:`_rounding`): ``2 b_r |q|`` bounds that row's error in either scan
    as :func:`error_bound` does every row's (``Int8Rows.row_errors``)."""
    n, d = vecs.shape
    g32 = _rounding(d)
    g64 = gamma64(d)
    for r in range(n):
        s = np.float64(scale[r])
        e2, c2 = 0.0, 0.0
        for j in range(d):
            v = np.float64(vecs[r, j])
            w = np.float64(codes[r, j]) * s
            e2 += (w - v) * (w - v)
            c2 += w * w
        e = np.sqrt(e2) * (1.0 + 2.0 * d * _U64) + 1e-30
        c = np.sqrt(c2) * (1.0 + 2.0 * d * _U64)
        out[r] = e + g32 * c + g64 * (c + e)
    return out


def query_norm(q: np.ndarray) -> float:
    """``|q|``: the L2 norm of float32[D] ``q`` in float64, as every bound of this module and
    :func:`.kernels_refine.fast_error` takes it (computed once per query by a caller that needs
    several of them)."""
    return float(np.linalg.norm(np.asarray(q, dtype=np.float64)))


@njit(**_JIT)
def gamma64(d):
    """``gamma_D`` of float64 sums of D terms, ``D u / (1 - D u)`` (u = 2^-53; D at least 1)."""
    return max(d, 1) * _U64 / (1.0 - max(d, 1) * _U64)


@njit(**_JIT)
def scan_bound(e, c, d, qn):
    """:func:`error_bound` from ``|q|`` (``qn``): also what :func:`.kernels_refine.flat_top_one` uses."""
    return 2.0 * (e + _rounding(d) * c + gamma64(d) * (c + e)) * qn * (1.0 + 1e-6) + 1e-12


@njit(**_JIT)
def row_factor(qn):
    """:meth:`Int8Rows.row_scale` from ``|q|`` (``qn``): ``2 |q|`` with :func:`error_bound`'s margin."""
    return 2.0 * qn * (1.0 + 1e-6)


def error_bound(e: float, c: float, d: int, q: np.ndarray, qn: float | None = None) -> float:
    """Bound of ``|scan score - canonical score|`` for every row (module docstring), given
    ``(E, C)`` of :func:`quantize`, the width D and the float32[D] query ``q`` (``qn``: its
    :func:`query_norm`, when the caller has it)."""
    return scan_bound(float(e), float(c), int(d), query_norm(q) if qn is None else float(qn))


class Int8Rows:
    """The int8 copy of a flat :class:`.dense.DenseIndex`'s rows, rebuilt (:func:`quantize`,
    ~1 ms per 5K x 384 rows) when the store's write version, the row count or the vectors'
    buffer changes; None above :attr:`MAX_ROWS` rows (a whole rebuild on the first query after
    each write would cost a query ~6 ms at that size while ingest runs; the BLAS scan serves). Costs a quarter of the float32 vectors' memory plus 12 bytes
    a row (the scale and :func:`row_bounds`)."""

    MAX_ROWS = 32_768

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.codes = np.zeros((0, 0), np.int8)
        self.scale = np.zeros(0, np.float32)
        self.e = self.c = 0.0
        self.rb = np.zeros(0, np.float64)  # per-row bounds (row_bounds)

    def of(self, vecs: np.ndarray, version: int) -> "Int8Rows | None":
        """Self, current for float32[N, D] ``vecs`` at store ``version``; None when N is 0 or
        above :attr:`MAX_ROWS`."""
        n = vecs.shape[0]
        if n == 0 or n > self.MAX_ROWS or vecs.dtype != np.float32:
            return None
        key = (version, n, vecs.shape[1], vecs.__array_interface__["data"][0])
        if key != self.key:
            self.key = None
            if not np.isfinite(vecs).all():  # (the BLAS path reports it: dense_step's NOT_FINITE)
                return None
            self.codes = np.empty(vecs.shape, np.int8)
            self.scale = np.empty(n, np.float32)
            self.e, self.c = quantize(np.ascontiguousarray(vecs), self.codes, self.scale)
            self.rb = row_bounds(np.ascontiguousarray(vecs), self.codes, self.scale, np.empty(n, np.float64))
            self.key = key
        return self

    def scores(self, q: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """float32[M]: approximate scores of finite float32[D] ``q`` with every row (None) or
        ``rows``, from the integer scan (:func:`scan_int`)."""
        if rows is None:
            return scan_int(self.codes, self.scale, q, np.empty(self.codes.shape[0], np.float32))
        return scan_int_rows(self.codes, self.scale, rows, q, np.empty(rows.size, np.float32))

    def row_scale(self, q: np.ndarray, qn: float | None = None) -> float:
        """The factor ``f`` of this query's per-row bounds: row r's scan score is within
        ``f rb[r] + 1e-12`` of its canonical one (``2 |q|`` with :func:`error_bound`'s margin;
        ``qn``: :func:`query_norm` of ``q`` when the caller has it)."""
        return row_factor(query_norm(q) if qn is None else float(qn))

    def error(self, q: np.ndarray, qn: float | None = None) -> float:
        """:func:`error_bound` for ``q`` (``qn``: its :func:`query_norm`, when known)."""
        return error_bound(self.e, self.c, self.codes.shape[1], q, qn)


def warm() -> None:
    """Compile (or load from the cache) the kernels for the types a shard passes."""
    v = np.full((4, 8), 0.25, np.float32)
    r = Int8Rows().of(v, 0)
    r.scores(v[0].copy(), None)
    r.scores(v[0].copy(), np.arange(2, dtype=np.int64))
    row_bounds(v, r.codes, r.scale, np.empty(4, np.float64))
    r.error(v[0].copy()), r.row_scale(v[0].copy())  # (the bounds' compiled formulas)
