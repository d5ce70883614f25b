"""A shard's BM25 top-m with block-max bounds over slot ranges: the same result as
:func:`.kernels.bm25_listed_top` (and :func:`.kernels_topm.bm25_top_pruned`) for an unfiltered
query whose idf are all >= 0, reading only the parts of the query terms' lists that can still
reach the top-m.

The slot space is cut into blocks of ``2**shift`` consecutive slots. For each query position
``i`` and block ``j``, ``U[i, j]`` bounds one chunk's contribution of position ``i`` inside
block ``j``: for a long segment list, ``idf[i] * g[t, j]`` with ``g[t, j]`` the largest
``tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / A))`` over the term's live postings in the block,
computed once per term, segment and (k1, b, A) and kept by the caller (``A`` is a reference
average length at least the query's ``avgdl``; the fraction rises with the average length, so
the bound holds for any ``avgdl <= A``); for a short list and for the delta, the exact
contributions of its postings in the block, summed. A chunk of block ``j`` scores at most
``UB[j] = sum_i U[i, j]`` (times ``1 + 1e-9``: far above the rounding of a sum of <= 10^3
terms). Blocks are scored in order of decreasing ``UB``: every query position's postings of the
block are added, position by position in query order from 0.0 (the operations of
``PostingsIndex.score_all``, so the scores are rank_bm25's values bit for bit, as
:func:`.kernels.bm25_listed_top` returns them), into a block-sized accumulator. Scoring stops
at the first block whose ``UB`` is below the m-th largest score found so far: no chunk of it
or of any later block can reach the top-m, nor tie into it. This is the block-max idea of Ding
and Suel ("Faster top-k document retrieval using block-max indexes", SIGIR 2011) over
fixed slot ranges, term-at-a-time inside a block.

The ``listed`` count (chunks with a non-zero score) is exact when every block with a posting
was scored; after a cut it is the largest of the chunks scored, the longest list's live
postings and ``m + 1`` (as in :mod:`.kernels_topm`: "the top-m is not the whole list", which
keeps the threshold bound of dense-first hybrid an upper bound).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _JIT, _kth_largest
from .warm_inputs import postings_variants

#: relative slack on bounds, far above float64 rounding of a sum of <= 10^3 terms
_SLACK = 1e-9


@njit(**_JIT)
def _f(w, tf, dl, avgdl, k1, b, one_b, k1p):
    """One posting's contribution, the operations of ``PostingsIndex.score_all``."""
    norm = k1 * (one_b + b * dl / avgdl)
    return w * (tf * k1p / (tf + norm))


@njit(**_JIT)
def block_bounds(t, offsets, pslots, ptf, where, seg_code, doc_len, shift, ref_avgdl, k1, b, starts, g):
    """Fill segment term ``t``'s block table: ``starts`` int64[W + 1], where ``starts[j]`` is the
    position in ``pslots`` of the term's first posting with a slot >= ``j << shift`` (slots
    ascending within a term; every slot below ``W << shift``), and ``g`` float64[W], the largest
    ``tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / ref_avgdl))`` over its live postings
    (``where[slot] == seg_code``) in block ``j`` (0 where there is none). One pass over the
    list."""
    n_blocks = g.size
    lo, hi = offsets[t], offsets[t + 1]
    one_b, k1p = 1.0 - b, k1 + 1.0
    g[:] = 0.0
    j = 0
    for p in range(lo, hi):
        x = np.int64(pslots[p])
        blk = x >> shift
        while j <= blk:
            starts[j] = p
            j += 1
        if where[x] == seg_code:
            v = _f(1.0, np.float64(ptf[p]), doc_len[x], ref_avgdl, k1, b, one_b, k1p)
            if v > g[blk]:
                g[blk] = v
    while j <= n_blocks:
        starts[j] = hi
        j += 1


@njit(**_JIT)
def _lower(slots, lo, hi, x):
    """First position in the ascending ``slots[lo:hi]`` whose value is >= ``x``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(slots[mid]) < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**_JIT)
def _short_bounds(ub, w, lo, hi, pslots, ptf, where, seg_code, live_only, doc_len, shift, avgdl, k1, b):
    """Add to ``ub`` (per block) the exact contributions of the postings ``lo:hi`` (a short
    segment list, or a delta list when ``live_only`` is False), summed per block."""
    one_b, k1p = 1.0 - b, k1 + 1.0
    for p in range(lo, hi):
        x = np.int64(pslots[p])
        if live_only and where[x] != seg_code:
            continue
        ub[x >> shift] += _f(w, np.float64(ptf[p]), doc_len[x], avgdl, k1, b, one_b, k1p)


@njit(**_JIT)
def _heap_push(heap, size, v):
    """Min-heap of the largest ``heap.size`` values: push ``v`` (replacing the smallest when
    full and ``v`` is larger). :returns: the new size."""
    cap = heap.size
    if size < cap:
        i = size
        heap[i] = v
        while i > 0:
            par = (i - 1) >> 1
            if heap[par] <= heap[i]:
                break
            heap[par], heap[i] = heap[i], heap[par]
            i = par
        return size + 1
    if v <= heap[0]:
        return size
    heap[0] = v
    i = 0
    while True:
        l, r, s = 2 * i + 1, 2 * i + 2, i
        if l < cap and heap[l] < heap[s]:
            s = l
        if r < cap and heap[r] < heap[s]:
            s = r
        if s == i:
            break
        heap[s], heap[i] = heap[i], heap[s]
        i = s
    return size


@njit(**_JIT)
def bm25_top_blockmax(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, seg_df,
                      long_pos, tab_starts, tab_g, shift, m, avgdl, k1, b):
    """:func:`.kernels.bm25_listed_top` of an unfiltered query with every ``idf >= 0`` (module
    docstring).

    :param where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf:
        as :func:`.kernels.bm25_listed_top` (``tids[i] = -1``: no segment list).
    :param seg_df: int[V] live postings per segment term.
    :param long_pos: int64[P]: row of position ``i``'s block table in ``tab_starts`` /
        ``tab_g`` (from :func:`block_bounds`, with a reference average length >= ``avgdl``),
        or -1 for a short list (bounded from its postings).
    :param tab_starts: int64[R, W + 1]; :param tab_g: float64[R, W]: the tables of
        :func:`block_bounds` for the segment's ``W`` blocks (its slots are below ``W << shift``;
        later blocks hold no segment posting).
    :param shift: log2 of the block size in slots.
    :returns: ``(slots int64[C], scores float64[C], listed, cut)``: every chunk with a non-zero
        score at least the m-th largest (C >= min(m, listed)), the listed count (exact unless
        ``cut``) and whether blocks holding postings were left unscored.
    """
    n_pos = tids.size
    n_slots = doc_len.size
    n_blocks = ((n_slots - 1) >> shift) + 1 if n_slots else 0
    bs = np.int64(1) << shift
    one_b, k1p = 1.0 - b, k1 + 1.0
    ub = np.zeros(n_blocks, np.float64)
    listed_lb = 0
    for i in range(n_pos):
        t, w = tids[i], idf[i]
        live = d_off[i + 1] - d_off[i]
        if t >= 0:
            live += np.int64(seg_df[t])
            if w > 0.0:
                r = long_pos[i]
                if r >= 0:
                    g = tab_g[r]
                    for j in range(min(n_blocks, g.size)):
                        ub[j] += w * g[j]
                else:
                    _short_bounds(ub, w, offsets[t], offsets[t + 1], pslots, ptf, where, seg_code, True, doc_len,
                                  shift, avgdl, k1, b)
        if w > 0.0:
            _short_bounds(ub, w, d_off[i], d_off[i + 1], d_slots, d_tf, where, seg_code, False, doc_len, shift,
                          avgdl, k1, b)
            listed_lb = max(listed_lb, live)
    nz = np.flatnonzero(ub > 0.0)
    order = nz[np.argsort(-ub[nz])]
    heap = np.empty(m, np.float64)
    hs = 0
    cap = max(4 * m, 256)
    out_s = np.empty(cap, np.int64)
    out_v = np.empty(cap, np.float64)
    n_out, n_listed, done = 0, 0, 0
    acc = np.zeros(bs, np.float64)
    for k in range(order.size):
        blk = order[k]
        if hs == m and ub[blk] * (1.0 + _SLACK) < heap[0]:
            break
        base = np.int64(blk) << shift
        end = base + bs
        for i in range(n_pos):
            t, w = tids[i], idf[i]
            if t >= 0:
                r = long_pos[i]
                if r >= 0:
                    lo = hi = 0
                    if blk < tab_g.shape[1]:
                        lo, hi = tab_starts[r, blk], tab_starts[r, blk + 1]
                else:
                    lo = _lower(pslots, offsets[t], offsets[t + 1], base)
                    hi = _lower(pslots, lo, offsets[t + 1], end)
                for p in range(lo, hi):
                    x = np.int64(pslots[p])
                    if where[x] == seg_code:
                        acc[x - base] += _f(w, np.float64(ptf[p]), doc_len[x], avgdl, k1, b, one_b, k1p)
            lo = _lower(d_slots, d_off[i], d_off[i + 1], base)
            hi = _lower(d_slots, lo, d_off[i + 1], end)
            for p in range(lo, hi):
                x = d_slots[p]
                acc[x - base] += _f(w, d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
        done += 1
        for j in range(bs):
            v = acc[j]
            if v == 0.0:
                continue
            acc[j] = 0.0
            n_listed += 1
            if hs == m and v < heap[0]:
                continue
            hs = _heap_push(heap, hs, v)
            if n_out == cap:  # keep only those at or above the current m-th largest
                theta = heap[0] if hs == m else -np.inf
                c = 0
                for q in range(n_out):
                    if out_v[q] >= theta:
                        out_s[c], out_v[c] = out_s[q], out_v[q]
                        c += 1
                n_out = c
                if n_out == cap:
                    out_s = np.concatenate((out_s, np.empty(cap, np.int64)))
                    out_v = np.concatenate((out_v, np.empty(cap, np.float64)))
                    cap *= 2
            out_s[n_out], out_v[n_out] = base + j, v
            n_out += 1
    cut = done < order.size
    theta = heap[0] if hs == m else -np.inf
    c = 0
    for q in range(n_out):
        if out_v[q] >= theta:
            out_s[c], out_v[c] = out_s[q], out_v[q]
            c += 1
    listed = max(n_listed, listed_lb, m + 1) if cut else n_listed
    return out_s[:c].copy(), out_v[:c].copy(), listed, cut


def warm() -> None:
    """Compile (or load from numba's cache) the signatures a shard passes (writable and
    read-only postings, uint16 term frequencies)."""
    s = np.arange(3, dtype=np.int64)
    for _, (where, doc_len, off, ps, tf) in postings_variants():
        st, g = np.zeros((1, 3), np.int64), np.zeros((1, 2))
        block_bounds(0, off, ps, tf, where, 1, doc_len, 1, 2.0, 1.5, 0.75, st[0], g[0])
        bm25_top_blockmax(where, 1, doc_len, np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64),
                          s, doc_len, np.ones(1, np.int32), np.zeros(1, np.int64), st, g, 1, 2, 1.0, 1.5, 0.75)
