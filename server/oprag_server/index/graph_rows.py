"""HNSW rows of :class:`~oprag_server.index.dense.DenseIndex`: with HNSW the dense index keeps
no float32 copy of its own; its vectors are the ones ``IndexHNSWFlat`` stores for the graph, by
ANN id (dead ids included until compaction), read through a zero-copy view
(:meth:`.ann.AnnIndex.storage`). Row ``r`` of the dense index is the ``r``-th live ANN id in
ascending order, so rows stay positions in ``DenseIndex.slots`` order as for flat.

A snapshot load registers the chunks first (``add_pending``, or ``add(..., ann=False)`` when the
snapshot still carries vectors) and then adopts the saved graph with its storage
(``load_ann``), or builds one from the staged vectors (``compact_ann``): the vectors are never
held twice.
"""

from __future__ import annotations

import time

import numpy as np

from . import graph_layout


class GraphRows:
    """The HNSW half of :class:`~oprag_server.index.dense.DenseIndex` (a mixin: it uses the
    dense index's ``_ann``, ``_slot_row``, ``_n``, ``_version``, ``_max_norm``, ``_pending``,
    ``_live_cache``, ``_one`` and ``_grow_map``)."""

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        """HNSW: ``(ANN ids, slots)`` int64[n] of the live rows, in row order (ascending id)."""
        if self._pending is not None:
            self.compact_ann()
        if self._live_cache is None or self._live_cache[0] != self._version:
            ann = np.flatnonzero(self._ann.ann_slot >= 0)
            self._live_cache = (self._version, ann, self._ann.ann_slot[ann])
        return self._live_cache[1], self._live_cache[2]

    def row_view(self) -> np.ndarray | None:
        """float32[R, D]: a view holding every live row's vector (valid until the next add or remove, do not
        mutate): flat and IVF their float32 copy (row r at r), HNSW its graph's storage by ANN id (dead ids
        included: :meth:`view_rows` says where a row is); None with HNSW while vectors are deferred outside the
        graph."""
        if self._one:
            self._live()  # (a structure a load left pending: settled first, so the view stays valid)
            return None if self._ann.pending else self._ann.storage()
        return self.vectors

    def view_rows(self, rows: np.ndarray) -> np.ndarray:
        """int64[M]: where the rows int64[M] sit in :meth:`row_view` (HNSW: their ANN ids)."""
        return self._live()[0][rows] if self._one else rows

    def vectors_for(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(matrix float32[*, D], positions int64[M])`` with ``matrix[positions]`` the vectors of
        the rows int64[M]: :meth:`row_view` and :meth:`view_rows`, no copy; with HNSW while vectors are deferred,
        where a view would need a copy of every live vector (~0.8 GB a query at 500K a shard: the seconds-long
        queries during an ingest's catch-up, issue 13 settle11), only these rows, gathered."""
        m = self.row_view()
        if m is None:
            return self._ann.gather(self._live()[0][rows]), np.arange(rows.size, dtype=np.int64)
        return m, self.view_rows(rows)

    @property
    def pending(self) -> int:
        """HNSW vectors added with ``defer`` and not in the graph yet (0 for other kinds)."""
        return self._ann.pending if self._one else 0

    def insert_pending(self, n: int | None = None) -> int:
        """Insert the oldest ``n`` (None: all) deferred vectors into the HNSW graph.
        :returns: how many (0 when none wait or the index is not HNSW)."""
        if not self._one or self._pending is not None:
            return 0
        return self._ann.insert_pending(n)

    def deferred_groups(self) -> np.ndarray:
        """int64[G]: where each write's vectors start in :meth:`deferred_vectors` (:meth:`.ann.AnnIndex.tail_groups`;
        empty when none are deferred)."""
        if not self._one or self._pending is not None:
            return np.zeros(0, np.int64)
        return self._ann.tail_groups()

    def deferred_vectors(self) -> np.ndarray:
        """float32[P, D]: HNSW vectors added with ``defer`` and not in the graph yet, in ANN-id
        order after the graph's (what a snapshot saves beside the graph; empty otherwise; a view)."""
        if not self._one or self._pending is not None:
            return np.zeros((0, self.dim), np.float32)
        return self._ann.tail()

    def add_pending(self, slots: np.ndarray) -> None:
        """HNSW: register slots whose vectors come with the saved structure (:meth:`load_ann`);
        a snapshot written with HNSW keeps its vectors only there.

        :raises ValueError: not an HNSW index.
        """
        if not self._one:
            raise ValueError("only an HNSW index takes its vectors from its saved structure")
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size:
            self._grow_map(int(slots.max()) + 1)
        self._pending = (self._pending or []) + [(slots, None)]
        self._n += slots.size
        self._version += 1

    def _add_one(self, slots: np.ndarray, vecs: np.ndarray, ann: bool, defer: bool = False) -> None:
        """HNSW: append to the graph (its storage is the one copy), or stage until load_ann;
        ``defer``: to the graph's tail of deferred inserts (:mod:`.ann`), inserting the oldest
        at once past ``params.ann_tail`` waiting."""
        if self._ann.building:  # a background compaction is done: in place first (hnsw_build)
            self.install_ann()
        self._n += slots.size
        self._version += 1
        self._max_norm = max(self._max_norm, float(np.sqrt(np.einsum("ij,ij->i", vecs, vecs, dtype=np.float64).max())))
        if not ann or self._pending is not None:
            self._pending = (self._pending or []) + [(slots, vecs)]  # a view of the caller's rows
            return
        first = self._ann.ann_slot.size
        if defer:
            self._ann.defer(slots, vecs)
            self._ann.insert_pending(self._ann.pending - self.params.ann_tail)
        else:
            self._ann.add(slots, vecs, (slots, vecs))
        self._slot_row[slots] = np.arange(first, first + slots.size, dtype=np.int64)

    def _remove_one(self, slots: np.ndarray) -> int:
        """HNSW: mark live slots int64[M] dead in the graph (compacted past a quarter dead: in the background from
        :data:`.hnsw_build.BACKGROUND_MIN` live vectors, :mod:`.hnsw_build`)."""
        if self._ann.building:
            self.install_ann()
        self._ann.remove(slots)
        self._slot_row[slots] = -1
        self._n -= len(slots)
        self._version += 1
        if self._ann.needs_compaction() and not self._ann.compact_later():
            self._compact_logged(None)
        return len(slots)

    def compaction_due(self) -> bool:
        """HNSW: a quarter of the graph dead and no compaction under way: a graph loaded so from a snapshot (a
        restart cut its compaction short; the deletes that crossed the quarter are not repeated: trial50)."""
        return bool(self._one and self._ann is not None and self._ann.building is None and self._ann.needs_compaction())

    @property
    def rebuild_pending(self) -> int:
        """Live vectors a background HNSW compaction or IVF retraining is building a new structure of (installed
        between requests: until then a reply may still move slightly), or that a due compaction will
        (:meth:`compaction_due`); 0 when none (trial53 #6: ``Stats`` read settled while one ran)."""
        a = self._ann
        return a.live if a is not None and (a.building is not None or self.compaction_due()) else 0

    def compact_due(self) -> bool:
        """HNSW: start the compaction :meth:`compaction_due` finds (in the background from
        :data:`.hnsw_build.BACKGROUND_MIN` live vectors, else here). :returns: whether one was started or done."""
        if not self.compaction_due():
            return False
        from .hnsw_build import GraphBuild  # noqa: PLC0415

        if not self._ann.compact_later(GraphBuild.AT_START):
            self._compact_logged(GraphBuild.AT_START)
        return True

    def _compact_logged(self, how: str | None) -> None:
        """HNSW: :meth:`_compact_one` here, kept in the structure's ``compactions`` with ``how`` (None: the write that
        crossed a quarter dead waited for it), which the shard logs."""
        t, dead = time.perf_counter(), self._ann.dead
        self._compact_one()
        self._ann.compactions.append((len(self), dead, time.perf_counter() - t, how))

    def _compact_one(self) -> None:
        """HNSW: a new graph over the staged vectors (snapshot load) or the live stored ones,
        added a block at a time (the old graph's storage, read lazily, is the only other copy).

        :raises RuntimeError: staged slots whose vectors were to come with a saved graph.
        """
        if self._pending is not None:
            pend, self._pending = self._pending, None
            if any(v is None for _, v in pend):
                raise RuntimeError("the HNSW structure holding these vectors was not loaded: nothing to rebuild from")
            slots = np.concatenate([s for s, _ in pend]) if pend else np.zeros(0, np.int64)
            self._ann.rebuild(slots, _Chain([v for _, v in pend]))
        else:
            live = graph_layout.live_by_slot(self._ann.ann_slot)  # (slot order, whatever the ids')
            slots = self._ann.ann_slot[live]
            self._ann.rebuild(slots, _Rows(self._ann, live))
        self._slot_row[slots] = np.arange(slots.size, dtype=np.int64)
        self._version += 1

    def layout_due(self, seeds=None) -> bool:
        """HNSW: whether :meth:`lay_out_ann` would renumber the graph now (:func:`.graph_layout.due`)."""
        return self._one and self._pending is None and graph_layout.due(self._ann, seeds)

    def lay_out_ann(self, seeds=None, order: np.ndarray | None = None) -> bool:
        """HNSW: renumber the graph's nodes for locality when due (:func:`.graph_layout.lay_out`, with the dense
        minimum's ``seeds``; in ``order`` when given), and the rows with them (row order is ANN id order).
        :returns: whether it did."""
        if not self._one or self._pending is not None or graph_layout.lay_out(self._ann, seeds, order) is None:
            return False  # (lay_out checks that it is due, or free with an ``order``)
        self._rows_from_ids()
        self._live_cache = None
        self._version += 1
        return True

    def _rows_from_ids(self) -> None:
        """HNSW: each live slot's row is its ANN id again, after the graph's ids changed (a renumbering; a background
        compaction's install)."""
        live = np.flatnonzero(self._ann.ann_slot >= 0)
        self._slot_row[self._ann.ann_slot[live]] = live

    def _load_one(self, state: dict, ann_slot: np.ndarray) -> bool:
        """HNSW: adopt a saved graph (``state["faiss"]``, with its deferred vectors
        ``state["tail"]`` when it had some) whose live slots (``ann_slot``, already remapped) are
        exactly the staged ones; False (nothing changed) otherwise."""
        # the structure's storage becomes the one copy
        staged = np.sort(self.slots)
        live = np.flatnonzero(ann_slot >= 0)
        if not np.array_equal(np.sort(ann_slot[live]), staged):
            return False
        self._ann.load(state["faiss"], ann_slot, int(state.get("trained_at", 0)), state.get("tail"),
                       state.get("tail_groups"))
        self._ann.laid_at = int(state.get("laid_at", 0))
        self._pending = None
        self._slot_row[ann_slot[live]] = live
        for a in range(0, live.size, 65536):
            v = self._ann.gather(live[a:a + 65536])
            self._max_norm = max(self._max_norm, float(np.sqrt(np.einsum("ij,ij->i", v, v, dtype=np.float64).max())))
        self._version += 1
        return True


class _Rows:
    """``ann.gather(ids[a:b])`` on slicing: live rows (in the graph or deferred) gathered one
    block at a time."""

    def __init__(self, ann, ids: np.ndarray) -> None:
        self.ann, self.ids = ann, ids

    def __getitem__(self, sl: slice) -> np.ndarray:
        return self.ann.gather(self.ids[sl])


class _Chain:
    """Row slices across a list of float32[m_i, D] arrays, as if concatenated."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.starts = np.cumsum([0] + [p.shape[0] for p in parts])

    def __getitem__(self, sl: slice) -> np.ndarray:
        a, b = sl.start or 0, min(sl.stop, int(self.starts[-1]))
        got = [p[max(a - s, 0):b - s] for p, s in zip(self.parts, self.starts[:-1].tolist()) if s < b and s + p.shape[0] > a]
    
        return np.concatenate(got) if len(got) != 1 else got[0]
