"""Approximate nearest-neighbour search for the dense side: FAISS HNSW or IVF over the same
L2-normalised float32 vectors as the exact copy in :class:`~oprag_server.index.dense.DenseIndex`
(inner product, ``METRIC_INNER_PRODUCT``).

The ANN structure only *picks candidates*; every score a shard returns is still canonical
(:func:`~oprag_server.index.dense.fixed_order_dot`), so identical content scores identically
whatever the index type, and exact mode (``full_hybrid``) never uses it.

Ids: each added vector gets the next *ANN id* (0, 1, 2, ... in insertion order);
``ann_slot[ann_id]`` is its chunk slot, or -1 once removed. Removal:

* HNSW cannot delete: a removed vector stays in the graph, marked dead, and every search
  excludes dead ids inside FAISS (``IDSelectorNot(IDSelectorBatch(dead))``), so a deleted chunk
  is never returned and a query still gets k live results. :meth:`AnnIndex.needs_compaction`
  is true once a quarter of the graph is dead; the owner then rebuilds it from the live vectors
  (:meth:`DenseIndex.compact_ann`: on snapshot, or on a write that crosses the threshold).
* IVF removes ids from its inverted lists at once.

IVF training: the first ``train_min`` vectors of a shard are searched exactly (flat) while
they accumulate; the IVF is then trained (k-means, ``nlist = sqrt(n)`` rounded to a power of
two, at most 65,536 and at most n / 39, on at most 64 vectors per list) on the vectors held at that moment. It is
trained again, and every vector re-added, each time the shard has grown 8x since the last
training (the lists stay balanced as the corpus grows), and on compaction.
"""

from __future__ import annotations

import numpy as np

from ..config import DenseConfig

def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


class AnnIndex:
    """HNSW or IVF over ANN ids (see the module docstring). Not thread-safe.

    :param dim: vector width D. :param params: :class:`DenseConfig` (kind ``hnsw`` or ``ivf``).
    """

    def __init__(self, dim: int, params: DenseConfig) -> None:
        if params.kind not in ("hnsw", "ivf"):
            raise ValueError(f"AnnIndex is for hnsw or ivf, not {params.kind!r}")
        self.dim, self.params = int(dim), params
        self.ann_slot = np.zeros(0, dtype=np.int64)  # ann id -> slot, -1 when dead
        self.dead = 0
        self.trained_at = 0  # vectors held when the IVF was last trained (0: not trained)
        self._index = None
        self._selector = None  # (dead count, selector) for HNSW searches
        if params.kind == "hnsw":
            self._index = self._new_hnsw()

    # ------------------------------------------------------------------ build
    def _new_hnsw(self):
        faiss = _faiss()
        idx = faiss.IndexHNSWFlat(self.dim, self.params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        idx.hnsw.efConstruction = self.params.ef_construction
        return idx

    def _new_ivf(self, train: np.ndarray):
        faiss = _faiss()
        n = train.shape[0]
        nlist = int(min(65536, max(16, 2 ** round(np.log2(np.sqrt(n))))))
        nlist = min(nlist, max(1, n // 39))  # FAISS asks for >= 39 training points per list
        quantizer = faiss.IndexFlatIP(self.dim)
        idx = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        step = max(1, n // (64 * nlist))
        idx.train(np.ascontiguousarray(train[::step]))
        self.trained_at = n
        return idx

    @property
    def live(self) -> int:
        return int(self.ann_slot.size - self.dead)

    def add(self, slots: np.ndarray, vectors: np.ndarray, all_live: tuple[np.ndarray, np.ndarray]) -> None:
        """Add float32[M, D] ``vectors`` of int64[M] ``slots``.

        :param all_live: ``(slots, vectors)`` of every live vector after this add (the IVF
            trains on them the first time and when it retrains).
        """
        if self.params.kind == "ivf":
            total = all_live[0].size
            if self._index is None and total < self.params.train_min:
                self._append_ids(slots)  # not trained yet: searched exactly by the caller
                return
            if self._index is None or total >= 8 * self.trained_at:
                self.rebuild(*all_live)
                return
        first = self.ann_slot.size
        self._append_ids(slots)
        ids = np.arange(first, first + slots.size, dtype=np.int64)
        if self.params.kind == "ivf":
            self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids)
        else:
            self._index.add(np.ascontiguousarray(vectors, dtype=np.float32))

    def _append_ids(self, slots: np.ndarray) -> None:
        self.ann_slot = np.concatenate([self.ann_slot, np.asarray(slots, dtype=np.int64)])

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
        levels), IVF ``n * (4*D + 8) + nlist * 4*D`` (list codes and ids, centroids); plus the
        8-byte id map. From FAISS's ``IndexHNSWFlat`` / ``IndexIVFFlat`` layouts."""
        n, d = (int(self._index.ntotal) if self._index is not None else 0), self.dim
        if self._index is None:
            body = 0
        elif self.params.kind == "hnsw":
            body = n * (4 * d + 4 * (2 * self.params.hnsw_m + 1) + 12)
        else:
            body = n * (4 * d + 8) + int(self._index.nlist) * 4 * d
        return body + int(self.ann_slot.nbytes)

    def needs_compaction(self) -> bool:
        """True once a quarter of an HNSW graph is dead (IVF removes at once: never)."""
        return self.params.kind == "hnsw" and self.dead * 4 > max(self.ann_slot.size, 1)

    def rebuild(self, slots: np.ndarray, vectors: np.ndarray) -> None:
        """A fresh structure over exactly these live vectors (compaction; IVF: retraining)."""
        slots = np.asarray(slots, dtype=np.int64)
        vecs = np.ascontiguousarray(vectors, dtype=np.float32)
        self.ann_slot, self.dead, self._selector = slots.copy(), 0, None
        if self.params.kind == "hnsw":
            self._index = self._new_hnsw()
            if slots.size:
                self._index.add(vecs)
        elif slots.size >= self.params.train_min:
            self._index = self._new_ivf(vecs)
            self._index.add_with_ids(vecs, np.arange(slots.size, dtype=np.int64))
        else:
            self._index, self.trained_at = None, 0

    # ------------------------------------------------------------------ search
    @property
    def ready(self) -> bool:
        """False while an IVF is untrained (the caller searches exactly)."""
        return self._index is not None

    def search(self, q: np.ndarray, k: int, ef_search: int = 0, nprobe: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
        """Approximate top-k of float32[B, D] ``q`` among live vectors.

        :returns: ``(slots int64[B, k], scores float32[B, k], knob)``: slot -1 (score -inf)
            pads a row with fewer results; ``knob`` is the ef_search or nprobe used.
        """
        faiss = _faiss()
        if self.params.kind == "hnsw":
            knob = max(int(ef_search or self.params.ef_search), k)
            params = faiss.SearchParametersHNSW(efSearch=knob)
            if self.dead:
                if self._selector is None or self._selector[0] != self.dead:
                    dead_ids = np.flatnonzero(self.ann_slot < 0).astype(np.int64)
                    batch = faiss.IDSelectorBatch(dead_ids)
                    self._selector = (self.dead, faiss.IDSelectorNot(batch), batch)
                params.sel = self._selector[1]
        else:
            knob = min(int(nprobe or self.params.nprobe), self._index.nlist)
            params = faiss.SearchParametersIVF(nprobe=knob)
        scores, ids = self._index.search(np.ascontiguousarray(q, dtype=np.float32), int(k), params=params)
        slots = np.where(ids >= 0, self.ann_slot[np.maximum(ids, 0)], -1)
        return slots, np.where(slots >= 0, scores, -np.inf).astype(np.float32), knob

    # ------------------------------------------------------------------ persistence
    def to_bytes(self) -> bytes:
        """The FAISS structure (``faiss.serialize_index``); empty while an IVF is untrained."""
        return b"" if self._index is None else _faiss().serialize_index(self._index).tobytes()

    def load(self, data: bytes, ann_slot: np.ndarray, trained_at: int) -> None:
        """Restore :meth:`to_bytes` output with its ``ann_slot`` map (slots already remapped)."""
        self._index = _faiss().deserialize_index(np.frombuffer(data, dtype=np.uint8)) if data else None
        self.ann_slot = np.asarray(ann_slot, dtype=np.int64).copy()
        self.dead = int((self.ann_slot < 0).sum())
        self.trained_at, self._selector = int(trained_at), None
        if self.params.kind == "hnsw" and self._index is None:
            self._index = self._new_hnsw()
