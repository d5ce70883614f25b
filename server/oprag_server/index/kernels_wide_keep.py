""":func:`.kernels_wide.bm25_top_wide` in steps, so that a shard can answer a dense-first widening
round (:class:`oprag_server.operators.hybrid.Widening`: the same query asking for the BM25
top-``4m`` after its top-``m``) without a second full pass over the segment
(:mod:`.bm25.listed_cache`):

* :func:`wide_pass` is the pass over the segment's slots (the narrow, delta and wide terms'
  float32 scores, block by block) for ``m``, as there, plus the delta chunks past ``span``:
  ``(cand int64[C], approx float64[C], listed, sub_max, past)``: every chunk whose
  approximate score reaches the pass's final threshold, in ascending slot order (then the
  chunks past ``span``), the exact listed count, and the largest approximate score of every
  :data:`SUB` slots (noting it costs a read of the block's scores, which are in L1; a block the
  pass skipped by its bound notes 0 and the bound beside it: ``sub_max[0]`` / ``sub_max[1]``);
* :func:`wide_finish` is the exact rescoring: the candidates whose approximate score reaches
  the m-th largest one (less the slack) are scored again from 0.0 with
  ``PostingsIndex.score_all``'s operations and their top-m returned;
* :func:`wide_rescan` gives, for a larger m', a superset of the candidates a pass for m'
  would keep, in the same order, by passing again only the blocks of :data:`SUB` slots whose
  noted maximum (or bound, for a skipped block) reaches a lower bound of the m'-th largest
  approximate score (the m'-th largest noted maximum).

``wide_finish(*wide_pass(m)[:2], m)`` is :func:`.kernels_wide.bm25_top_wide`'s ``(slots,
scores)`` element for element (the same code), and so is ``wide_finish(cand, approx, m'')``
for any ``m'' <= m`` (a pass's buffer never drops a chunk whose approximate score reaches its
final threshold, which is at most the m-th largest approximate score times (1 - slack), so the
m'' largest approximate scores and every chunk within the slack of the m''-th are in it, in
slot order) and ``wide_finish(*wide_rescan(...), m')`` for a larger m' (:func:`wide_rescan`).
tests/unit/test_listed_cache.py checks all three against the one-step kernel and the numpy
path, tests/unit/test_wide_skip.py the skipping pass against the pass without bounds. The code
is :mod:`.kernels_wide`'s, split after step (3)'s candidates.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _JIT, _kth_largest
from .kernels_low import _prefetch
from .kernels_topm import _f, _probe
from .kernels_wide import _APPROX, _BLOCK, SUB, _block, _compact, _narrow


@njit(**_JIT)
def _max(bits):
    """The largest of ``bits``, the int32 bit patterns of float32 scores >= 0 (ordered as the
    scores are; an integer maximum vectorises, a float one does not without fastmath)."""
    v = np.int32(0)
    for q in range(bits.size):  # (indices known >= 0: no wraparound check)
        v = max(v, bits[q])
    return v


@njit(cache=True, nogil=True, error_model="numpy")
def _bounds(bmax, bratio, wrow, w32, a0, a1, k1p, slack):
    """float64[G]: per block g of :data:`SUB` slots an upper bound of the wide terms' float32 sum
    (:func:`.kernels_wide._block`) at any slot of it. rank_bm25's term is
    ``w tf (k1 + 1) / (tf + k1 (1 - b) + k1 b dl / avgdl) = w (k1 + 1) / (1 + a0 / tf + a1 dl / tf)``;
    with ``T = bmax[r, g]`` the row's largest tf in the block and ``Q = bratio[r, g]`` its largest
    tf / dl there (:func:`.kernels_wide.fill_row`), every slot's term is at most
    ``w (k1 + 1) / (1 + a0 / T + a1 / Q)`` (0 when T is 0); times ``slack`` (> 1) for the float32
    rounding of the pass."""
    ub = np.zeros(bmax.shape[1])
    for j in range(wrow.size):
        w, r = np.float64(w32[j]) * k1p, wrow[j]
        tm, qm = bmax[r], bratio[r]
        for g in range(ub.size):  # (branch-free: T = 0 adds w / (1 + a0 * 1e30 + ...), ~0, an upper bound of 0)
            t = max(np.float64(tm[g]), 1e-30)
            ub[g] += w / (1.0 + a0 / t + a1 / max(np.float64(qm[g]), 1e-30))
    for g in range(ub.size):
        ub[g] *= slack
    return ub


@njit(**_JIT)
def _count(rows, base, wrow, wh, la, seg_code, u):
    """Slots ``base`` on of a run of skipped blocks: their non-zero scores (as
    :func:`.kernels_wide._block` counts them: a segment chunk holding a wide term of weight > 0
    in ``wrow``, or a partial score ``la`` > 0), ``la`` zeroed; ``u`` uint8 scratch of ``la.size``."""
    n = la.size
    u[:n] = 0
    for j in range(wrow.size):
        row = rows[wrow[j], base:base + n]
        for q in range(n):
            u[q] |= row[q]
    cnt = 0
    for q in range(n):
        cnt += np.int32(((u[q] != 0) & (wh[q] == seg_code)) | (la[q] > np.float32(0.0)))
        la[q] = np.float32(0.0)
    return cnt


@njit(**_JIT)
def _keep(bx, bv, nb, thr, m, base, s, bq, k):
    """Append the chunks ``bq[:k]`` (scores ``s``, slot ``base`` at 0) reaching ``thr`` to the
    buffer ``bx`` / ``bv`` of ``nb`` entries (compacted, :func:`.kernels_wide._compact`, or grown
    when full). :returns: ``(bx, bv, nb, thr)``."""
    for j in range(k):
        q = bq[j]
        if s[q] < thr:
            continue
        if nb == bx.size:
            nb, thr = _compact(bx, bv, nb, m, thr)
            if nb * 2 > bx.size:
                bx2, bv2 = np.empty(bx.size * 2, np.int64), np.empty(bx.size * 2, np.float64)
                bx2[:nb], bv2[:nb] = bx[:nb], bv[:nb]
                bx, bv = bx2, bv2
        bx[nb], bv[nb] = base + q, np.float64(s[q])
        nb += 1
    return bx, bv, nb, thr


@njit(cache=True, nogil=True, inline="always")
def _ahead(rows, wrow, seg_len2, where2, lo, hi):
    """Prefetch the cache lines of slots ``lo`` to ``hi`` (the next block) of the wide rows ``wrow``, the lengths and
    the layer codes, while the pass scores this block: ~5% off a cold 500K-slot pass (1,019 -> 967 us p50 for SciFact
    queries after a 48 MB sweep; bench/RESULTS.md, session 59)."""
    for j in range(wrow.size):
        for x in range(lo, hi, 64):
            _prefetch(rows, wrow[j], x)
    for x in range(lo, hi, 64 // seg_len2.itemsize):
        _prefetch(seg_len2, 0, x)
    for x in range(lo, hi, 64):
        _prefetch(where2, 0, x)


@njit(**_JIT)
def wide_pass(where, seg_code, doc_len, seg_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf,
              is_wide, wide_row, rows, span, m, avgdl, k1, b, acc, seen, bmax, bratio, thr0):
    """Steps (1)-(3) of :func:`.kernels_wide.bm25_top_wide` (module docstring), noting the
    largest approximate score of every :data:`SUB` slots.

    ``thr0``: a lower bound of the m-th largest approximate score (0.0: none), the threshold the
    pass starts from (:func:`..bm25.listed_top.listed_top_scored` takes the m-th largest exact
    BM25 score of the dense candidates, less the slack). Block bounds (``bmax`` uint8 and
    ``bratio`` float32 [R, ceil(span / SUB)], :func:`.kernels_wide.fill_row`; zero columns:
    none): a block whose upper bound (:func:`_bounds` plus its largest partial score, the narrow
    and delta terms' exact float32 sums) is below the threshold is not scored, since none of its
    chunks can be kept. Its non-zero scores are still counted (:func:`_count`: ``listed`` stays
    exact), its noted maximum is 0 and its upper bound is noted beside it.

    :returns: ``(cand int64[C], approx float64[C], listed, sub_max float32[2, G], past)``: the
        candidates in ascending slot order (then the delta chunks past ``span``, the last
        ``past``); ``sub_max[0]`` the noted maxima (a lower bound of each block's largest
        approximate score), ``sub_max[1]`` an upper bound of it (equal where the block was scored)."""
    n_pos = tids.size
    one_b, k1p = 1.0 - b, k1 + 1.0
    a0, a1 = k1 * one_b, k1 * b / avgdl
    k1p32, a032, a132 = np.float32(k1p), np.float32(a0), np.float32(a1)
    seg_len2, where2 = seg_len[:span].reshape((1, span)), where[:span].reshape((1, span))  # (2-D: _prefetch)
    total = 0
    nw = 0
    for i in range(n_pos):
        total += d_off[i + 1] - d_off[i]
        nw += is_wide[i]
    wide_pos, wrow = np.empty(nw, np.int64), np.empty(nw, np.int64)
    c = 0
    cur_s, end_s = np.empty(n_pos, np.int64), np.empty(n_pos, np.int64)
    cur_d = d_off[:n_pos].copy()
    w32n = np.empty(n_pos, np.float32)
    for i in range(n_pos):
        t = tids[i]
        if is_wide[i]:
            wide_pos[c], wrow[c] = i, wide_row[i]
            c += 1
        cur_s[i], end_s[i] = (offsets[t], offsets[t + 1]) if t >= 0 and not is_wide[i] else (0, 0)
        w32n[i] = np.float32(idf[i])
    nsub = (span + SUB - 1) // SUB
    mx = np.zeros((2, nsub), np.int32)  # float32 bit patterns
    mxf = mx.view(np.float32)
    thr = max(thr0, 0.0)
    cap = max(8 * m, 4096)
    bx, bv = np.empty(cap, np.int64), np.empty(cap, np.float64)
    nb = 0
    lim = 4 * m
    listed = 0
    w32 = w32n[wide_pos]
    skip = bmax.shape[1] == nsub and nsub > 0
    ub = _bounds(bmax, bratio, wrow, w32, a0, a1, k1p, 1.0 + 1e-6 * (nw + 8)) if skip else np.zeros(nsub)
    wpos = wrow[w32 > np.float32(0.0)]  # (a weight-0 term scores 0: not counted)
    u = np.empty(_BLOCK, np.uint8)
    s = np.empty(_BLOCK, np.float32)
    bits = s.view(np.int32)
    nrm = np.empty(_BLOCK, np.float32)
    la = np.zeros(_BLOCK, np.float32)
    lai = la.view(np.int32)
    one = np.zeros(1, np.int32)
    onef = one.view(np.float32)
    bq = np.empty(_BLOCK + 1, np.int64)
    skp = np.zeros(_BLOCK // SUB, np.bool_)  # a block's sub-blocks of SUB slots skipped
    for base in range(0, span, _BLOCK):
        n = min(_BLOCK, span - base)
        _ahead(rows, wrow, seg_len2, where2, base + _BLOCK, min(base + 2 * _BLOCK, span))
        for i in range(n_pos):
            cur_s[i] = _narrow(cur_s[i], end_s[i], base + n, base, pslots, ptf, where, seg_code, seg_len, w32n[i],
                               k1p32, a032, a132, la)
            p = cur_d[i]
            while p < d_off[i + 1] and d_slots[p] < base + n:
                x = d_slots[p]
                la[x - base] += _f(idf[i], d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
                p += 1
            cur_d[i] = p
        g0 = base // SUB
        ns = (n + SUB - 1) // SUB
        thr32 = np.float32(thr * (1.0 - 1e-7))
        for h in range(ns):
            skp[h] = False
            if skip and thr > 0.0:  # (la >= 0: the integer maximum of its bit patterns vectorises)
                one[0] = _max(lai[h * SUB:min(h * SUB + SUB, n)])
                bound = ub[g0 + h] + np.float64(onef[0]) * (1.0 + 1e-6)
                if bound < np.float64(thr32):  # no chunk of the sub-block reaches the threshold
                    skp[h] = True
                    mxf[1, g0 + h] = np.float32(bound * (1.0 + 1e-6))
        h = 0
        while h < ns:  # runs of scored and of skipped sub-blocks
            e = h + 1
            while e < ns and skp[e] == skp[h]:
                e += 1
            lo, hi = h * SUB, min(e * SUB, n)
            if skp[h]:
                listed += _count(rows, base + lo, wpos, where[base + lo:base + hi], la[lo:hi], seg_code, u)
            else:
                cnt, k = _block(rows, base + lo, wrow, w32, k1p32, seg_len[base + lo:base + hi],
                                where[base + lo:base + hi], la[lo:hi], seg_code, a0, a1, thr32, s[lo:hi], nrm[lo:hi],
                                bq)
                listed += cnt
                for g in range(h, e):
                    mx[0, g0 + g] = _max(bits[g * SUB:min(g * SUB + SUB, n)])
                    mx[1, g0 + g] = mx[0, g0 + g]
                bx, bv, nb, thr = _keep(bx, bv, nb, thr, m, base + lo, s[lo:hi], bq, k)
            h = e
        if nb >= lim:
            nb, thr = _compact(bx, bv, nb, m, thr)
            lim = max(4 * m, 2 * nb)
    o = np.argsort(bx[:nb])  # ascending slots
    bx[:nb], bv[:nb] = bx[:nb][o], bv[:nb][o]
    past = np.empty(total, np.int64)
    npast = 0
    for i in range(n_pos):
        for p in range(cur_d[i], d_off[i + 1]):
            x = d_slots[p]
            acc[x] += _f(idf[i], d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
            if seen[x] == 0:
                seen[x] = 1
                past[npast] = x
                npast += 1
    nc = nb
    for j in range(npast):
        nc += acc[past[j]] != 0.0
    cx, cv = np.empty(nc, np.int64), np.empty(nc, np.float64)
    c = 0
    for j in range(nb):
        cx[c], cv[c] = bx[j], bv[j]
        c += 1
    for j in range(npast):
        x = past[j]
        if acc[x] != 0.0:
            cx[c], cv[c] = x, np.float64(acc[x])
            c += 1
        acc[x], seen[x] = 0.0, 0
    listed += c - nb
    return cx, cv, listed, mx.view(np.float32), c - nb


@njit(**_JIT)
def wide_rescan(sub_max, low, cx, cv, past, where, seg_code, doc_len, seg_len, tids, idf, offsets, pslots, ptf,
                d_off, d_slots, d_tf, is_wide, wide_row, rows, span, avgdl, k1, b):
    """The candidates of :func:`wide_pass` for a larger m, from the pass of the same query that
    noted ``sub_max``: ``low`` is a lower bound of the new m-th largest approximate score (the
    m-th largest of ``sub_max``: m distinct chunks score at least that), so every chunk the
    pass would keep for that m is in a block of :data:`SUB` slots whose largest score reaches
    ``low * (1 - slack)`` and scores at least that itself. Those blocks are passed again (the
    same float32 operations per slot: a chunk's score does not depend on the block it is in),
    and their chunks reaching ``low * (1 - slack)``, in ascending slot order, are returned with
    the earlier pass's ``past`` last candidates (the delta chunks past ``span``) appended: a
    superset, in the same order, of what the pass would keep, which :func:`wide_finish` cuts to
    the same list. :returns: ``(cand int64[C'], approx float64[C'])``."""
    n_pos = tids.size
    one_b, k1p = 1.0 - b, k1 + 1.0
    a0, a1 = k1 * one_b, k1 * b / avgdl
    k1p32, a032, a132 = np.float32(k1p), np.float32(a0), np.float32(a1)
    lth = low * (1.0 - _APPROX)
    nw = 0
    for i in range(n_pos):
        nw += is_wide[i]
    wrow, w32 = np.empty(nw, np.int64), np.empty(nw, np.float32)
    cur_s, end_s = np.empty(n_pos, np.int64), np.empty(n_pos, np.int64)
    cur_d = d_off[:n_pos].copy()
    w32n = np.empty(n_pos, np.float32)
    c = 0
    for i in range(n_pos):
        t = tids[i]
        w32n[i] = np.float32(idf[i])
        if is_wide[i]:
            wrow[c], w32[c] = wide_row[i], w32n[i]
            c += 1
        cur_s[i], end_s[i] = (offsets[t], offsets[t + 1]) if t >= 0 and not is_wide[i] else (0, 0)
    nsel = 0
    for g in range(sub_max.size):
        nsel += np.float64(sub_max[g]) >= lth
    ox, ov = np.empty(nsel * SUB + past, np.int64), np.empty(nsel * SUB + past, np.float64)
    no = 0
    s = np.empty(SUB, np.float32)
    nrm = np.empty(SUB, np.float32)
    la = np.zeros(SUB, np.float32)
    bq = np.empty(SUB + 1, np.int64)
    thr32 = np.float32(lth * (1.0 - 1e-7))
    for g in range(sub_max.size):
        if not np.float64(sub_max[g]) >= lth:
            continue
        base = g * SUB
        n = min(SUB, span - base)
        for i in range(n_pos):
            p, hi = cur_s[i], end_s[i]
            if p < hi and pslots[p] < base:
                p += np.searchsorted(pslots[p:hi], base)
            cur_s[i] = _narrow(p, hi, base + n, base, pslots, ptf, where, seg_code, seg_len, w32n[i],
                               k1p32, a032, a132, la)
            p, hi = cur_d[i], d_off[i + 1]
            if p < hi and d_slots[p] < base:
                p += np.searchsorted(d_slots[p:hi], base)
            while p < hi and d_slots[p] < base + n:
                x = d_slots[p]
                la[x - base] += _f(idf[i], d_tf[p], doc_len[x], avgdl, k1, b, one_b, k1p)
                p += 1
            cur_d[i] = p
        _, k = _block(rows, base, wrow, w32, k1p32, seg_len[base:base + n], where[base:base + n], la[:n], seg_code,
                      a0, a1, thr32, s[:n], nrm[:n], bq)
        for j in range(k):
            q = bq[j]
            if s[q] >= lth:
                ox[no], ov[no] = base + q, np.float64(s[q])
                no += 1
    for j in range(cx.size - past, cx.size):
        ox[no], ov[no] = cx[j], cv[j]
        no += 1
    return ox[:no], ov[:no]


@njit(**_JIT)
def wide_finish(cx, cv, m, where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf,
                is_wide, wide_row, rows, span, avgdl, k1, b):
    """Step (4) of :func:`.kernels_wide.bm25_top_wide` for ``m`` over :func:`wide_pass`'s
    candidates (of a ``keep >= m``). :returns: ``(slots int64[K], scores float64[K])``."""
    n_pos = tids.size
    one_b, k1p = 1.0 - b, k1 + 1.0
    if cx.size > m:
        th = _kth_largest(cv, m) * (1.0 - _APPROX)
        cx = cx[np.flatnonzero(cv >= th)]
    ex = np.zeros(cx.size, np.float64)
    for i in range(n_pos):
        for j in range(cx.size):
            x = cx[j]
            if is_wide[i]:
                tf = rows[wide_row[i], x] if x < span and where[x] == seg_code else 0
                if tf > 0:
                    ex[j] += _f(idf[i], np.float64(tf), doc_len[x], avgdl, k1, b, one_b, k1p)
                    continue
                v, hit = _probe(i, idf[i], -1, x, offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code,
                                doc_len, avgdl, k1, b)
            else:
                v, hit = _probe(i, idf[i], tids[i], x, offsets, pslots, ptf, d_off, d_slots, d_tf, where, seg_code,
                                doc_len, avgdl, k1, b)
            if hit:
                ex[j] += v
    keep = np.flatnonzero(ex != 0.0)
    cx, ex = cx[keep], ex[keep]
    if cx.size <= m:
        return cx, ex
    sel = np.flatnonzero(ex >= _kth_largest(ex, m))
    return cx[sel], ex[sel]


def warm() -> None:
    """Compile (or load from numba's cache) the signatures a shard passes."""
    from .warm_inputs import postings_variants  # noqa: PLC0415

    s = np.arange(3, dtype=np.int64)
    for _, (where, doc_len, off, ps, tf) in postings_variants():
        rows = np.zeros((1, 3), np.uint8)
        args = (np.zeros(1, np.int64), np.ones(1), off, ps, tf, np.zeros(2, np.int64), s, doc_len,
                np.ones(1, np.bool_), np.zeros(1, np.int64), rows, 3)
        dl = doc_len.astype(np.uint16)
        cx, cv, _, mx, past = wide_pass(where, 1, doc_len, dl, *args, 2, 1.0, 1.5, 0.75,
                                        np.zeros(3, np.float32), np.zeros(3, np.uint8), np.ones((1, 1), np.uint8),
                                        np.ones((1, 1), np.float32), 0.0)
        wide_finish(cx, cv, 2, where, 1, doc_len, *args, 1.0, 1.5, 0.75)
        wide_rescan(mx[1], 0.5, cx, cv, past, where, 1, doc_len, dl, *args, 1.0, 1.5, 0.75)
