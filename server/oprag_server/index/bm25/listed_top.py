"""A shard's exact BM25 top-m over its allowed chunks (dense-first hybrid's BM25 list,
:meth:`oprag_server.shards.search.Searcher.search`): compiled (:func:`..kernels_exact.bm25_listed_top`)
over the query terms' postings only (the CSR segment with its live mask, and the delta layers),
with the numpy path, :meth:`.postings.PostingsIndex.score_all`, as the reference it is tested
against (``tests/unit/test_kernels.py``)."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

from . import listed_cache
from .merging import _SEG
from .okapi import check_avgdl, check_query
from .postings import PostingsIndex
from .wide_rows import WideRows as _Wide, bounds as _bounds, start as _start

_EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.float64), 0)
_NO_SLOTS = np.zeros(0, np.int64)


def listed_top(ix: PostingsIndex, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float, b: float,
               m: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The chunks that can be in the top-m by BM25 among the live ``allowed`` chunks (None: all)
    whose score is not 0 (:func:`..fusion.lexical_listed`), and how many of those there are.

    :param terms, idf, avgdl, k1, b: as :meth:`.postings.PostingsIndex.score_all` (whose values
        these are, bit for bit). :param m: >= 1. :param allowed: int64[A] ascending slots.
    :returns: ``(slots int64[C], scores float64[C], listed)``: every such chunk scoring at least
        the m-th largest score, in no particular order (C >= min(m, listed); the caller breaks
        ties by chunk id, :func:`..fusion.top_k_order`).
    :raises ValueError: ``len(idf) != len(terms)``; ``avgdl`` negative/NaN/inf; ``m`` < 1.
    """
    return listed_top_scored(ix, terms, idf, avgdl, k1, b, m, allowed)[:3]


def listed_top_scored(ix: PostingsIndex, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float, b: float,
                      m: int, allowed: np.ndarray | None = None, at: np.ndarray | None = None,
                      score_at: Callable[[], np.ndarray] | None = None, cache_version: int | None = None) -> tuple:
    """:func:`listed_top`, plus the BM25 score of each slot of int64[C] ``at`` (live chunks, any
    order): from the pass itself when it reads every posting of the query
    (:func:`..kernels_exact.bm25_listed_top`: the same accumulator, so
    :meth:`.postings.PostingsIndex.score`'s values bit for bit; 0.0 for a chunk holding no query
    term); else (a pruned path: large shards) ``score_at()``, called *before* the pruned pass
    (which streams megabytes: the candidates' postings are read while still warm), or None
    without it. ``at`` must then hold distinct live chunks: on the wide path the m-th largest
    of their scores is the pass's starting threshold (:func:`.wide_rows.start`).

    :param cache_version: the caller's write counter (``ChunkStore.version``): an unfiltered
        query on the wide path then keeps what its pass left (:mod:`.listed_cache`), and a
        later call for the same query (a widening round: a larger m) is answered from it,
        with the same result, re-passing only the blocks that can hold its top-m
        (:mod:`..kernels_wide_keep`), while neither the counter nor the index's layers change.
        None: nothing kept or looked up.
    :returns: ``(slots, scores, listed, at_scores float64[C] | None)``.
    """
    from .. import kernels_exact  # noqa: PLC0415 - numba only in processes that score

    idf = check_query(terms, idf)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    at = _NO_SLOTS if at is None else np.ascontiguousarray(at, dtype=np.int64)
    if not check_avgdl(avgdl) or not terms:
        return (*_EMPTY, np.zeros(at.size, np.float64))
    seg, seg_df = ix._seg, ix._seg_df  # noqa: SLF001 - the index's own package
    every = allowed is None
    tids, d_off, ds, dt = _query_arrays(ix, terms)
    # (only the pruned path keeps lists, so only it looks one up: a query below _FULL_BELOW has none)
    if every and _PRUNE and _postings(seg, tids) + ds.size >= _FULL_BELOW and bool(np.all(idf >= 0.0)):
        cache = None
        if cache_version is not None and _CACHE:
            lc = listed_cache.of(ix)
            cache = (lc, lc.generation(ix, cache_version), lc.key(terms, idf, avgdl, k1, b))
            e = lc.get(cache[1], cache[2])
            got = _from_kept(ix, e, m, idf, avgdl, k1, b) if e is not None else None
            if got is not None:  # a widening round
                at_scores = score_at() if score_at is not None else None
                return (*got, at_scores)
        at_scores = score_at() if score_at is not None else None
        thr0 = _start(at_scores, m)
        return (*_pruned(ix, seg, seg_df, tids, idf, d_off, ds, dt, m, avgdl, k1, b, cache, thr0), at_scores)
    al = _NO_SLOTS if every else np.ascontiguousarray(allowed, dtype=np.int64)
    norm, t1 = _norms(ix, avgdl, k1, b, cache_version)
    slots, scores, listed, at_scores = kernels_exact.bm25_listed_top_pre(
        ix._where, _SEG, ix._doc_len, tids, idf, seg.offsets, seg.slots, seg.tf,  # noqa: SLF001
        d_off, ds, dt, al, every, int(m), float(avgdl), float(k1), float(b), at, norm, t1)
    return slots, scores, int(listed), at_scores


_NO_F = np.zeros(0, np.float64)


def _norms(ix: PostingsIndex, avgdl: float, k1: float, b: float, version: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The per-chunk BM25 factors (:func:`..kernels_exact.bm25_norms`) under ``avgdl``, ``k1``,
    ``b``, kept on the index until the write counter ``version`` (``ChunkStore.version``: moved by
    every write), the parameters or the length array change; two empty arrays (computed per
    posting) without a counter. The pass then does one division per posting or none (tf = 1)."""
    if version is None:
        return _NO_F, _NO_F
    from .. import kernels_exact  # noqa: PLC0415 - numba only in processes that score

    dl = ix._doc_len  # noqa: SLF001 - the index's own package
    key = (version, float(avgdl), float(k1), float(b), id(dl), dl.size)
    got = ix.__dict__.get("_bm25_norms")
    if got is None or got[0] != key:
        got = (key, *kernels_exact.bm25_norms(dl, float(avgdl), float(k1), float(b)))
        ix.__dict__["_bm25_norms"] = got
    return got[1], got[2]


def _query_arrays(ix: PostingsIndex, terms: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The compiled BM25 kernels' view of a query: ``(tids int64[T], d_off int64[T+1], d_slots
    int64[Q], d_tf float64[Q])``: per query position its segment term id (-1: absent or no live
    posting) and the live postings of the delta layers (ascending slots per position)."""
    seg_df, vocab = ix._seg_df, ix._seg.vocab  # noqa: SLF001 - the index's own package
    tids = np.array([-1 if t is None or not seg_df[t] else t for t in map(vocab.get, terms)], np.int64)
    layers = [(layer, code) for layer, code in ix._delta_layers() if layer.n]  # noqa: SLF001 - live postings only
    if not layers:  # (a loaded snapshot, a merge just installed: ~30 us less per shard search, session 29)
        return tids, np.zeros(len(terms) + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    d_slots, d_tf, d_off = [], [], [0]
    for t in terms:
        got = [a for layer, code in layers if (a := layer.arrays(t, ix._where, code)) is not None]  # noqa: SLF001
        if len(got) > 1:  # ascending slots per position (the MaxScore path searches them)
            s_, f_ = np.concatenate([a[0] for a in got]), np.concatenate([a[1] for a in got])
            o = np.argsort(s_, kind="stable")
            got = [(s_[o], f_[o])]
        for a in got:
            d_slots.append(a[0])
            d_tf.append(a[1])
        d_off.append(sum(map(len, d_slots)))
    ds = np.concatenate(d_slots).astype(np.int64, copy=False) if d_slots else np.zeros(0, np.int64)
    dt = np.concatenate(d_tf).astype(np.float64, copy=False) if d_tf else np.zeros(0, np.float64)
    return tids, np.asarray(d_off, np.int64), ds, dt


def scores_at(ix: PostingsIndex, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float, b: float,
              at: np.ndarray) -> np.ndarray:
    """float64[A]: :meth:`.postings.PostingsIndex.score_all`'s score of each slot of int64[A]
    ``at`` (bit for bit; 0.0 where it returns none), compiled (:func:`..kernels_exact.bm25_at`).
    Exact mode's BM25 of every chunk, read in the dense index's row order.

    :raises ValueError: ``len(idf) != len(terms)``; ``avgdl`` negative/NaN/inf.
    """
    from ..kernels_exact import bm25_at  # noqa: PLC0415 - numba only in processes that score

    idf = check_query(terms, idf)
    at = np.ascontiguousarray(at, dtype=np.int64)
    if not check_avgdl(avgdl) or not terms or not at.size:
        return np.zeros(at.size, np.float64)
    tids, d_off, ds, dt = _query_arrays(ix, terms)
    seg = ix._seg  # noqa: SLF001
    return bm25_at(ix._where, _SEG, ix._doc_len, tids, idf, seg.offsets, seg.slots, seg.tf,  # noqa: SLF001
                   d_off, ds, dt, at, float(avgdl), float(k1), float(b))


#: the MaxScore path (:mod:`..kernels_topm`) for unfiltered queries; False: always read every list
_PRUNE = True
#: queries with fewer postings than this read every list (the full kernel): below it the pruned
#: paths' fixed costs (term bounds, rows, rescoring) exceed what they save (at 5K chunks per shard
#: 0.19 ms full vs 0.39 wide / 0.47 MaxScore p50 for SciFact queries; bench/RESULTS.md)
_FULL_BELOW = 65536
#: keep the wide path's candidates for widening rounds (:mod:`.listed_cache`); False: never
_CACHE = True


def _postings(seg, tids: np.ndarray) -> int:
    """Segment postings of the query positions (repeats count again)."""
    t = tids[tids >= 0]
    return int((seg.offsets[t + 1] - seg.offsets[t]).sum()) if t.size else 0


#: the wide-term path (:mod:`..kernels_wide`) when its rows hold at least span / _WIDE_GAIN of
#: the query's postings (a pass over the span costs about as much as reading that many postings)
_WIDE = True
_WIDE_GAIN = 4


class _Scratch:
    """One shard's per-slot scratch of :func:`..kernels_topm.bm25_top_pruned` and the term
    bounds of its current segment (recomputed when the segment object changes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acc = np.zeros(0, np.float64)
        self.acc32 = np.zeros(0, np.float32)
        self.seen = np.zeros(0, np.uint8)
        self.seg: object = None
        self.bounds: tuple[np.ndarray, np.ndarray] | None = None
        self.wide: _Wide | None = None

    def nbytes(self) -> int:
        """Bytes held: the scratch arrays, the term bounds and the wide rows built (resident)."""
        n = self.acc.nbytes + self.seen.nbytes + self.acc32.nbytes
        n += sum(a.nbytes for a in self.bounds) if self.bounds is not None else 0
        w = self.wide
        return n + (w.nbytes() if w is not None else 0)

    def fit(self, cap: int) -> None:
        if self.acc.size < cap:
            cap = max(cap, self.acc.size * 5 // 4)
            self.acc, self.seen = np.zeros(cap), np.zeros(cap, np.uint8)
            self.acc32 = np.zeros(cap, np.float32)  # the wide path's partial scores (approximate)


_NO_ROWS = np.zeros((1, 1), np.uint8)
def successor(ix: PostingsIndex, seg, live: np.ndarray, doc_len: np.ndarray) -> tuple:
    """(The merge's thread, :mod:`.merging`) what :func:`_pruned` keeps per segment, built for the
    merged segment ``seg`` before its install instead of by the first queries after it: the term
    bounds and the wide rows of the terms whose bounds or rows the current segment's scratch holds
    (matched by term string; the others are built on first use, as before).

    :param live: bool ``[>= span]``: the chunks of ``seg`` (the bounds' minimum length is over
        them; a chunk removed meanwhile can only lower it, so it stays a bound).
    :param doc_len: float64 ``[>= span]``, the index's lengths (a live segment chunk's is fixed).
    :returns: ``(seg, bounds | None, _Wide | None)`` for :func:`adopt`.
    """
    from .. import kernels_topm  # noqa: PLC0415

    sc = ix.__dict__.get("_topm_scratch")
    old = sc.seg if sc is not None else None
    if old is None:
        return seg, None, None
    bounds, wide, vocab = sc.bounds, sc.wide, seg.vocab

    def new_ids(old_ids: np.ndarray) -> np.ndarray:
        ids = [vocab.get(old.terms[i]) for i in old_ids.tolist()]
        return np.array([i for i in ids if i is not None], np.int64)

    nb = None
    if bounds is not None:
        v = max(seg.offsets.size - 1, 0)
        nb = (np.full(v, np.nan), np.full(v, np.nan))
        codes = np.where(live, np.int8(_SEG), np.int8(0))
        for t in new_ids(np.flatnonzero(~np.isnan(bounds[0]))).tolist():
            kernels_topm._term_bounds(t, seg.offsets, seg.slots, seg.tf, codes, _SEG, doc_len, nb[0], nb[1])  # noqa: SLF001
    nw = None
    if wide is not None and wide.seg is old and seg.doc_slots.size:
        nw = _Wide(seg, doc_len)
        nw.positions(new_ids(np.flatnonzero(wide.row_of >= 0)[np.flatnonzero(wide.state != 0)]))
    return seg, nb, nw


def adopt(ix: PostingsIndex, top: tuple) -> list:
    """(The install, on the index's thread) the scratch switched to :func:`successor`'s parts for
    the index's new segment. :returns: the parts they replace (the caller frees them elsewhere);
    none when another thread is scoring with the scratch (its next query rebuilds them, as before)."""
    sc = ix.__dict__.get("_topm_scratch")
    seg, bounds, wide = top
    if sc is None or seg is not ix._seg or not sc.lock.acquire(blocking=False):  # noqa: SLF001
        return []
    try:
        old = [sc.seg, sc.bounds, sc.wide]
        sc.seg, sc.bounds, sc.wide = seg, bounds, wide
        return old
    finally:
        sc.lock.release()


def wide_rows(ix: PostingsIndex, tids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(rowmap int64[T], rows uint8[R, span], span)`` for :func:`..kernels.bm25_segment`: per
    query position the built wide row of its segment term (-1: none) in this shard's scratch,
    when the scratch's rows belong to the current segment; else all -1."""
    sc = ix.__dict__.get("_topm_scratch")
    w = sc.wide if sc is not None else None
    if w is None or w.seg is not ix._seg:  # noqa: SLF001
        return np.full(tids.size, -1, np.int64), _NO_ROWS, 0
    r = w.lookup(tids)
    r[r >= 0] = np.where(w.state[r[r >= 0]] == 1, r[r >= 0], -1)
    return r, w.rows, w.span


def _pruned(ix: PostingsIndex, seg, seg_df, tids, idf, d_off, ds, dt, m, avgdl, k1, b, cache=None, thr0=0.0):
    from .. import kernels_topm, kernels_wide  # noqa: PLC0415

    sc = ix.__dict__.get("_topm_scratch")
    if sc is None:
        sc = ix.__dict__.setdefault("_topm_scratch", _Scratch())
    if not sc.lock.acquire(blocking=False):  # another thread is scoring on this shard: a fresh scratch
        sc, cache = _Scratch(), None  # (its rows are not the shard's: nothing kept)
        sc.lock.acquire()
    try:
        where, doc_len = ix._where, ix._doc_len  # noqa: SLF001
        if sc.seg is not seg or sc.bounds is None:  # filled term by term as queries use them
            v = max(seg.offsets.size - 1, 0)
            sc.bounds = (np.full(v, np.nan), np.full(v, np.nan))
            sc.seg = seg
        sc.fit(doc_len.size)
        if _WIDE and not np.any((idf > 0.0) & (idf < 1e-30)):  # float32 partial scores stay non-zero
            if sc.wide is None or sc.wide.seg is not seg:
                sc.wide = _Wide(seg, doc_len)
            w = sc.wide
            is_wide, row, n_wide = w.positions(tids)
            if n_wide * _WIDE_GAIN >= w.span and w.span <= min(where.size, doc_len.size):
                if cache is not None and w.span:
                    return _wide_kept(ix, w, cache, tids, idf, d_off, ds, dt, is_wide, row, m, avgdl, k1, b, sc, thr0)
                slots, scores, listed = kernels_wide.bm25_top_wide(
                    where, _SEG, doc_len, w.seg_len, tids, idf, seg.offsets, seg.slots, seg.tf, d_off, ds, dt, is_wide,
                    row, w.rows, w.span, int(m), float(avgdl), float(k1), float(b), sc.acc32, sc.seen, *_bounds(w), thr0)
                return slots, scores, int(listed)
        slots, scores, listed, _ = kernels_topm.bm25_top_pruned(
            where, _SEG, doc_len, tids, idf, seg.offsets, seg.slots, seg.tf, d_off, ds, dt, sc.bounds[0],
            sc.bounds[1], seg_df, int(m), float(avgdl), float(k1), float(b), sc.acc, sc.seen)
        return slots, scores, int(listed)
    finally:
        sc.lock.release()


def _wide_kept(ix, w, cache, tids, idf, d_off, ds, dt, is_wide, row, m, avgdl, k1, b, sc, thr0=0.0):
    """The wide path in steps (:mod:`..kernels_wide_keep`), what the pass left kept in the
    shard's cache (no segment array: those are the index's when it is used again):
    :func:`..kernels_wide.bm25_top_wide`'s result."""
    from ..kernels_wide_keep import wide_finish, wide_pass  # noqa: PLC0415

    seg, where, doc_len, m = w.seg, ix._where, ix._doc_len, int(m)  # noqa: SLF001
    q = (tids, idf, seg.offsets, seg.slots, seg.tf, d_off, ds, dt, is_wide, row, w.rows, w.span)
    cx, cv, listed, mx, past = wide_pass(where, _SEG, doc_len, w.seg_len, *q, m, float(avgdl), float(k1),
                                         float(b), sc.acc32, sc.seen, *_bounds(w), thr0)
    cache[0].put(cache[1], cache[2], (m, cx, cv, int(listed), mx, int(past), tids, d_off, ds, dt, is_wide, row))
    slots, scores = wide_finish(cx, cv, m, where, _SEG, doc_len, *q, float(avgdl), float(k1), float(b))
    return slots, scores, int(listed)


def _from_kept(ix, e, m, idf, avgdl, k1, b):
    """``(slots, scores, listed)`` of the top-m from a kept entry (:func:`_wide_kept`) of this
    index's current segment, or None when it cannot give it (fewer than m blocks hold a
    non-zero score, or the shard's wide rows are not the segment's)."""
    from ..kernels_wide_keep import wide_finish, wide_rescan  # noqa: PLC0415

    m0, cx, cv, listed, mx, past, tids, d_off, ds, dt, is_wide, row = e
    sc, seg = ix.__dict__.get("_topm_scratch"), ix._seg  # noqa: SLF001
    w = sc.wide if sc is not None else None
    if w is None or w.seg is not seg:
        return None
    where, doc_len, m = ix._where, ix._doc_len, int(m)  # noqa: SLF001
    q = (tids, idf, seg.offsets, seg.slots, seg.tf, d_off, ds, dt, is_wide, row, w.rows, w.span)
    if m > m0:  # (mx[0]: each block's noted maximum, a lower bound; mx[1] an upper bound)
        pos = mx[0][mx[0] > 0.0]
        if pos.size < m:
            return None
        low = float(np.partition(pos, pos.size - m)[pos.size - m])  # the m-th largest block maximum
        cx, cv = wide_rescan(mx[1], low, cx, cv, past, where, _SEG, doc_len, w.seg_len, *q, float(avgdl), float(k1),
                             float(b))
    slots, scores = wide_finish(cx, cv, m, where, _SEG, doc_len, *q, float(avgdl), float(k1), float(b))
    return slots, scores, listed


def listed_top_reference(ix: PostingsIndex, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float,
                         b: float, m: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`listed_top` in numpy (every listed allowed chunk, a superset of what it returns):
    :meth:`.postings.PostingsIndex.score_all`, then the listed and allowed ones."""
    slots, lex = ix.score_all(terms, idf, avgdl, k1, b)
    keep = lex != 0.0
    if allowed is not None:
        keep &= np.isin(slots, allowed)
    return slots[keep], lex[keep], int(np.count_nonzero(keep))
