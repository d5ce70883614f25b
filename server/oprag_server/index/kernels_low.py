"""Compiled bottom-layer HNSW search for the dense minimum over an int8 copy of the graph's
vectors (issue 13, :class:`.dense_low.LowSeeds`).

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
``ef`` is 16-64 here. ``stamp`` marks visited vectors with the call's ``mark`` (a byte; cleared every 255 calls).
The int8 rows of a vector's unvisited neighbours are prefetched before they are scored (as FAISS
prefetches before its batched distances: the walk waits on memory, not arithmetic).
"""

from __future__ import annotations

import numpy as np

from . import kernels  # sets numba's cache directory before the first njit; _canonical
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

_FM = {"reassoc", "contract", "nsz"}  # as kernels_scan.scan: the sum in any order (its bound)


@intrinsic
def _prefetch(typingctx, arr, r, j):
    """Prefetch (into all cache levels, for reading) the cache line holding ``arr[r, j]`` of a
    2-D array: LLVM's ``llvm.prefetch``, which never faults."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer2(context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
                                        strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                        inds=[args[1], args[2]])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, r, j), codegen


@njit(cache=True, nogil=True, inline="always")
def _unvisited(nbr, lo, hi, stamp, mark, codes, buf):
    """The vectors of ``nbr[lo:hi]`` (up to the first -1) not marked yet: marked, their int8 rows
    prefetched, listed in ``buf``. :returns: how many."""
    m = 0
    d = codes.shape[1]
    for t in range(lo, hi):
        r = nbr[t]
        if r < 0:
            break
        if stamp[r] == mark:
            continue
        stamp[r] = mark
        for j in range(0, d, 64):
            _prefetch(codes, np.int64(r), np.int64(j))
        buf[m] = r
        m += 1
    return m


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
    :param entries: int64[E] start vectors (graph ids < A). :param stamp: uint8[>= A] visited
        marks; ``mark`` this call's (1-255). :param out_i: int64[ef] and ``out_d`` float32[ef]: filled
        with the live vectors kept and their approximate scores.
    :returns: how many were kept (the first that many of ``out_i`` / ``out_d``).
    """
    cd = np.empty(ef, np.float32)
    ci = np.empty(ef, np.int64)
    cv = np.zeros(ef, np.bool_)
    buf = np.empty(width, np.int64)
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
            m = _unvisited(nbr, offsets[c], offsets[c] + width, stamp, mark, codes, buf)
            for t in range(m):
                r = buf[t]
                d = _score(codes, scale, r, q)
                if ann_slot[r] >= 0:
                    nr = _keep(r, d, out_i, out_d, nr, ef)
                n, nvalid = _cand(r, d, cd, ci, cv, n, nvalid, ef)
    return nr


@njit(cache=True, nogil=True)
def canonical_rows(vecs, rows, q):
    """float64[M]: canonical inner products of the rows int64[M] of float32[N, D] ``vecs`` with
    float32[D] ``q`` (the same values as ``fixed_order_dot(vecs[rows], q)``: :func:`.kernels._canonical`
    per row), the next row's cache lines prefetched while one row is scored: the rows are
    scattered over a shard's vectors (a dense top-n, the BM25 list), each a run of misses otherwise."""
    q64 = q.astype(np.float64)
    buf = np.empty(max(q.size, 1), np.float64)
    out = np.empty(rows.size, np.float64)
    d = vecs.shape[1]
    for i in range(rows.size):
        if i + 1 < rows.size:
            for j in range(0, d, 16):
                _prefetch(vecs, rows[i + 1], np.int64(j))
        out[i] = kernels._canonical(vecs[rows[i]], q64, buf)
    return out


def warm() -> None:
    """Compile (or load from numba's cache) :func:`low_search` for the types a shard passes."""
    codes, scale = np.ones((3, 4), np.int8), np.ones(3, np.float32)
    nbr = np.array([1, 2, 0, 2, 0, 1], np.int32)
    low_search(nbr, np.array([0, 2, 4, 6], np.int64), 2, codes, scale, np.arange(3, dtype=np.int64),
               np.ones(4, np.float32), np.zeros(1, np.int64), 2, np.zeros(3, np.uint8), 1,
               np.empty(2, np.int64), np.empty(2, np.float32))
    canonical_rows(np.ones((3, 4), np.float32), np.arange(3, dtype=np.int64), np.ones(4, np.float32))
