"""A check of an approximate dense top-n against a fixed sample of the shard's chunks, and a wider
search when it fails (issue 13: HNSW and IVF on queries far from every chunk).

Why: an HNSW walk finds the exact top-n of a query near the corpus (Recall@10 0.996 for
SciFact questions at 1M chunks, ``ef_search`` 512), but a query whose vector sits far from
every chunk (a few keywords, strings of letters no chunk holds) lands where the graph's links
lead nowhere in particular: dense Recall@10 0.63-0.75 at ``ef_search`` 512 on bench.scale's 1M
corpus, 0.99 at 8,192 (bench/RESULTS.md, session 35). A larger beam for every query would cost
each of them 4-16x; this module finds the queries that need it.

The check (:meth:`SampleCheck.misses`) is a proof, not an estimate: the list holds the best
chunks the walk found, by canonical score; let ``cut`` be its :data:`TOP`-th score. If its first
:data:`TOP` places were the exact top-:data:`TOP`, every chunk scoring above ``cut`` would be
among them. So a chunk of a fixed sample of the shard (about :data:`SAMPLE` chunks, chosen by a hash of their ids) that
scores above ``cut`` and is not in the list shows that the walk missed at least that chunk.
Scores are screened on an int8 copy of the sample (:class:`..index.kernels_scan.Int8Rows`, with
its error bound) and the few that may be above ``cut`` are scored canonically
(``DenseIndex.exact_slots``). A list that passes may still miss chunks outside the sample (~3% of
a 500K-vector shard): the check catches walks that went astray, whose ``cut`` sits far below the
exact one (many sampled chunks above it), not every single miss.

A query that fails is searched again with ``ef_search`` x :data:`FACTOR`, up to :data:`MAX_EF`
(``RetrievalInfo.ef_search`` reports the largest beam used); one still failing there (a graph built
with a tiny M), or whose next beam x :data:`EXACT_BELOW` reaches the shard's live vectors (a beam
unit costs ~4-5 us, a scanned vector ~0.2-0.3: session 50), gets the exact top-n from a scan.

IVF (session 37) fails the same way: a far query ranks the centroids of the lists holding its exact
top-10 no higher than many others, and ``nprobe`` lists miss them. A list proven short is searched
again with ``nprobe`` x :data:`FACTOR`, up to every list (every list's 8-bit codes scanned, the
best re-ranked by the float32 copy: ``DenseIndex.search``), then, still proven short, exactly as above;
``RetrievalInfo.nprobe`` reports the most lists used. An IVF not trained yet is searched exactly and
not checked.
"""

from __future__ import annotations

import numpy as np

from ..index.slot_sample import splitmix64

#: chunks in the sample a list is checked against by default (``DenseConfig.ann_check``,
#: ``--ann-check``; int8 copies: D bytes each, 6.3 MB a shard at D 384); a shard smaller than this
#: is checked against every chunk
SAMPLE = 16384
#: a failed list's next beam is this many times the last one
FACTOR = 4
#: the check covers the list's first TOP places (its cut is the TOP-th score): a walk that went
#: astray misses chunks there, while a good walk's misses sit near the end of a long list (HNSW's
#: recall of the exact top-256 is ~0.96 at 500K vectors, of the top 10 0.996); checking all 256
#: widened about half the keyword queries' lists for misses that do not reach a fused top-k
TOP = 64
#: the largest beam a check asks for (the request's own ``ef_search`` may be larger: it is kept)
MAX_EF = 8192
#: a failed HNSW list whose next beam x this reaches the shard's live vectors is ranked by an exact scan instead
EXACT_BELOW = 16
#: the sample's share of the shard changes in steps of 2^(1/STEPS) (about 4.4%: :func:`level`), so that the
#: sample holds between ``sample`` x 2^(-1/STEPS) and ``sample`` chunks (expected) and changes only at a step
STEPS = 16


def level(n: int, sample: int) -> int:
    """The sample's level for a shard of ``n`` live chunks: 0 (every chunk) when ``n <= sample``, else the smallest
    j with ``n`` x 2^(-j/STEPS) <= ``sample``; a chunk is sampled at level j when its :func:`chunk_hashes` value is
    below :func:`threshold` (j)."""
    return 0 if n <= sample else int(np.ceil(STEPS * np.log2(n / max(sample, 1))))


def threshold(j: int) -> np.uint64 | None:
    """uint64: the hash value under which a chunk is sampled at level ``j`` >= 1 (a share 2^(-j/STEPS) of all
    values); None at level 0 (every chunk)."""
    return None if j <= 0 else np.uint64(min(int(2.0 ** (64 - j / STEPS)), 2**64 - 1))


def chunk_hashes(ids) -> np.ndarray:
    """uint64[M]: a fixed hash of each chunk id (str; None, a removed slot's, hashes to the largest value, never
    sampled): CRC-32 of its UTF-8 bytes (zlib) through the SplitMix64 finaliser (:func:`..index.slot_sample.
    splitmix64`), so that the sampled chunks are the same in every process, run and restart (``hash()`` is salted)."""
    import zlib  # noqa: PLC0415

    x = np.fromiter((zlib.crc32(i.encode()) if i is not None else 2**32 for i in ids), np.uint64, len(ids))
    gone = x == np.uint64(2**32)
    x = splitmix64(x)
    x[gone] = np.uint64(2**64 - 1)
    return x


class _Rows:
    """Int8 rows of sampled slots (:class:`..index.kernels_scan.Int8Rows` over growable buffers): rows are appended
    (quantised one by one: :func:`..index.kernels_scan.quantize`) and kept by a mask, never gathered again. The
    scan's error constants E and C are the largest of any row ever held (a bound for every row held now)."""

    def __init__(self) -> None:
        from ..index.kernels_scan import Int8Rows  # noqa: PLC0415 - numba only in processes that search

        self.i8, self.n = Int8Rows(), 0
        self._slots = np.zeros(0, np.int64)
        self._bufs: list[np.ndarray] = []  # codes int8[cap, D], scale float32[cap], rb float64[cap]

    @property
    def slots(self) -> np.ndarray:
        return self._slots[: self.n]

    def add(self, slots: np.ndarray, vecs: np.ndarray) -> int:
        """Append the rows of int64[k] ``slots`` (float32[k, D] ``vecs``). :returns: how many were left out for a
        vector that is not finite."""
        from ..index.kernels_scan import quantize, row_bounds  # noqa: PLC0415

        ok = np.isfinite(vecs).all(axis=1)
        slots, vecs = slots[ok], np.ascontiguousarray(vecs[ok], dtype=np.float32)
        k, d = vecs.shape
        if k:
            codes, scale = np.empty((k, d), np.int8), np.empty(k, np.float32)
            e, c = quantize(vecs, codes, scale)
            rb = row_bounds(vecs, codes, scale, np.empty(k, np.float64))
            if not self._bufs or self.n + k > self._slots.size or self._bufs[0].shape[1] != d:
                cap = max(2 * (self.n + k), 1024)
                grown = [np.empty((cap, d), np.int8), np.empty(cap, np.float32), np.empty(cap, np.float64)]
                for g, b in zip(grown, self._bufs):
                    g[: self.n] = b[: self.n]
                slots_ = np.empty(cap, np.int64)
                slots_[: self.n] = self.slots
                self._bufs, self._slots = grown, slots_
            for b, v in zip(self._bufs + [self._slots], (codes, scale, rb, slots)):
                b[self.n: self.n + k] = v
            self.n += k
            self.i8.e, self.i8.c = max(self.i8.e, e), max(self.i8.c, c)
            self._view()
        return int((~ok).sum())

    def keep(self, mask: np.ndarray) -> None:
        """Keep the rows where bool[n] ``mask`` is set, in order."""
        idx = np.flatnonzero(mask)
        if idx.size < self.n:
            for b in self._bufs + [self._slots]:
                b[: idx.size] = b[idx]
            self.n = int(idx.size)
            self._view()

    def _view(self) -> None:
        self.i8.codes, self.i8.scale, self.i8.rb = (b[: self.n] for b in self._bufs)


class SampleCheck:
    """The int8 copy of a fixed sample of a shard's live chunks: those whose id's :func:`chunk_hashes` value is below
    the :func:`threshold` of the shard's :func:`level`. The sample is a function of the live chunks alone, kept by
    the query path as writes come (no thread, no redraw): a write's new chunks are hashed and the sampled ones'
    vectors gathered; a shard grown a step keeps the rows under the lower threshold (no gather), one shrunk a step
    gathers the chunks between the two. So the check's answer to a list does not depend on the order or timing of
    the writes, nor on a restart (session 42: a redraw by a thread made which draw checked a query a matter of
    timing, and a draw strided by slot differed by the writes' history)."""

    def __init__(self, sample: int = SAMPLE) -> None:
        self.sample = int(sample)
        self._rows = _Rows()
        self._j = -1  # the sample's level (-1: never made)
        self._top = 0  # slots below it were considered
        self._seen = -1  # the store version the rows are current for
        self._h = np.zeros(0, np.uint64)  # slot -> chunk_hashes of its id, for slots < _h.size
        self._live = np.zeros(0, bool)  # which rows are live (at _seen)
        self._bad = 0  # chunks left out for a vector that is not finite
        self._memo: dict = {}  # query bytes -> its int8 scores: a list check, then the minimum
        self._lows: dict = {}  # query bytes -> the exact minimum a whole sample's compiled top-n found (tops)
        self._fast: tuple | None = None  # (rows' key, live row positions, their dense rows, bounds by dense row)

    def whole(self) -> bool:
        """Whether the sample holds every live chunk of the shard (level 0): the check then covers the whole list
        and the minimum is exact."""
        return self._j == 0 and not self._bad

    def members(self) -> np.ndarray:
        """int64: the live sampled slots (after the last check brought the sample up to date)."""
        return self._rows.slots[self._live]

    def _scores(self, q: np.ndarray) -> np.ndarray:
        """float32[S]: the int8 scores of float32[D] ``q`` with every row, kept for the last few queries (a list
        check and then the dense minimum, :meth:`lows`, scan the same sample for the same query)."""
        key = q.tobytes()  # (cleared whenever the rows change: _current)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= 16:
                self._memo.clear()
            got = self._memo[key] = self._rows.i8.scores(q, None)
        return got

    def _hashes(self, store, end: int) -> np.ndarray:
        if self._h.size < end:
            self._h = np.concatenate([self._h, chunk_hashes(store._slot_ids[self._h.size: end])])  # noqa: SLF001
        return self._h

    def _take(self, dense, slots: np.ndarray) -> None:
        if slots.size:
            self._bad += self._rows.add(slots, np.ascontiguousarray(dense.vectors_of(slots), dtype=np.float32))

    def _current(self, dense, store) -> bool:
        """Bring the sample up to the store's version. :returns: whether it holds a row."""
        from ..index.slot_sample import live_slots  # noqa: PLC0415

        version = dense._version  # noqa: SLF001 - (grows at every add and remove)
        if version == self._seen:
            return self._rows.n > 0
        end = int(store.next_slot)
        h, j, rows = self._hashes(store, end), level(len(dense), self.sample), self._rows
        t = threshold(j)
        if self._j >= 0 and j != self._j:  # a step: the chunks considered so far, again
            if j > self._j:  # (grown: a subset of the rows)
                rows.keep(h[rows.slots] < t)
            else:  # (shrunk: the live chunks between the two thresholds join)
                old = live_slots(dense, 0, self._top)
                hv = h[old]
                self._take(dense, old[(hv >= threshold(self._j)) & ((hv < t) if t is not None else True)])
        self._j = j
        fresh = live_slots(dense, self._top, end)  # (end: the store's next slot, not the map's capacity)
        self._take(dense, fresh if t is None else fresh[h[fresh] < t])
        self._top, self._seen = end, version
        self._live = dense._rows_of(rows.slots) >= 0  # noqa: SLF001
        if rows.n - int(self._live.sum()) > rows.n // 8:  # (removed chunks' rows: dropped)
            rows.keep(self._live)
            self._live = np.ones(rows.n, bool)
        self._memo.clear()
        self._lows.clear()
        return rows.n > 0

    def misses(self, searcher, q: np.ndarray, slots: np.ndarray, scores: np.ndarray) -> bool:
        """Whether a sampled live chunk outside ``slots`` int64[n] scores canonically above the
        list's :data:`TOP`-th score (``scores`` float64[n], descending) for float32[D] ``q``: the
        list then provably misses a chunk of the exact top-:data:`TOP`. False for an empty list
        or shard."""
        dense = searcher.store.dense
        if slots.size == 0 or len(dense) == 0 or not self._current(dense, searcher.store):
            return False
        cut = float(scores[-1] if self.whole() else scores[min(slots.size, TOP) - 1])  # (whole: every place checked)
        i8 = self._rows.i8
        cand = self._rows.slots[self._live & (self._scores(q) > cut - i8.error(q))]
        if cand.size:  # not in the list: a sorted search (np.isin cost ~50-250 us a call here, this ~5)
            srt = np.sort(slots)
            pos = np.minimum(np.searchsorted(srt, cand), srt.size - 1)
            cand = cand[srt[pos] != cand]
        return bool(cand.size) and bool((dense.exact_slots(q, cand) > cut).any())

    def _part(self, searcher, whole: bool) -> tuple | None:
        """``(slots, int8 copy, live mask)`` of the sample, brought up to date; None for an empty shard or sample, and
        with ``whole`` unless it holds every chunk (:meth:`whole`)."""
        dense = searcher.store.dense
        if not len(dense) or not self._current(dense, searcher.store) or whole and not self.whole():
            return None
        return self._rows.slots, self._rows.i8, self._live

    def tops(self, searcher, q: np.ndarray, which: list[int], n: int) -> dict | None:
        """The exact top-n ``{i: (slots int64[n'], canonical float64[n'])}`` (ties: chunk id) of the queries ``which``
        of float32[B, D] ``q`` from one int8 scan of the sample, when it holds every chunk (:meth:`whole`; else None):
        cheaper than the ANN search and a check of all its places (trial39: at 5K chunks a shard, an HNSW walk for a
        keyword query, checked place by place, widened to the exact scan and doubled the CPU). Compiled
        (:meth:`_top_fast`) where the vectors are a view; the exact minimum found on the way is kept for :meth:`lows`."""
        part = self._part(searcher, True)
        if part is None:
            return None
        dense, ids = searcher.store.dense, searcher.store._slot_ids  # noqa: SLF001 - slot-indexed ids, for ties
        return {i: self._top_fast(dense, ids, q[i], n) or self._top_numpy(part, dense, ids, q[i], n) for i in which}

    def _top_numpy(self, part: tuple, dense, ids, qi: np.ndarray, n: int) -> tuple:
        """:meth:`tops` of one float32[D] query ``qi`` by ``refine_top``, scoring rows canonically one call at a time
        (where :meth:`_top_fast` declines); ``part``: :meth:`_part`'s."""
        from ..index.fusion import _Take, refine_top  # noqa: PLC0415

        sl, i8, live = part
        sl = sl[live]
        pos, ex = refine_top(self._scores(qi)[live].astype(np.float64), float(i8.error(qi)),
                             lambda p: dense.exact_slots(qi, sl[p]), _Take(ids, sl), n)
        return sl[pos], ex

    def _top_fast(self, dense, ids, qi: np.ndarray, n: int) -> tuple | None:
        """:meth:`tops` of one float32[D] query ``qi`` over a whole sample in one compiled call
        (:func:`..index.kernels_refine.dense_step_fast` on the sample's int8 scores with its per-row bounds, the
        canonical scores read from the dense index's own rows: the same filters and results as a flat shard's
        :meth:`.search.Searcher._kernel_tops`); its exact minimum is kept for :meth:`lows`. None (the caller's numpy
        path) where the dense rows are no view (HNSW with vectors deferred outside the graph) or ``qi`` is not
        finite."""
        from ..index import kernels_refine as kr  # noqa: PLC0415
        from ..index.fusion import top_k_order  # noqa: PLC0415
        from ..index.kernels_scan import query_norm  # noqa: PLC0415

        mat = dense.row_view()
        if mat is None:
            return None
        rows, i8 = self._rows, self._rows.i8
        key = (self._seen, rows.n, mat.shape[0])
        if self._fast is None or self._fast[0] != key:
            at = np.flatnonzero(self._live)
            drows = dense.view_rows(dense.rows(rows.slots[at]))
            rb = np.zeros(mat.shape[0], np.float64)
            rb[drows] = i8.rb[at]
            self._fast = (key, at, drows, rb, np.arange(at.size, dtype=np.int64))
        _, at, drows, rb, every = self._fast
        if not at.size:
            return None
        approx = self._scores(qi)
        approx = approx if at.size == approx.size else approx[at]
        qn = query_norm(qi)
        short, ex, order, ties, low, status = kr.dense_step_fast(
            mat, drows, False, approx, qi, i8.error(qi, qn), n, every, kr.fast_error(i8.c + i8.e, mat.shape[1], qi, qn),
            rb, i8.row_scale(qi, qn))
        if status != kr.OK:
            return None
        self._lows[qi.tobytes()] = float(low)
        s = rows.slots[at[short]]
        kk = min(n, at.size)
        order = np.asarray(top_k_order(ex, ids, kk, rows=s), np.int64) if ties else order[:kk]
        return s[order], ex[order]

    def lows(self, searcher, q: np.ndarray, plain: list[int], whole: bool = True) -> list | None:
        """The lowest canonical score over the sample's live chunks of each query ``plain`` of float32[B, D] ``q`` (None
        for one with no live chunk within reach): the chunks within twice the int8 error of the lowest int8 score are
        scored canonically. ``whole``: only when the sample holds every chunk (:meth:`whole`): the exact dense minimum
        (trial39: an HNSW's ``-q`` walk on a 1,850-chunk shard missed the minimum and a certified reply's fused scores
        differed from exact mode's); None otherwise. Not ``whole``: an upper bound of the shard's minimum that depends
        on the live chunks alone (trial42: re-ingesting unchanged documents moved them to new slots, and with them a
        slot-strided estimate and the fused scores). None for an empty shard or sample."""
        dense, part = searcher.store.dense, self._part(searcher, whole)
        if part is None:
            return None
        sl, i8, live = part
        out = []
        for i in plain:
            low = self._lows.get(q[i].tobytes(), np.inf) if self.whole() else np.inf  # (tops found it)
            if np.isinf(low) and live.any():
                approx, err = self._scores(q[i]), i8.error(q[i])
                near = sl[live & (approx <= float(approx[live].min()) + 2.0 * err)]
                low = float(dense.exact_slots(q[i], near).min()) if near.size else np.inf
            out.append(low if np.isfinite(low) else None)
        return out

    def low_below(self, searcher, qi: np.ndarray, bound: float) -> float | None:
        """:meth:`lows` of one query float32[D] ``qi`` over a sample not held whole, or ``inf`` when no sampled chunk
        can score below ``bound`` (the lowest int8 score less its error is not below it: no canonical scoring); None
        for an empty sample or one with no live chunk."""
        if (part := self._part(searcher, False)) is None or not part[2].any():
            return None
        sl, i8, live = part
        approx, err = self._scores(qi), i8.error(qi)  # (the list check's scan, kept)
        lo = float(approx[live].min())
        near = sl[live & (approx <= lo + 2.0 * err)] if lo - err < bound else sl[:0]
        return float(searcher.store.dense.exact_slots(qi, near).min()) if near.size else np.inf


def check_of(searcher) -> SampleCheck:
    """The searcher's :class:`SampleCheck` (made on first use, of ``--ann-check`` chunks)."""
    if searcher._check is None:  # noqa: SLF001
        searcher._check = SampleCheck(searcher.store.dense.params.ann_check)  # noqa: SLF001
    return searcher._check  # noqa: SLF001


def prepare(searcher) -> None:
    """Make the searcher's check sample now if its HNSW / IVF index would be checked (a shard's start, ``warm``: at
    500K chunks the ids' hashes and the gather of 16K vectors take ~0.1-0.2 s, which the first query paid); not while
    an HNSW structure still loads (its vectors' gather would wait for it)."""
    d = searcher.store.dense
    if d.params.kind != "flat" and d.params.ann_check and len(d) and d.ann is not None and d.ann.ready \
            and d._pending is None:  # noqa: SLF001
        check_of(searcher)._current(d, searcher.store)  # noqa: SLF001


def whole_tops(searcher, q: np.ndarray, which: list[int], n: int) -> dict | None:
    """:meth:`SampleCheck.tops` of an HNSW / IVF shard of at most ``ann_check`` chunks (the searcher's check made on
    first use), else None: the caller searches its index."""
    dense = searcher.store.dense
    ck = dense.params.ann_check
    if not ck or dense.ann is None or not dense.ann.ready or len(dense) > ck:  # (flat; an IVF not trained: exact)
        return None
    return check_of(searcher).tops(searcher, q, which, n)


def widened(searcher, check: SampleCheck, q: np.ndarray, out: dict, n: int, ef_search: int, nprobe: int) -> None:
    """Search the queries of ``out`` (query index -> ``(slots, canonical scores)``, approximate
    tops of float32[B, D] ``q``) whose list :meth:`SampleCheck.misses` shows incomplete again,
    with the index's knob :data:`FACTOR` times larger each round (HNSW: the beam ``ef_search``,
    up to :data:`MAX_EF` or a beam dearer than a scan, :data:`EXACT_BELOW`; IVF: ``nprobe``, up to every
    list), then exactly; their entries are replaced. An IVF not trained yet searched exactly: nothing to do."""
    dense = searcher.store.dense
    if dense.params.kind == "hnsw":
        name, knob, cap = "ef_search", max(int(ef_search or dense.params.ef_search), n), min(MAX_EF, len(dense))
    else:
        ann = dense.ann
        name, cap = "nprobe", ann.nlist if ann is not None else 0
        if not cap:
            return
        knob = min(int(nprobe or dense.params.nprobe), cap)
    knob = max(knob, dense.last_knobs.get(name, 0))  # the knob just used
    bad = [i for i, (s, sc) in out.items() if check.misses(searcher, q[i], s, sc)]
    while bad and knob < cap:
        knob = min(knob * FACTOR, cap if name == "nprobe" else MAX_EF)
        if name == "ef_search" and knob * EXACT_BELOW >= len(dense):
            break  # (that beam costs more than a scan)
        ef, probe = (knob, nprobe) if name == "ef_search" else (ef_search, knob)
        got = searcher._dense_tops(q, bad, n, ef, probe, check=False)  # noqa: SLF001
        out.update(got)
        bad = [i for i in bad if check.misses(searcher, q[i], *got[i])]
    if bad:  # still provably short at the widest knob (trial36), or the next beam costs more than a scan: the exact
        live, approx = dense.slots, dense.score_all(q[bad])  # top-n, from
        for j, i in enumerate(bad):  # one matrix product over the stored vectors (no gather), refined canonically
            out[i] = searcher._refine(q[i], live, approx[j], n)  # noqa: SLF001
