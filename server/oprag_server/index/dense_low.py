"""The lowest inner product of a query with a shard's vectors under an HNSW index, without a
second full ANN search: the dense minimum that min-max fusion normalises with (exact mode uses
the true minimum over every chunk, so dense-first hybrid wants the same value).

The minimum of ``q . v`` is the maximum of ``(-q) . v``. A plain HNSW search for ``-q`` descends
from the graph's entry point, which sits among typical vectors, far from the outliers that
minimise ``q . v``: at 500K vectors per shard it found the true minimum for ~72% of queries at
ef_search 512 (~2 ms). Instead, each shard keeps :class:`LowSeeds`, a small set of vectors that
are extreme in some direction: for ``PROBES`` directions (spherical k-means centroids of the
vectors, FAISS ``Kmeans``), the ``PER_PROBE`` vectors with the lowest inner product with each
(a "reverse" top-T, FAISS ``knn`` with ``-probe``). A query scores the seed set, and a search for ``-q`` on the graph's bottom layer (beam: a sixteenth of the
request's ``ef_search``, at least 16; 32 at the default 512) starts from the ``ENTRIES`` lowest
seeds. Both read an int8 copy of the graph's vectors (:class:`Int8Graph`: per-row scale,
:func:`.kernels_scan.quantize`; a quarter of the float32 bytes) with a proven error bound ``err``
(:func:`.kernels_scan.error_bound`): the search is FAISS's ``search_level_0`` walk over those
scores (:func:`.kernels_low.low_search`), and the candidates returned are the seeds and searched
vectors whose int8 score is within ``2 err`` of the lowest one, so the lowest canonical score
among them is exactly the lowest over the seeds and the vectors the search kept. Every value is
the score of a real live chunk, so it is never below the true minimum (like the sample estimate
and the ``-q`` search); measured accuracy and cost are in bench/RESULTS.md ("dense minimum";
"the dense side on an int8 copy" for this form).

Upkeep: built on first use (``Searcher.warm`` builds it at start); vectors added since are
tested against the probes (a vector whose score with some probe is below that probe's
``PER_PROBE``-th lowest at build time joins the seeds); dead ids are skipped at query time; the
set is rebuilt when the graph was rebuilt (compaction) or has doubled since the build. The int8
copy follows the graph the same way (rows quantised as they enter it; requantised on a rebuild).
Memory: the int8 copy is ``D + 8`` bytes per vector (~196 MB per 500K-vector shard at D 384).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from . import graph_layout, hugepages, kernels_low, kernels_scan, low_seeds_state, probe_lowest
from .ann_copies import level0 as _level0


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def search_from(ann, q: np.ndarray, entries: np.ndarray, entry_scores: np.ndarray, ef: int) -> np.ndarray:
    """The best live vector of the HNSW :class:`.ann.AnnIndex` ``ann`` for float32[B, D] ``q``
    (largest inner product) found by a beam search of width ``ef`` on the graph's bottom layer
    that starts from the given ANN ids int[B, E] (FAISS ``IndexHNSW.search_level_0``, all
    entries at once), instead of descending from the graph's entry point.

    :param entry_scores: float[B, E]: ``q . v`` of each entry vector.
    :returns: int64[B] ANN ids (-1 where nothing live was found).
    """
    faiss = _faiss()
    q = np.ascontiguousarray(q, dtype=np.float32)
    b, e = entries.shape
    ent = np.ascontiguousarray(entries, dtype=np.int32)
    # FAISS's HNSW works on distances; for inner product the distance is -(q . v)
    dist = np.ascontiguousarray(-np.asarray(entry_scores, dtype=np.float32))
    out_d, out_i = np.empty((b, 1), np.float32), np.full((b, 1), -1, np.int64)
    params = ann._hnsw_params(ef)  # noqa: SLF001 - the index package's own
    ann._index.search_level_0(b, faiss.swig_ptr(q), 1, faiss.swig_ptr(ent), faiss.swig_ptr(dist),  # noqa: SLF001
                              faiss.swig_ptr(out_d), faiss.swig_ptr(out_i), e, 1, params)
    return out_i[:, 0]


class Int8Graph:
    """The int8 copy of an HNSW graph's stored vectors by ANN id (rows quantised as the graph
    grows; per-row scale and the error constants of :func:`.kernels_scan.quantize`), the visited
    marks of :func:`.kernels_low.low_search` and zero-copy views of FAISS's level-0 lists."""

    def __init__(self) -> None:
        self.n = 0  # rows quantised (graph ids [0, n))
        self.codes = np.zeros((0, 0), np.int8)  # int8[capacity, D]
        self.scale = np.zeros(0, np.float32)
        self.stamp = np.zeros(0, np.uint8)  # visited marks (a byte: FAISS's VisitedTable)
        self.mark = 0
        self.e = self.c = 0.0

    def follow(self, st: np.ndarray, rebuild: bool) -> None:
        """Quantise the rows of float32[A, D] ``st`` (the graph's storage) not quantised yet; all
        of them with ``rebuild`` (a new graph)."""
        a, d = st.shape
        if rebuild:
            self.n, self.e, self.c = 0, 0.0, 0.0
        if (rebuild and a != self.codes.shape[0]) or a > self.codes.shape[0] or self.codes.shape[1] != d:
            cap = a if rebuild else int(a * 1.25) + 1024  # growing: 25% headroom
            codes, scale = np.empty((cap, d), np.int8), np.empty(cap, np.float32)
            if self.n:
                codes[:self.n], scale[:self.n] = self.codes[:self.n], self.scale[:self.n]
            self.codes, self.scale = codes, scale
            self.stamp, self.mark = np.zeros(cap, np.uint8), 0
        if a > self.n:
            e, c = kernels_scan.quantize(np.ascontiguousarray(st[self.n:a]), self.codes[self.n:a], self.scale[self.n:a])
            self.e, self.c, self.n = max(self.e, e), max(self.c, c), a

    def error(self, q: np.ndarray) -> float:
        """Bound of ``|int8 score - canonical score|`` of float32[D] ``q`` for every row."""
        return kernels_scan.error_bound(self.e, self.c, self.codes.shape[1], q)

    def next_mark(self) -> int:
        self.mark += 1
        if self.mark > 255:  # every 255 walks: clear the marks
            self.stamp[:], self.mark = 0, 1
        return self.mark

    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scale.nbytes + self.stamp.nbytes)


def huge_pages(ann, collapse: bool) -> bool:
    """Huge pages (:func:`.hugepages.advise`) under FAISS's HNSW storage and neighbour lists,
    which the graph walks, the ANN search and the canonical rows read at random; with
    ``collapse`` folded now (at a build: ~1 s per 768 MB). :returns: True when both took."""
    if int(ann._index.ntotal) == 0:  # noqa: SLF001
        return False
    ok = hugepages.advise(ann.storage(), collapse)
    return hugepages.advise(_level0(ann._index)[0], collapse) and ok  # noqa: SLF001


class LowSeeds:
    """Seeds of the lowest-inner-product search of one HNSW index (module docstring). Not
    thread-safe (one shard's searches are serial)."""

    #: probe directions, lowest vectors kept per probe, search entries; the beam is the
    #: request's ef_search / BEAM_DIV, at least MIN_BEAM; rows per block of the build
    PROBES, PER_PROBE, ENTRIES, BEAM_DIV, MIN_BEAM, BLOCK = 256, 16, 16, 16, 16, 32768
    #: from this many vectors the seeds of a graph grown 2x are made by a thread (refresh_seeds): the query that found
    #: it built them, ~30 us a vector (0.49-0.66 s at 16-17K, 2.35 s at 100K: sessions 40-41). A new graph's first
    #: seeds are built where first needed (session 41 tried a thread from 1,024 vectors: the hybrid scores then
    #: depended on whether the thread had finished, the sample estimate serving meanwhile, and a restart's answers
    #: differed from the run's). 8,192, not 16,384 (session 42): a shard first needs seeds once it holds more than the
    #: check's sample (16,384 by default; below, the sample gives the exact minimum), when its graph (the newest
    #: vectors deferred to the tail) may hold fewer than 16,384, and the build stalled that query 0.66 s; the sample
    #: estimate serves until the thread is done (that window, during an ingest, is timing-dependent)
    REFRESH_MIN = 8_192
    #: the walk on the int8 copy of the graph (:func:`.kernels_low.low_search`); False: FAISS's
    #: ``search_level_0`` in float32 from the same entries, no copy of the graph
    INT8_WALK = True

    def __init__(self) -> None:
        self._index = None  # the FAISS index the seeds were built for
        self._built_at = 0  # vectors in the graph at the build
        self._seen = 0  # vectors in the graph already tested against the probes
        self._ids = np.zeros(0, np.int64)  # ANN ids of the seeds
        self._codes = np.zeros((0, 0), np.int8)  # their int8 rows (a contiguous copy) and scales
        self._scale = np.zeros(0, np.float32)
        self._se = (0.0, 0.0)  # the seeds' error constants (kernels_scan.quantize)
        self._probes = np.zeros((0, 0), np.float32)
        self._thresh = np.zeros(0, np.float32)  # per probe: the PER_PROBE-th lowest score at build
        self._g = Int8Graph()
        self._l0 = None  # (index, ntotal, graph arrays): _graph's, kept while the graph is unchanged
        self._next = None  # a refresh_seeds job under way (the graph grew 2x)
        self.built: list[tuple[int, float, str]] = []  # (vectors, seconds, where) of each build, until logged

    def _set_ids(self, ids: np.ndarray, st: np.ndarray) -> None:
        """The seeds: ANN ids and their int8 rows (quantised alone: their own error constants)."""
        self._ids = np.asarray(ids, np.int64)
        self._codes, self._scale = np.empty((ids.size, st.shape[1]), np.int8), np.empty(ids.size, np.float32)
        self._se = kernels_scan.quantize(np.ascontiguousarray(st[self._ids]), self._codes, self._scale)

    def _new_graph(self, ann) -> np.ndarray:
        """(Seeds for a graph not seen yet) its storage float32[A, D], huge pages folded, the int8 copy made anew."""
        st = ann.storage()
        huge_pages(ann, collapse=True)
        if self.INT8_WALK:
            self._g.follow(st, rebuild=True)
        return st

    def _build(self, ann) -> None:
        st = self._new_graph(ann)
        a = st.shape[0]
        self._index, self._built_at, self._seen = ann._index, a, a  # noqa: SLF001
        if a == 0:
            self._set_ids(np.zeros(0, np.int64), st)
            self._probes, self._thresh = np.zeros((0, ann.dim), np.float32), np.zeros(0, np.float32)
            return
        p = int(min(self.PROBES, max(1, a // 64)))
        probes = _probes(st[graph_layout.sample_ids(ann, a, max(1, a // (64 * p)))], p)
        p, t = probes.shape[0], min(self.PER_PROBE, a)
        # per probe, the t (+ spare) lowest scores: blocks of rows times the probes (one BLAS product each),
        # the lowest of each block joined with those so far; then the t lowest of them in float64 (probe_lowest.settled)
        best_s, best_i = probe_lowest.fold_start(p, t, a)
        for lo in range(0, a, self.BLOCK):
            best_s, best_i = probe_lowest.fold_lowest(best_s, best_i, probes @ st[lo:lo + self.BLOCK].T, lo)
        self._thresh, ids = probe_lowest.settled(probes, best_i, st[np.unique(best_i)], getattr(ann, "ann_slot", None), t)
        self._probes = probes
        self._set_ids(ids, st)

    def prepare(self, ann) -> None:
        """Build the seeds of ``ann``'s graph now unless they are built (the shard's start: no query waits), or
        restore those its snapshot kept (:mod:`.low_seeds_state`)."""
        if ann._index is not self._index:  # noqa: SLF001
            self._next = None
            self._timed_build(ann, int(ann._index.ntotal), "at start")  # noqa: SLF001

    def _update(self, ann) -> None:
        a = int(ann._index.ntotal)  # noqa: SLF001
        thread = a >= self.REFRESH_MIN and hasattr(ann, "_mut")
        if ann._index is not self._index or a < self._seen:  # noqa: SLF001 - a new graph: built here
            self._next = None
            self._timed_build(ann, a, "in the query that needed them")
            return
        if a >= 2 * max(self._built_at, 8):  # grown 2x: new probes, made beside the queries (refresh_seeds)
            if self._next is None and not thread:
                self._timed_build(ann, a, "in the query that found the graph grown 2x")
                return
            if self._next is None:
                self._next = refresh_seeds(self, ann, a)
            elif not self._next.thread.is_alive():
                self._adopt(self._next)
        if a > self._seen:  # new vectors: quantised; those extreme for some probe join the seeds
            st = ann.storage()
            huge_pages(ann, collapse=False)  # an add may have moved the buffers
            if self.INT8_WALK:
                self._g.follow(st, rebuild=False)
            low = ((st[self._seen:a] @ self._probes.T) <= self._thresh).any(axis=1)
            if low.any():
                self._set_ids(np.concatenate([self._ids, self._seen + np.flatnonzero(low)]), st)
            self._seen = a
        low_seeds_state.mark(self, ann)  # (a tuple: what a snapshot's writer thread reads whole)

    def _timed_build(self, ann, a: int, where: str) -> None:
        """:meth:`_build` here (or the snapshot's seeds restored: :meth:`_restore`), its vectors, time and ``where``
        kept in :attr:`built` (the shard logs them)."""
        t = time.perf_counter()
        if not self._restore(ann):
            self._build(ann)
        else:
            where = "from the snapshot"
        self.built.append((a, time.perf_counter() - t, where))
        low_seeds_state.mark(self, ann)

    def _restore(self, ann) -> bool:
        """Take the seeds ``ann``'s snapshot kept for its graph (:func:`.low_seeds_state.take`) when they fit it; the
        int8 copy is made anew (the same rows and bounds)."""
        if (saved := low_seeds_state.take(ann)) is None:
            return False
        st = self._new_graph(ann)
        self._probes, self._thresh, ids, self._built_at, self._seen = saved
        self._index = ann._index  # noqa: SLF001
        self._set_ids(ids, st)
        return True

    def _adopt(self, job) -> None:
        """Take a finished :func:`refresh_seeds` job's probes and seeds; the vectors added since it read the graph are
        tested against the new probes by the next :meth:`_update` (``_seen`` goes back to its size)."""
        self._next = None
        if job.out is None:  # (failed: the next doubling tries again)
            self._built_at = job.a
            return
        self.built.append((job.a, job.seconds, "by a thread while the old ones served (the graph grew 2x)"))
        self._probes, self._thresh, ids, codes, scale, se = job.out
        self._ids, self._codes, self._scale, self._se = ids, codes, scale, se
        self._built_at, self._seen = job.a, min(self._seen, job.a)

    def candidates(self, ann, q: np.ndarray, ef: int = 0) -> list[np.ndarray]:
        """Per query of float32[B, D] ``q``: ANN ids int64[C] of live vectors among which the
        lowest canonical score found lies: the seeds and the vectors the bottom-layer search for
        ``-q`` from the lowest seeds kept whose int8 score is within ``2 * err`` of the lowest
        int8 score among them (the k = 1 argument of ``refine_top``: the int8 scores err by at
        most ``err``, :meth:`Int8Graph.error`). Empty when the index holds no live vector or the
        query is not finite; None (each query) while no live seed covers a graph that holds live
        vectors (a thread makes them: the caller estimates the minimum meanwhile).

        :param ann: the shard's :class:`.ann.AnnIndex` (HNSW). :param ef: the request's HNSW
            beam (0: the index default); this search's beam is a sixteenth of it, at least 16
            (32 at the default 512).
        """
        self._update(ann)
        b, g = q.shape[0], self._g
        live = ann.ann_slot[self._ids] >= 0
        if not b or not live.any():
            n = int(ann._index.ntotal)  # noqa: SLF001
            return [None if (ann.ann_slot[:n] >= 0).any() else np.zeros(0, np.int64)] * b
        ids, e = self._ids, min(self.ENTRIES, int(live.sum()))
        beam = max(self.MIN_BEAM, int(ef or ann.params.ef_search) // self.BEAM_DIV)
        nbr, off, width = self._graph(ann) if self.INT8_WALK else (None, None, 0)
        st, every = (None if self.INT8_WALK else ann.storage()), bool(live.all())
        got_i, got_d = np.empty(beam, np.int64), np.empty(beam, np.float32)
        out = []
        for j in range(b):
            qj = np.ascontiguousarray(q[j], dtype=np.float32)
            if not np.isfinite(qj).all():
                out.append(np.zeros(0, np.int64))
                continue
            s = kernels_scan.scan(self._codes, self._scale, qj, np.empty(ids.size, np.float32))
            if not every:
                s[~live] = np.inf  # dead seeds: never an entry, never the minimum
            part = np.argpartition(s, e - 1)[:e]
            part = part[np.argsort(s[part], kind="stable")]  # the lowest first
            if not self.INT8_WALK:  # FAISS's walk in float32 from the same entries: the vector it finds
                ent = ids[part]
                f = int(search_from(ann, -qj[None], ent[None], -(st[ent] @ qj)[None], beam)[0])
                near = ids[s <= np.float64(s.min()) + 2.0 * kernels_scan.error_bound(*self._se, qj.size, qj)]
                out.append(near if f < 0 or ann.ann_slot[f] < 0 else np.append(near, f))
                continue
            k = kernels_low.low_search(nbr, off, width, g.codes, g.scale, ann.ann_slot, qj, ids[part], beam,
                                       g.stamp, g.next_mark(), got_i, got_d)
            lim = np.float64(min(float(s.min()), float(got_d[:k].min()) if k else np.inf)) + 2.0 * g.error(qj)
            out.append(np.concatenate([ids[s <= lim], got_i[:k][got_d[:k] <= lim]]))
        return out

    def _graph(self, ann) -> tuple:
        """:func:`_level0` of the graph, kept while it is unchanged."""
        index, a = ann._index, int(ann._index.ntotal)  # noqa: SLF001
        if self._l0 is None or self._l0[0] is not index or self._l0[1] != a:
            self._l0 = (index, a, _level0(index))
        return self._l0[2]

    def nbytes(self) -> int:
        """Bytes held: the int8 copy of the graph, the seeds' ids and rows, the probes and their
        thresholds."""
        return int(self._g.nbytes() + self._ids.nbytes + self._codes.nbytes + self._scale.nbytes
                   + self._probes.nbytes + self._thresh.nbytes)


def _probes(train: np.ndarray, p: int) -> np.ndarray:
    """float32[P', D] unit probe directions: the ``p`` spherical k-means centroids of float32[M, D] ``train`` (10
    iterations, seed 1); one, the points' mean direction, where ``train`` holds fewer than 39 points a centroid (FAISS's
    k-means warns on stderr below that, trial36; the mean is what it converges to)."""
    train = np.ascontiguousarray(train, dtype=np.float32)
    if train.shape[0] < 39 * p:
        cents = train.mean(axis=0, keepdims=True)
    else:
        km = _faiss().Kmeans(train.shape[1], p, niter=10, seed=1, spherical=True, max_points_per_centroid=64)
        km.train(train)
        cents = km.centroids
    unit = cents / np.maximum(np.linalg.norm(cents, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(unit, dtype=np.float32)


class _Refresh:
    """A :func:`refresh_seeds` job: its thread, the graph size ``a`` it covers and its result ``out`` (None until
    done, or when it failed or the graph was replaced meanwhile)."""

    def __init__(self, a: int) -> None:
        self.a, self.out, self.seconds = a, None, 0.0
        self.thread: threading.Thread | None = None  # (started by refresh_seeds; not a daemon: an exit waits for it)


def refresh_seeds(seeds: LowSeeds, ann, a: int) -> _Refresh:
    """New probes, thresholds and seeds for the first ``a`` vectors of ``ann``'s graph, made by a thread while the
    shard serves with the old ones (:meth:`LowSeeds._update` adopts them once done). The graph's storage may move
    when the shard inserts, so every read of it is a copy taken under ``ann._mut`` (which every insert holds), a block
    of :data:`REFRESH_BLOCK` rows at a time; the products and k-means run outside it. Same rules as
    :meth:`LowSeeds._build` (the int8 copy of the graph is kept: the graph is the same, only grown)."""
    job, index, p = _Refresh(a), ann._index, int(min(seeds.PROBES, max(1, a // 64)))  # noqa: SLF001
    sample = graph_layout.sample_ids(ann, a, max(1, a // (64 * p)))  # (the id -> slot map read on this thread)
    slot_map = getattr(ann, "ann_slot", None)
    slot_map = None if slot_map is None else np.array(slot_map[:a])

    def rows(sel) -> np.ndarray | None:
        with ann._mut:  # noqa: SLF001
            return None if ann._index is not index else np.array(ann.storage()[sel])  # noqa: SLF001

    def run() -> None:
        t0 = time.perf_counter()
        try:
            train = rows(sample)
            if train is None:
                return
            probes = _probes(train, p)
            t = min(seeds.PER_PROBE, a)
            best_s, best_i = probe_lowest.fold_start(probes.shape[0], t, a)
            for lo in range(0, a, REFRESH_BLOCK):
                blk = rows(slice(lo, min(lo + REFRESH_BLOCK, a)))
                if blk is None:
                    return
                best_s, best_i = probe_lowest.fold_lowest(best_s, best_i, probes @ blk.T, lo)
            kept = rows(np.unique(best_i))
            if kept is None:
                return
            thresh, ids = probe_lowest.settled(probes, best_i, kept, slot_map, t)
            vecs = rows(ids)
            if vecs is None:
                return
            codes, scale = np.empty((ids.size, ann.dim), np.int8), np.empty(ids.size, np.float32)
            se = kernels_scan.quantize(np.ascontiguousarray(vecs), codes, scale)
            job.out = (probes, thresh, ids, codes, scale, se)
        except Exception:  # noqa: BLE001 - the old seeds stay; the next doubling tries again
            job.out = None
        job.seconds = time.perf_counter() - t0

    job.thread = threading.Thread(target=run, name="oprag-seeds")
    job.thread.start()
    return job


#: rows of the graph's storage copied per locked read of :func:`refresh_seeds` (12 MB at D 384)
REFRESH_BLOCK = 8192
