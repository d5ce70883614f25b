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
among them. So a chunk of a fixed sample of the shard (:data:`SAMPLE` chunks, evenly spaced by slot) that
scores above ``cut`` and is not in the list shows that the walk missed at least that chunk.
Scores are screened on an int8 copy of the sample (:class:`..index.kernels_scan.Int8Rows`, with
its error bound) and the few that may be above ``cut`` are scored canonically
(``DenseIndex.exact_slots``). A list that passes may still miss chunks outside the sample (~3% of
a 500K-vector shard): the check catches walks that went astray, whose ``cut`` sits far below the
exact one (many sampled chunks above it), not every single miss.

A query that fails is searched again with ``ef_search`` x :data:`FACTOR`, at most up to
:data:`MAX_EF` (``RetrievalInfo.ef_search`` reports the largest beam used); one that still fails
at that beam, or at a beam as large as the shard, gets the shard's exact dense top-n (a scan of
every chunk: a graph its walks cannot cover, e.g. one built with a tiny M).

IVF (session 37) fails the same way: a far query ranks the centroids of the lists holding its exact
top-10 no higher than many others, and ``nprobe`` lists miss them. A list proven short is searched
again with ``nprobe`` x :data:`FACTOR`, up to every list (every list's 8-bit codes scanned, the
best re-ranked by the float32 copy: ``DenseIndex.search``), then, still proven short, exactly as above;
``RetrievalInfo.nprobe`` reports the most lists used. An IVF not trained yet is searched exactly and
not checked.
"""

from __future__ import annotations

import threading

import numpy as np

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
#: the sample is drawn again when the shard's chunk count moved by more than this share since
#: (not at every write: under ingest each query would pay the gather of the whole sample); meanwhile
#: the chunks written since the draw are sampled at the draw's density (every one when the shard had
#: at most ``sample``) as they come (trial38: a sample of the old chunks alone never checked the new
#: ones, where a stale IVF training misses most); a removed chunk is skipped when flagged. A redraw
#: after the first is made by a thread (:class:`_Draw`) while the old draw serves: made by the query
#: that found the shard grown, it took that query 70-250 ms beside an ingest (session 41)
REDRAW = 1 / 16


class SampleCheck:
    """The int8 copy of a fixed sample of a shard's chunks, evenly spaced by slot (:func:`..index.slot_sample.sample_slots`)."""

    def __init__(self, sample: int = SAMPLE) -> None:
        from ..index.kernels_scan import Int8Rows  # noqa: PLC0415 - numba only in processes that search

        self.sample = int(sample)
        self._i8 = Int8Rows()
        self._i8.MAX_ROWS = max(Int8Rows.MAX_ROWS, self.sample)  # (its cap is for whole flat shards)
        self._n = -1  # the shard's chunk count when the sample was drawn (-1: never)
        self._ok = False  # the sample's int8 copy exists (none for a sample that is not finite)
        self._slots = np.zeros(0, np.int64)
        self._top, self._of = 0, 1  # slots >= _top came after the draw; the draw took 1 in _of of the live chunks
        self._new_i8, self._new, self._seen = Int8Rows(), np.zeros(0, np.int64), -1  # their sample, at store version _seen
        self._new_i8.MAX_ROWS = self._i8.MAX_ROWS
        self._memo: dict = {}  # (which int8 copy, query bytes) -> its int8 scores: a list check, then the minimum
        self._live = (-1, np.zeros(0, bool))  # (store version, which drawn chunks are live)
        self._job: _Draw | None = None  # a redraw under way in a thread

    def whole(self) -> bool:
        """Whether the sample holds every chunk of the shard (drawn from at most ``sample`` live chunks; every chunk
        written since is then sampled too): the check then covers the whole list and the minimum is exact."""
        return self._n >= 0 and self._of <= 1.0

    def _scores(self, i8, q: np.ndarray) -> np.ndarray:
        """float32[S]: ``i8``'s int8 scores of float32[D] ``q``, kept for the last few queries (a list check and then
        the dense minimum, :meth:`lows`, scan the same sample for the same query)."""
        key = (id(i8), q.tobytes())  # (cleared whenever either copy is made again: _current)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= 16:
                self._memo.clear()
            got = self._memo[key] = i8.scores(q, None)
        return got

    def _current(self, dense, end: int | None = None) -> bool:
        from ..index.slot_sample import live_slots, strided  # noqa: PLC0415 - (by slot order: the same after a restart)

        n = len(dense)
        job = self._job
        if job is not None and not job.thread.is_alive():
            self._job = None
            if job.out is not None and job.installs == dense.installs:  # (else ids it read were renumbered: again)
                self._adopt(*job.out)
        if self._n < 0 or abs(n - self._n) > REDRAW * self._n or (n <= self.sample and self._of > 1.0):  # (a shard
            # that deletes brought down to the sample's size is drawn whole again: trial39b)
            if self._n < 0 or (n <= self.sample and self._of > 1.0) or dense._pending is not None:  # noqa: SLF001
                self._job = None  # (the first draw, or a shard shrunk back to whole: here)
                live = live_slots(dense)
                slots = strided(live, self.sample)
                self._adopt(n, slots, np.ascontiguousarray(dense.vectors_of(slots), dtype=np.float32), live)
            elif self._job is None:
                self._job = _Draw(dense, n, self.sample)
        version = dense._version  # noqa: SLF001 - (grows at every add and remove)
        if version != self._seen:  # the chunks written since the draw, sampled at its density
            fresh = live_slots(dense, self._top, end)  # (end: the store's next slot, not the map's capacity)
            self._new = strided(fresh, int(np.ceil(fresh.size / self._of)))
            vecs = np.ascontiguousarray(dense.vectors_of(self._new), dtype=np.float32)
            if self._new.size and self._new_i8.of(vecs, version) is None:
                self._new = self._new[:0]  # (not finite: as the draw's, unchecked)
            self._seen = version
            self._memo.clear()
        return self._ok or self._new.size > 0

    def _adopt(self, n: int, slots: np.ndarray, vecs: np.ndarray, live: np.ndarray) -> None:
        """A draw of ``slots`` (float32 ``vecs``) from the ascending ``live`` slots of a shard of ``n`` chunks."""
        self._slots = slots
        self._ok = slots.size > 0 and self._i8.of(vecs, n) is not None
        self._n, self._top, self._seen = n, int(live[-1]) + 1 if live.size else 0, -1
        self._memo.clear()
        self._live = (-1, self._live[1][:0])  # (which drawn chunks are live: asked again)
        self._of = max(1.0, live.size / max(self.sample, 1))

    def misses(self, searcher, q: np.ndarray, slots: np.ndarray, scores: np.ndarray) -> bool:
        """Whether a sampled live chunk outside ``slots`` int64[n] scores canonically above the
        list's :data:`TOP`-th score (``scores`` float64[n], descending) for float32[D] ``q``: the
        list then provably misses a chunk of the exact top-:data:`TOP`. False for an empty list
        or shard."""
        dense = searcher.store.dense
        if slots.size == 0 or len(dense) == 0 or not self._current(dense, getattr(searcher.store, "next_slot", None)):
            return False
        cut = float(scores[-1] if self.whole() else scores[min(slots.size, TOP) - 1])  # (whole: every place checked)
        cand = [s[np.flatnonzero(self._scores(i8, q) > cut - i8.error(q))]
                for s, i8, ok in ((self._slots, self._i8, self._ok), (self._new, self._new_i8, self._new.size > 0)) if ok]
        cand = np.concatenate(cand) if cand else np.zeros(0, np.int64)
        if cand.size == 0:
            return False
        cand = cand[~np.isin(cand, slots)]
        cand = cand[dense._rows_of(cand) >= 0]  # noqa: SLF001 - live ones only (the sample can be older)
        return bool(cand.size) and bool((dense.exact_slots(q, cand) > cut).any())

    def _whole_parts(self, searcher) -> list | None:
        """``[(slots, int8 copy, live mask)]`` of the draw and the chunks written since, when the sample holds every
        chunk (:meth:`whole`), else None (also for an empty shard)."""
        dense = searcher.store.dense
        if not len(dense) or not self._current(dense, getattr(searcher.store, "next_slot", None)) or not self.whole():
            return None
        if self._live[0] != dense._version:  # noqa: SLF001 - which drawn chunks are still live, once a write
            self._live = (dense._version, dense._rows_of(self._slots) >= 0)  # noqa: SLF001
        return [(sl, i8, live) for sl, i8, live, ok in ((self._slots, self._i8, self._live[1], self._ok),  # (the new part:
                (self._new, self._new_i8, np.ones(self._new.size, bool), self._new.size > 0)) if ok]  # live, _current)

    def tops(self, searcher, q: np.ndarray, which: list[int], n: int) -> dict | None:
        """The exact top-n ``{i: (slots int64[n'], canonical float64[n'])}`` (ties: chunk id) of the queries ``which``
        of float32[B, D] ``q`` from one int8 scan of the sample, when it holds every chunk (:meth:`whole`; else None):
        cheaper than the ANN search and a check of all its places (trial39: at 5K chunks a shard, an HNSW walk for a
        keyword query, checked place by place, widened to the exact scan and doubled the CPU)."""
        from ..index.fusion import _Take, refine_top  # noqa: PLC0415

        parts = self._whole_parts(searcher)
        if parts is None:
            return None
        dense, ids = searcher.store.dense, searcher.store._slot_ids  # noqa: SLF001 - slot-indexed ids, for ties
        sl = np.concatenate([p[0][p[2]] for p in parts])
        out = {}
        for i in which:
            approx = np.concatenate([self._scores(i8, q[i])[live] for _, i8, live in parts]).astype(np.float64)
            err = max(float(i8.error(q[i])) for _, i8, _ in parts)
            pos, ex = refine_top(approx, err, lambda p, qi=q[i]: dense.exact_slots(qi, sl[p]), _Take(ids, sl), n)
            out[i] = (sl[pos], ex)
        return out

    def lows(self, searcher, q: np.ndarray, plain: list[int]) -> list | None:
        """The exact dense minimum (lowest canonical score of a live chunk) of each query ``plain`` of float32[B, D]
        ``q``, read from the sample when it holds every chunk (:meth:`whole`; None otherwise, or for an empty shard):
        the chunks within twice the int8 error of the lowest int8 score are scored canonically (trial39: an HNSW's
        ``-q`` walk on a 1,850-chunk shard missed the minimum and a certified reply's fused scores differed from
        exact mode's)."""
        dense, parts = searcher.store.dense, self._whole_parts(searcher)
        if parts is None:
            return None
        out = []
        for i in plain:
            low = np.inf
            for sl, i8, live in parts:
                if live.any():
                    approx, err = self._scores(i8, q[i]), i8.error(q[i])
                    near = sl[live & (approx <= float(approx[live].min()) + 2.0 * err)]
                    low = min(low, float(dense.exact_slots(q[i], near).min()))
            out.append(low if np.isfinite(low) else None)
        return out


class _Draw:
    """A redraw of :class:`SampleCheck` by a thread: the live slots (a racy read: the chunks written after it are the
    draw's new part, one removed since is skipped when flagged), their vectors read under the rows' lock
    (:meth:`..index.ivf_rows.IvfRows.locked_vectors`; valid if no HNSW compaction renumbered the ids meanwhile:
    ``installs``). ``out``: :meth:`SampleCheck._adopt`'s arguments, None until done or when it failed."""

    def __init__(self, dense, n: int, sample: int) -> None:
        self.installs, self.out = dense.installs, None
        self.thread = threading.Thread(target=self._run, args=(dense, n, sample), name="oprag-check-draw")
        self.thread.start()

    def _run(self, dense, n: int, sample: int) -> None:
        from ..index.slot_sample import live_slots, strided  # noqa: PLC0415

        try:
            if self.installs % 2:  # (an install under way)
                return
            live = live_slots(dense)
            slots = strided(live, sample)
            ok, vecs = dense.locked_vectors(slots)
            if dense.installs == self.installs:
                self.out = (n, slots[ok], np.ascontiguousarray(vecs, dtype=np.float32), live)
        except Exception:  # noqa: BLE001 - the old draw serves; the next query that finds it stale tries again
            self.out = None


def whole_tops(searcher, q: np.ndarray, which: list[int], n: int) -> dict | None:
    """:meth:`SampleCheck.tops` of an HNSW / IVF shard of at most ``ann_check`` chunks (the searcher's check made on
    first use), else None: the caller searches its index."""
    dense = searcher.store.dense
    ck = dense.params.ann_check
    if not ck or dense.ann is None or not dense.ann.ready or len(dense) > ck:  # (flat; an IVF not trained: exact)
        return None
    if searcher._check is None:  # noqa: SLF001
        searcher._check = SampleCheck(ck)  # noqa: SLF001
    return searcher._check.tops(searcher, q, which, n)  # noqa: SLF001


def widened(searcher, check: SampleCheck, q: np.ndarray, out: dict, n: int, ef_search: int, nprobe: int) -> None:
    """Search the queries of ``out`` (query index -> ``(slots, canonical scores)``, approximate
    tops of float32[B, D] ``q``) whose list :meth:`SampleCheck.misses` shows incomplete again,
    with the index's knob :data:`FACTOR` times larger each round (HNSW: the beam ``ef_search``,
    up to :data:`MAX_EF`; IVF: ``nprobe``, up to every list, an exhaustive search), then
    exactly; their entries are replaced. An IVF not trained yet searched exactly: nothing to do."""
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
        ef, probe = (knob, nprobe) if name == "ef_search" else (ef_search, knob)
        got = searcher._dense_tops(q, bad, n, ef, probe, check=False)  # noqa: SLF001
        out.update(got)
        bad = [i for i in bad if check.misses(searcher, q[i], *got[i])]
    if bad:  # still provably short at the widest knob (or one covering the shard): a graph its walks
        live, approx = dense.slots, dense.score_all(q[bad])  # cannot cover (trial36): the exact top-n, from
        for j, i in enumerate(bad):  # one matrix product over the stored vectors (no gather), refined canonically
            out[i] = searcher._refine(q[i], live, approx[j], n)  # noqa: SLF001
