"""Approximate nearest-neighbour search for the dense side: FAISS HNSW or IVF over the same
L2-normalised float32 vectors as :class:`~oprag_server.index.dense.DenseIndex` (inner product,
``METRIC_INNER_PRODUCT``).

One copy with HNSW: ``IndexHNSWFlat`` keeps the vectors in its flat storage, in ANN-id order;
:meth:`AnnIndex.storage` is a zero-copy numpy view of it, and the dense index reads its exact
scores from there instead of keeping a second float32 copy. IVF keeps its vectors in its
inverted lists (by list, not by id), so the dense index keeps its own float32 copy besides; the lists
hold 8-bit codes (``IndexIVFScalarQuantizer``, ``QT_8bit``: D bytes a vector, a quarter of
``IndexIVFFlat``'s float32 lists; 1.2 GB less at 1M chunks of width 384) and only pick candidates:
:meth:`DenseIndex.search` asks for more than it needs and keeps the best by the float32 copy
(issue 13: IVFFlat at 1M held every vector twice, RSS 8.3 GiB, and read 4x the bytes a probed list
needs; bench/RESULTS.md, session 37). A snapshot written with ``IndexIVFFlat`` lists loads and
searches as before until its next training.

The ANN structure only *picks candidates*; every score a shard returns is still canonical
(:func:`~oprag_server.index.dense.fixed_order_dot`), so identical content scores identically
whatever the index type, and exact mode (``full_hybrid``) never uses it.

Ids: each added vector gets the next *ANN id* (0, 1, 2, ... in insertion order);
``ann_slot[ann_id]`` is its chunk slot, or -1 once removed. Removal:

* HNSW cannot delete: a removed vector stays in the graph, marked dead, and every search excludes dead ids inside
  FAISS (``IDSelectorNot(IDSelectorBatch(dead))``), so a deleted chunk is never returned and a query still gets k live
  results. :meth:`AnnIndex.needs_compaction` is true once a quarter of the graph is dead; the owner then rebuilds it
  from the live vectors (:meth:`DenseIndex.compact_ann`: on snapshot, or on a write that crosses the threshold).
  Identical vectors: a copy of a linked vector is stored unlinked and searches return it beside that vector
  (:mod:`.ann_copies`); a search that ran into a group of linked copies (a graph built before) searches again
  (:mod:`.ann_escape`).
* IVF removes ids from its inverted lists at once.

Deferred HNSW inserts (:meth:`AnnIndex.defer`, issue 13): an ingest may register vectors without inserting them into
the graph. They get their ANN ids at once (the next ones, in order) and wait in a *tail* (float32 rows, ids ``[ntotal,
ann_slot.size)``) until :meth:`AnnIndex.insert_pending` puts them into the graph in id order (the shard does it
between requests, and an add past its tail bound does it at once). Every read covers the tail: :meth:`AnnIndex.gather`
and :meth:`AnnIndex.matvec` read its rows, and :meth:`AnnIndex.search` adds an exact scan of its live rows to the
graph's candidates (a tail row found that way has its exact score, so a query sees every vector added, indexed or
not). Serialising the structure (:meth:`AnnIndex.to_bytes`) inserts the whole tail first and a rebuild absorbs it; a
snapshot writes the graph (:meth:`AnnIndex.write`) and the tail's rows (:meth:`AnnIndex.tail`) apart, and
:meth:`AnnIndex.load` takes both back.

IVF training: the first ``train_min`` vectors of a shard are searched exactly (flat) while they accumulate; the IVF is
then trained on the vectors held at that moment (k-means on at most 64 a list, :func:`.ivf_lists.ivf_lists` lists), and
again, every vector re-added, each time the shard has grown 8x (the lists stay balanced) and on compaction; a
retraining of at least :data:`.ivf_build.BACKGROUND_MIN` vectors runs in a thread while the old lists serve
(:mod:`.ivf_build`).
"""

from __future__ import annotations

import time

import numpy as np

from ..config import DenseConfig
from .ann_copies import Copies, hnsw_storage
from .ann_persist import AnnPersist, ChangeLock
from .ann_escape import escape

from .hnsw_build import GraphBuild, graph_bytes
from .ivf_build import BACKGROUND_MIN, CATCH_UP, IvfBuild, IvfBuilds, locked, new_ivf, train_sample
from .ivf_lists import IVF_TRAIN_FLOOR, ivf_lists  # noqa: F401 - IVF_TRAIN_FLOOR re-exported (cli, tests)

#: deferred vectors per FAISS ``add`` (:meth:`AnnIndex.insert_pending`): the shard's step between requests
#: (``ShardState.BACKGROUND_STEP``); at 500K vectors a piece of 32 costs the same per vector as one of 640 (session 47)
PIECE = 32


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


class AnnIndex(IvfBuilds, AnnPersist):
    """HNSW or IVF over ANN ids (see the module docstring). Changed on one thread only; a background build's thread
    (:mod:`.ivf_build`, :mod:`.hnsw_build`) reads it under ``_mut``, which every change holds.

    :param dim: vector width D. :param params: :class:`DenseConfig` (kind ``hnsw`` or ``ivf``).
    """

    def __init__(self, dim: int, params: DenseConfig) -> None:
        if params.kind not in ("hnsw", "ivf"):
            raise ValueError(f"AnnIndex is for hnsw or ivf, not {params.kind!r}")
        self.dim, self.params = int(dim), params
        self.ann_slot = np.zeros(0, dtype=np.int64)  # ann id -> slot, -1 when dead
        self.dead = 0
        self.trained_at = 0  # vectors held when the IVF was last trained (0: not trained)
        # (vectors, lists, seconds, how: None = in the write) of each IVF (re)training, until taken (the shard logs them)
        self.trainings: list[tuple[int, int, float, str | None]] = []
        # (live vectors, dead ones dropped, seconds, how: None = in the delete) of each HNSW compaction, until taken
        self.compactions: list[tuple[int, int, float, str | None]] = []
        # HNSW: the graph's size at its last renumbering for locality (:mod:`.graph_layout`; kept in the snapshot), and
        # (vectors, seconds) of each renumbering, until taken (the shard logs them)
        self.laid_at = 0
        self.layouts: list[tuple[int, float]] = []
        self._index = None
        self._build: IvfBuild | GraphBuild | None = None  # an IVF retraining / HNSW compaction under way
        self._mut = ChangeLock()  # held by every change of the structure, and by the build's reads of it
        self.seeds = None  # HNSW: a compaction's dense-minimum seeds for its graph, until the searcher takes them
        self.source = None  # IVF: the dense index's locked reads (gather, live slots) a background retraining makes
        self._selector = None  # ((dead count, ids), selector) for HNSW searches (an add may give a dead one a copy)
        self._copies = Copies()  # HNSW: identical vectors kept unlinked (ann_copies)
        # HNSW: deferred vectors of ANN ids [ntotal, ann_slot.size) are _tail[_tail_at:_tail_n]
        self._tail = np.zeros((0, self.dim), dtype=np.float32)
        self._tail_at = self._tail_n = 0
        self._groups: list[int] = []  # HNSW: the first ANN id of each deferred write's vectors (insert_pending)
        if params.kind == "hnsw":
            self._index = self._new_hnsw()

    # ------------------------------------------------------------------ build
    def _new_hnsw(self):
        faiss = _faiss()
        idx = faiss.IndexHNSWFlat(self.dim, self.params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        idx.hnsw.efConstruction = self.params.ef_construction
        return idx

    @property
    def train_min(self) -> int:
        """Vectors held before the IVF is trained: ``params.train_min``, at least :data:`IVF_TRAIN_FLOOR`."""
        return max(self.params.train_min, IVF_TRAIN_FLOOR)

    @property
    def live(self) -> int:
        return int(self.ann_slot.size - self.dead)

    @locked
    def add(self, slots: np.ndarray, vectors: np.ndarray, all_live: tuple[np.ndarray, np.ndarray]) -> None:
        """Add float32[M, D] ``vectors`` of int64[M] ``slots``.

        :param all_live: ``(slots, vectors)`` of every live vector after this add (the IVF
            trains on them the first time and when it retrains).
        """
        if self.params.kind == "ivf":
            total = all_live[0].size
            if self._index is None and total < self.train_min:
                self._append_ids(slots)  # not trained yet: searched exactly by the caller
                return
            b = self._build
            if b is not None and (b.done or total >= CATCH_UP * b.trained_at):
                self.install(*all_live)  # (this add's vectors are among those written since the trigger)
                return
            if self._index is None or (b is None and total >= 8 * self.trained_at):
                if self._index is None or total < BACKGROUND_MIN or self.source is None:
                    self.rebuild(*all_live)
                    return
                self._build = IvfBuild(self.dim, all_live[0], train_sample(all_live[1]), self.source)  # (then added
                # to the old lists; the k-means sample copied now: the same centroids whenever the thread runs)
        self.insert_pending()  # (ids stay in insertion order)
        first = self.ann_slot.size
        self._append_ids(slots)
        ids = np.arange(first, first + slots.size, dtype=np.int64)
        if self.params.kind == "ivf":
            self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids)
        else:
            self._copies.add(self._index, vectors)

    @property
    def pending(self) -> int:
        """Deferred vectors not in the HNSW graph yet (0 for IVF)."""
        return self._tail_n - self._tail_at

    def _tail_rows(self) -> np.ndarray:
        return self._tail[self._tail_at:self._tail_n]

    def tail(self) -> np.ndarray:
        """float32[pending, D]: the deferred vectors, ANN ids ``ntotal...`` in order (a view, valid
        until the next add, defer, insert or load)."""
        return self._tail_rows()

    @locked
    def defer(self, slots: np.ndarray, vectors: np.ndarray) -> None:
        """HNSW: give float32[M, D] ``vectors`` of int64[M] ``slots`` the next ANN ids without
        inserting them (see the module docstring); IVF: :meth:`add` at once."""
        vectors = np.asarray(vectors, dtype=np.float32)
        if self.params.kind != "hnsw":
            self.add(slots, vectors, (slots, vectors))
            return
        m, live = vectors.shape[0], self.pending
        if self._tail_n + m > self._tail.shape[0]:  # grow, moving the live rows to the front
            grown = np.empty((max(int(1.5 * (live + m)), 4096), self.dim), dtype=np.float32)
            grown[:live] = self._tail_rows()
            self._tail, self._tail_at, self._tail_n = grown, 0, live
        self._tail[self._tail_n:self._tail_n + m] = vectors
        self._tail_n += m
        self._groups.append(int(self.ann_slot.size))
        self._append_ids(slots)

    @locked
    def insert_pending(self, n: int | None = None) -> int:
        """Insert at least the oldest ``n`` (None: all) deferred vectors into the HNSW graph, in ANN-id order, in
        pieces of at most :data:`PIECE` counted from the start of each write's vectors (:meth:`defer`), one FAISS
        ``add`` each. FAISS inserts an ``add``'s batch in an order of its own (levels descending, shuffled), so
        the pieces, not the steps the shard happened to cut its inserts into, decide the graph: a log replay after
        ``kill -9`` or a restart with deferred vectors links them as the shard before it did (trial47 #3).
        :returns: how many were inserted."""
        want, done = (self.pending if n is None else min(int(n), self.pending)), 0
        while done < want:
            at, g = int(self._index.ntotal), self._groups
            while len(g) > 1 and g[1] <= at:
                g.pop(0)
            start, end = (g[0] if g else at), (g[1] if len(g) > 1 else int(self.ann_slot.size))
            k = min(start + ((at - start) // PIECE + 1) * PIECE, end) - at
            self._copies.add(self._index, self._tail[self._tail_at:self._tail_at + k])
            self._tail_at, done = self._tail_at + k, done + k
        if self._tail_at == self._tail_n:  # empty: give the buffer back
            self._tail, self._tail_at, self._tail_n = np.zeros((0, self.dim), dtype=np.float32), 0, 0
            self._groups = []
        return done

    def tail_groups(self) -> np.ndarray:
        """int64[G]: where each deferred write's vectors start in :meth:`tail` (0 for the oldest, even when part of it
        is in the graph already: its pieces continue from where that write's started; a snapshot keeps them)."""
        at = int(self._index.ntotal) if self._index is not None else 0
        return np.maximum(np.asarray(self._groups, np.int64) - at, 0) if self.pending else np.zeros(0, np.int64)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """float32[M, D]: HNSW's vectors of ANN ids int64[M], in the graph or deferred (a copy)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.pending:
            return self.storage()[ids]
        n = int(self._index.ntotal)
        out = np.empty((ids.size, self.dim), dtype=np.float32)
        old = ids < n
        if old.any():
            out[old] = self.storage()[ids[old]]
        out[~old] = self._tail_rows()[ids[~old] - n]
        return out

    def locked_gather(self, ids: np.ndarray) -> np.ndarray:
        """(A build's thread) :meth:`gather` under the structure's lock."""
        with self._mut:
            return self.gather(ids)

    def locked_ids_since(self, known: int) -> tuple[np.ndarray, int]:
        """(A build's thread) ``(live ANN ids >= known int64[M], ids held)`` under the structure's lock."""
        with self._mut:
            return np.flatnonzero(self.ann_slot[known:] >= 0).astype(np.int64) + known, int(self.ann_slot.size)

    def matvec(self, q: np.ndarray) -> np.ndarray:
        """float32[A]: inner products of one float32[D] query with every stored vector by ANN id
        (graph and deferred, dead ones included)."""
        out = self.storage() @ q
        return np.concatenate([out, self._tail_rows() @ q]) if self.pending else out

    def _append_ids(self, slots: np.ndarray) -> None:
        self.ann_slot = np.concatenate([self.ann_slot, np.asarray(slots, dtype=np.int64)])

    @locked
    def remove(self, slots: np.ndarray) -> None:
        """Mark the given slots dead (IVF: also drop them from the lists)."""
        ids = np.flatnonzero(np.isin(self.ann_slot, np.asarray(slots, dtype=np.int64)))
        if not ids.size:
            return
        self.ann_slot[ids] = -1
        self.dead += int(ids.size)
        if self.params.kind == "ivf" and self._index is not None:
            self._index.remove_ids(_faiss().IDSelectorBatch(ids))

    def nbytes(self) -> int:
        """Estimated bytes of the structure: HNSW ``n * (4*D + 4*(2*M + 1) + 12)`` (stored
        vectors; level-0 links 2M int32 plus the upper levels' ~M/(M-1) expected; offsets and
        levels), IVF ``n * (code + 8) + nlist * 4*D`` (list codes of ``code`` bytes, D with 8-bit
        codes, 4*D in an ``IndexIVFFlat`` loaded from an older snapshot, and ids; centroids); plus
        the 8-byte id map. From FAISS's ``IndexHNSWFlat`` / ``IndexIVFScalarQuantizer`` layouts."""
        n, d = (int(self._index.ntotal) if self._index is not None else 0), self.dim
        if self._index is None:
            body = 0
        elif self.params.kind == "hnsw":
            body = graph_bytes(n, self.params.hnsw_m, d)
        else:
            body = n * (int(self._index.code_size) + 8) + int(self._index.nlist) * 4 * d
        return body + int(self.ann_slot.nbytes) + (self._build.nbytes() if self._build is not None else 0)

    def needs_compaction(self) -> bool:
        """True once a quarter of an HNSW graph is dead (IVF removes at once: never)."""
        return self.params.kind == "hnsw" and self.dead * 4 > max(self.ann_slot.size, 1)

    @locked
    def rebuild(self, slots: np.ndarray, vectors) -> None:
        """A fresh structure over exactly these live vectors (compaction; IVF: retraining).

        :param vectors: float32[n, D], or any object whose slices ``vectors[a:b]`` give them
            (HNSW adds them in blocks of 65,536: a lazy gather from the old structure's storage
            then never holds a third full copy).
        """
        self.cancel_build()
        slots = np.asarray(slots, dtype=np.int64)
        self.ann_slot, self.dead, self._selector, self.laid_at = slots.copy(), 0, None, 0
        if self.params.kind == "hnsw":
            index, copies = self._new_hnsw(), Copies()  # the old one stays alive meanwhile: ``vectors`` may read it
            for a in range(0, slots.size, 65536):
                copies.add(index, vectors[a:a + 65536])
            self._index, self._copies = index, copies  # (the deferred rows were among ``vectors``)
            self._tail, self._tail_at, self._tail_n = np.zeros((0, self.dim), dtype=np.float32), 0, 0
            self._groups = []
            return
        vecs = np.ascontiguousarray(vectors, dtype=np.float32)
        if slots.size >= self.train_min:
            t0 = time.perf_counter()
            self._index, self.trained_at = new_ivf(self.dim, slots.size, vecs), int(slots.size)
            self._index.add_with_ids(vecs, np.arange(slots.size, dtype=np.int64))
            self.trainings.append((int(slots.size), int(self._index.nlist), time.perf_counter() - t0, None))
        else:
            self._index, self.trained_at = None, 0

    # ------------------------------------------------------------------ search
    @property
    def ready(self) -> bool:
        """False while an IVF is untrained (the caller searches exactly)."""
        return self._index is not None

    @property
    def nlist(self) -> int:
        """An IVF's inverted lists (``nprobe`` at this visits every one: an exhaustive search);
        0 for HNSW or an IVF not trained yet."""
        return int(self._index.nlist) if self.params.kind == "ivf" and self._index is not None else 0

    def search(self, q: np.ndarray, k: int, ef_search: int = 0, nprobe: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
        """Approximate top-k of float32[B, D] ``q`` among live vectors.

        :returns: ``(slots int64[B, k], scores float32[B, k], knob)``: slot -1 (score -inf)
            pads a row with fewer results; ``knob`` is the ef_search or nprobe used.
        """
        faiss = _faiss()
        if self.params.kind == "hnsw":
            knob = max(int(ef_search or self.params.ef_search), k)
            params = self._hnsw_params(knob)
        else:
            knob = min(int(nprobe or self.params.nprobe), self._index.nlist)
            params = faiss.SearchParametersIVF(nprobe=knob)
        q = np.ascontiguousarray(q, dtype=np.float32)
        if self.pending and not self._index.ntotal:
            scores, ids = np.full((q.shape[0], 0), -np.inf, np.float32), np.zeros((q.shape[0], 0), np.int64)
        else:  # (HNSW: a search that ran into a group of identical vectors searches again: ann_escape)
            scores, ids = self._index.search(q, int(k), params=params)
            if self.params.kind == "hnsw":
                scores, ids = escape(self._index, lambda i: self.ann_slot[i] >= 0, q, int(k), params, scores, ids)
        if self.pending:
            scores, ids = self._with_tail(q, int(k), scores, ids)
        scores, ids = self._copies.expand(scores, ids, self.ann_slot)  # (HNSW: each vector's copies)
        slots = np.where(ids >= 0, self.ann_slot[np.maximum(ids, 0)], -1)
        return slots, np.where(slots >= 0, scores, -np.inf).astype(np.float32), knob

    def _hnsw_params(self, ef: int):
        """FAISS HNSW search parameters: beam ``ef``, dead ids excluded."""
        faiss = _faiss()
        params = faiss.SearchParametersHNSW(efSearch=int(ef))
        if self.dead:
            if self._selector is None or self._selector[0] != (self.dead, self.ann_slot.size):
                dead_ids = self._copies.navigable(np.flatnonzero(self.ann_slot < 0).astype(np.int64), self.ann_slot)
                batch = faiss.IDSelectorBatch(dead_ids)
                self._selector = ((self.dead, self.ann_slot.size), faiss.IDSelectorNot(batch), batch)
            params.sel = self._selector[1]
        return params

    def _with_tail(self, q: np.ndarray, k: int, scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The graph's top-k ``(scores, ids)`` float32/int64[B, k'] merged with an exact scan of
        the live deferred rows: the best k of both, descending (-1 ids pad)."""
        n = int(self._index.ntotal)
        tail = self._tail_rows()
        t_scores = (q @ tail.T).astype(np.float32)  # [B, P]
        t_scores[:, self.ann_slot[n:] < 0] = -np.inf  # dead deferred rows
        kk = min(k, tail.shape[0])
        top = np.argpartition(-t_scores, kk - 1, axis=1)[:, :kk]
        all_s = np.concatenate([np.where(ids >= 0, scores, -np.inf), np.take_along_axis(t_scores, top, 1)], axis=1)
        all_i = np.concatenate([ids, top + n], axis=1)
        order = np.argsort(-all_s, axis=1, kind="stable")[:, :k]
        s, i = np.take_along_axis(all_s, order, 1), np.take_along_axis(all_i, order, 1)
        return s, np.where(np.isfinite(s), i, -1)

    # ------------------------------------------------------------------ storage (HNSW)
    def storage(self) -> np.ndarray:
        """float32[A, D]: HNSW's stored vectors by ANN id, a zero-copy view of FAISS's memory.

        Valid until the next :meth:`add`, :meth:`rebuild` or :meth:`load` (an add may move the
        buffer): take it anew for each use, never keep it. Read-only by contract.
        """
        if self.params.kind != "hnsw":
            raise ValueError("only an HNSW index stores its vectors by id")
        return hnsw_storage(self._index)

    def graph_nbytes(self) -> int:
        """Bytes of the structure besides the stored vectors (HNSW: links, offsets, levels,
        ``n * (4*(2*M + 1) + 12)``; IVF: all of :meth:`nbytes`) plus the 8-byte id map, and all of a compaction's
        graph being built (its vectors too)."""
        if self.params.kind == "hnsw":
            n = int(self._index.ntotal) if self._index is not None else 0
            extra = self._build.nbytes() if self._build is not None else 0
            return graph_bytes(n, self.params.hnsw_m) + int(self.ann_slot.nbytes) + extra
        return self.nbytes()
