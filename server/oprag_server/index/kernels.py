"""Compiled kernels (numba) of a shard's hybrid candidate step, bit-identical to the numpy code.

One query's dense candidates (:func:`dense_step`: from approximate float32 scores of the rows,
the exact top-n by canonical score, and the canonical minimum over a fixed sample), the BM25 of
candidate chunks from a CSR postings segment (:func:`bm25_segment`; a shard's full BM25 top-m is
:func:`.kernels_exact.bm25_listed_top`) and the 2-D k-skyband
(:func:`skyband`). The numpy implementations stay the reference each kernel is tested against
(``tests/unit/test_kernels.py``):

* canonical inner products: :func:`.dense.fixed_order_dot` (float32 x float32 products exact
  in float64, the same pairwise fold of the D columns: :func:`_canonical`);
* exact top-n from approximate scores: :func:`.fusion.refine_top` over every row. The BLAS
  scan the caller passes sums in another order than FAISS, but any float32 order errs by at
  most :meth:`.dense.DenseIndex.score_error`, so the shortlist argument of ``refine_top``
  holds and the result, the exact top-n by (canonical score desc, chunk id asc), is the same;
  ties of canonical scores are left to the caller (chunk ids are Python strings);
* BM25 of given chunks: :meth:`.bm25.postings.PostingsIndex.score` (its segment part, the same
  operations in the same order per chunk); skyband: :func:`.fusion.skyband_reference`.

No fast-math anywhere: every float operation is the IEEE one numpy performs. Cached on disk next
to this file, or under ``$NUMBA_CACHE_DIR`` (set under the temp dir when this directory is not
writable); :func:`warm` compiles (or loads) every signature a shard uses, at shard start.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

if "NUMBA_CACHE_DIR" not in os.environ and not os.access(os.path.dirname(os.path.abspath(__file__)), os.W_OK):
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"oprag-numba-{os.getuid()}")

import numba  # noqa: E402
from numba import njit  # noqa: E402
from .warm_inputs import postings_variants  # noqa: E402

if os.environ.get("NUMBA_CACHE_DIR"):  # numba imported earlier reads the variable only at import
    numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

#: status of :func:`dense_step`: done / a score was not finite (the caller uses the numpy path)
OK, NOT_FINITE = 0, 1
_JIT = dict(cache=True, nogil=True)


@njit(**_JIT)
def _canonical(v, q64, buf):
    """Canonical inner product of float32[D] ``v`` with float64[D] ``q64`` (the query, exactly
    widened): :func:`.dense.fixed_order_dot`'s fold, its first step fused with the products
    (each product is exact in float64, so the sums are the same). Loops run over slice views
    from 0 (an offset index keeps LLVM from vectorising them)."""
    w = q64.size
    if w == 0:
        return 0.0
    h = w // 2
    o = w - h
    va, vb, qa, qb = v[:h], v[o:w], q64[:h], q64[o:w]
    for j in range(h):
        buf[j] = np.float64(va[j]) * qa[j] + np.float64(vb[j]) * qb[j]
    if o > h:  # odd width: the middle column waits for the next step
        buf[h] = np.float64(v[h]) * q64[h]
    w = o
    while w > 1:
        h = w // 2
        o = w - h
        x, y = buf[:h], buf[o:w]
        for j in range(h):
            x[j] += y[j]
        w = o
    return buf[0]


@njit(**_JIT)
def _select(x, k):
    """The k-th largest (1 <= k <= size) of float64 ``x`` without NaN, reordering ``x``
    (Hoare's quickselect, median-of-three pivot)."""
    target = x.size - k
    lo, hi = 0, x.size - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        p0, p1, p2 = x[lo], x[mid], x[hi]
        pivot = max(min(p0, p1), min(max(p0, p1), p2))
        i, j = lo, hi
        while i <= j:
            while x[i] < pivot:
                i += 1
            while x[j] > pivot:
                j -= 1
            if i <= j:
                x[i], x[j] = x[j], x[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return x[target]


@njit(**_JIT)
def _kth_largest(a, k):
    """The k-th largest (1 <= k <= size) of a float array without NaN: the same value as
    ``np.partition(a, size - k)[size - k]`` (up to the sign of a zero). A strided sample of
    every 8th element gives a threshold with (very likely) at least k elements at or above it;
    the k-th largest is then the k-th largest of those few (else: a selection over all).
    Written out rather than ``np.partition``: numba compiles that one slowly."""
    m = a.size
    if m >= 1024 and k * 4 <= m:
        ks = min(k // 8 + 8, (m + 7) // 8)
        theta = _select(a[::8].astype(np.float64), ks)
        c = 0
        for i in range(m):
            c += a[i] >= theta
        if c >= k:
            x = np.empty(c, np.float64)
            c = 0
            for i in range(m):
                if a[i] >= theta:
                    x[c] = a[i]
                    c += 1
            return _select(x, k)
    return _select(a.astype(np.float64), k)


@njit(**_JIT)
def _argsort_desc(keys, idx):
    """int64 ``idx`` ordered by ``keys[idx]`` descending, equal keys keeping their order in
    ``idx``: ``idx[np.argsort(-keys[idx], kind="stable")]`` (numba's merge sort, stable; 3-4x
    faster than :func:`_merge_desc` for 256 keys); :func:`_merge_desc` when a key is NaN."""
    k = keys[idx]
    for i in range(k.size):
        if k[i] != k[i]:
            return _merge_desc(keys, idx)
    return idx[np.argsort(-k, kind="mergesort")]


@njit(**_JIT)
def _merge_desc(keys, idx):
    """:func:`_argsort_desc` as a bottom-up merge sort (NaN keys never move ahead of another)."""
    n = idx.size
    a, b = idx.copy(), np.empty_like(idx)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if keys[a[j]] > keys[a[i]]:
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            b[k:k + mid - i] = a[i:mid]
            k += mid - i
            b[k:k + hi - j] = a[j:hi]
        a, b = b, a
        width *= 2
    return a


@njit(**_JIT)
def _sample_low(vecs, rows, all_rows, approx, err, sample, q64, buf64):
    """The dense steps' prologue: ``(False, inf)`` when an approximate score is not finite,
    else ``(True, the sample's canonical minimum)`` (``inf`` with an empty sample):
    refine_top's argument for k = 1 on the lowest score, every row within ``2 err`` of it.
    ``sample``: positions of ``approx`` (rows when ``all_rows``, else positions of ``rows``)."""
    for i in range(approx.size):
        if not np.isfinite(approx[i]):
            return False, np.inf
    low = np.inf
    if sample.size:
        lo = np.float64(np.inf)
        for r in sample:
            lo = min(lo, np.float64(approx[r]))
        for r in sample:
            if np.float64(approx[r]) <= lo + 2.0 * err:
                low = min(low, _canonical(vecs[r if all_rows else rows[r]], q64, buf64))
    return True, low


@njit(**_JIT)
def dense_step(vecs, rows, all_rows, approx, q, err, n, sample):
    """One query's exact dense top-n, and the canonical minimum over a sample of rows.

    :param vecs: float32[N, D] live vectors. :param rows: int64[M] the rows to rank (ignored,
        may be empty, when ``all_rows``: every row, M = N). :param approx: float32[M] their
        approximate scores (one BLAS matrix-vector product: a memory-bound scan this kernel
        would not do faster). :param q: float32[D].
    :param err: bound of ``|approximate - canonical|`` (:meth:`.dense.DenseIndex.score_error`).
    :param n: candidates wanted. :param sample: int64[S] positions of ``approx`` (rows when
        ``all_rows``) whose lowest canonical score is wanted (empty: not wanted, ``inf`` returned).
    :returns: ``(short int64[P], exact float64[P], order int64[C], ties, low, status)``:
        ``rows`` positions (or rows, when ``all_rows``) of the shortlist (approximate score
        within two ``err`` of the n-th), their canonical scores, and ``order``, the shortlist
        positions of every canonical score >= the n-th largest (C >= min(n, M)) by
        (score desc, position asc); ``ties`` when two of them are equal (the caller breaks those
        by chunk id, :func:`.fusion.top_k_order`); the sample minimum; :data:`OK` or
        :data:`NOT_FINITE`. The exact top-n is ``short[order[:n]]`` when there are no ties.
    """
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
    t = _kth_largest(approx, kk)
    cut = t - 2.0 * err
    p = 0
    for i in range(m):
        if np.float64(approx[i]) >= cut:
            p += 1
    short = np.empty(p, np.int64)
    exact = np.empty(p, np.float64)
    p = 0
    for i in range(m):
        if np.float64(approx[i]) >= cut:
            short[p] = i
            exact[p] = _canonical(vecs[i if all_rows else rows[i]], q64, buf64)
            p += 1
    order = _argsort_desc(exact, np.flatnonzero(exact >= _kth_largest(exact, kk)))
    ties = False
    for j in range(1, order.size):
        if exact[order[j]] == exact[order[j - 1]]:
            ties = True
            break
    return short, exact, order, ties, low, OK


@njit(**_JIT)
def bm25_segment(s, where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, avgdl, k1, b, rowmap, rows, span):
    """BM25 of the chunks int64[M] ``s`` from one CSR segment (``offsets`` int64[T+1],
    ``pslots`` int32[P] ascending per term, ``ptf`` uint16/uint32[P]): for each query
    position ``i`` in order with segment term id ``tids[i]`` (-1: absent or no live posting),
    ``out += idf[i] * (tf * (k1 + 1) / (tf + norm))`` where the chunk's postings are in the
    segment (``where[s] == seg_code``) and it has the term; the tf of a position with
    ``rowmap[i] >= 0`` is read from ``rows[rowmap[i]]`` (uint8[R, span], :mod:`.kernels_wide`).
    :returns: ``(out float64[M], norm float64[M])`` with ``norm = k1 * (1 - b + b * doc_len[s]
        / avgdl)`` (the delta layers' additions use it).
    """
    m = s.size
    out = np.zeros(m, np.float64)
    norm = np.empty(m, np.float64)
    one_b, k1p = 1.0 - b, k1 + 1.0
    for j in range(m):
        norm[j] = k1 * (one_b + b * doc_len[s[j]] / avgdl)
    # candidates in ascending slot order: each list searched forward from the last hit (galloping)
    order = _argsort_desc(-s, np.arange(m))
    for i in range(tids.size):
        t = tids[i]
        if t < 0:
            continue
        lo, end = offsets[t], offsets[t + 1]
        w = idf[i]
        if rowmap[i] >= 0:  # one read per chunk instead of a search of a long list
            for j in range(m):
                tf = np.float64(rows[rowmap[i], s[j]]) if s[j] < span and where[s[j]] == seg_code else 0.0
                if tf > 0.0:
                    out[j] += w * (tf * k1p / (tf + norm[j]))
            continue
        for j in order:
            x = s[j]
            if lo >= end:
                break
            if where[x] != seg_code:
                continue
            step, hi = 1, lo
            while hi < end and pslots[hi] < x:  # pslots[lo - 1] < x: gallop to a bracket
                lo = hi + 1
                hi = lo + step
                step *= 2
            hi = min(hi, end)
            while lo < hi:  # leftmost position in [lo, hi) with pslots[pos] >= x
                mid = (lo + hi) >> 1
                if pslots[mid] < x:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < end and pslots[lo] == x:
                tf = np.float64(ptf[lo])
                out[j] += w * (tf * k1p / (tf + norm[j]))
    return out, norm


@njit(**_JIT)
def skyband(d, lx, k):
    """The 2-D k-skyband of float64[M] ``d``, ``lx`` as :func:`.fusion.skyband_reference`:
    ``(positions int64 ascending, True)``, or ``(empty, False)`` when a score is not finite
    (the caller uses the reference). The elements beaten by fewer than ``k`` others (``q``
    beats a listed ``p``, ``lx[p] != 0``, when it is listed and higher on both scores; an
    unlisted one when ``d[q] > d[p]`` and ``lx[q] > 0``).

    Visited by dense score descending, a group of equal dense scores at a time, with a min-heap
    of the ``k`` largest nonzero BM25 scores of the groups before: ``p`` has ``k`` beaters
    exactly when the heap is full and its least value exceeds ``p``'s threshold (``lx[p]``, 0
    for an unlisted ``p``). O(M log M) for the sort, O(M log k) after it."""
    m = d.size
    for i in range(m):
        if not (np.isfinite(d[i]) and np.isfinite(lx[i])):
            return np.zeros(0, np.int64), False
    if k <= 0:
        return np.zeros(0, np.int64), True
    if m <= k:
        return np.arange(m), True
    order = np.argsort(d)[::-1]  # (the order within a group of equal scores does not matter)
    keep = np.zeros(m, np.bool_)
    heap = np.empty(k, np.float64)  # min-heap: the k largest nonzero BM25 scores seen so far
    hn = 0
    a = 0
    while a < m:
        b = a + 1
        while b < m and d[order[b]] == d[order[a]]:  # (beaters need a strictly higher dense score)
            b += 1
        for i in range(a, b):
            p = order[i]
            thr = lx[p] if lx[p] != 0.0 else 0.0
            keep[p] = not (hn == k and heap[0] > thr)
        for i in range(a, b):
            v = lx[order[i]]
            if v == 0.0:
                continue
            if hn < k:  # sift up
                j = hn
                hn += 1
                while j > 0 and heap[(j - 1) >> 1] > v:
                    heap[j] = heap[(j - 1) >> 1]
                    j = (j - 1) >> 1
                heap[j] = v
            elif v > heap[0]:  # replace the least, sift down
                j = 0
                while True:
                    c = 2 * j + 1
                    if c >= k:
                        break
                    if c + 1 < k and heap[c + 1] < heap[c]:
                        c += 1
                    if heap[c] >= v:
                        break
                    heap[j] = heap[c]
                    j = c
                heap[j] = v
        a = b
    return np.flatnonzero(keep), True


def warm(d: int = 8) -> float:
    """Compile (or load from the cache) the kernels for the argument types a shard passes
    (writable and read-only, i.e. memory-mapped, postings; uint16 term frequencies: a segment
    with a frequency over 65,535 compiles its uint32 variant when first scored).

    :returns: seconds taken (about 1 s from the cache; 20-40 s of compilation the first time
        on this 2-core machine, then cached on disk).
    """
    t0 = time.perf_counter()
    vecs = np.full((4, d), 1.0 / np.sqrt(d), np.float32)  # float32, as the shard passes
    q = vecs[0].copy()
    rows = np.arange(4, dtype=np.int64)
    dense_step(vecs, rows, True, vecs @ q, q, 1e-6, 2, rows)
    s = np.arange(3, dtype=np.int64)
    for _, (where, doc_len, off, ps, tf) in postings_variants():
        bm25_segment(s, where, 1, doc_len, np.zeros(1, np.int64), np.ones(1), off, ps, tf, 1.0, 1.5, 0.75,
                     np.zeros(1, np.int64), np.ones((1, 3), np.uint8), 3)
    skyband(np.arange(3.0), np.arange(3.0), 1)
    return time.perf_counter() - t0
