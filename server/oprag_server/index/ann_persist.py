"""Saving and restoring :class:`.ann.AnnIndex`'s FAISS structure (a snapshot's ``dense.faiss``), with its id map
and HNSW's deferred vectors (:mod:`.ann`)."""

from __future__ import annotations

import numpy as np

from .ann_copies import Copies
from .ivf_build import locked


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


class AnnPersist:
    """The persistence half of :class:`.ann.AnnIndex` (a mixin: it uses its ``_index``, ``_tail``, ``ann_slot``,
    ``params`` and the rest :meth:`load` sets)."""

    def to_bytes(self) -> bytes:
        """The FAISS structure (``faiss.serialize_index``); empty while an IVF is untrained."""
        self.insert_pending()
        return b"" if self._index is None else _faiss().serialize_index(self._index).tobytes()

    def write(self, path) -> None:
        """Write the FAISS structure (with HNSW's stored vectors) to ``path`` (not fsynced);
        nothing is written while an IVF is untrained. Deferred vectors are not in it (:meth:`tail`)."""
        if self._index is not None:
            _faiss().write_index(self._index, str(path))

    @locked
    def load(self, data, ann_slot: np.ndarray, trained_at: int, tail: np.ndarray | None = None,
             groups: np.ndarray | None = None) -> None:
        """Restore :meth:`to_bytes` output (``bytes``), a file :meth:`write` wrote (a path: read
        straight into FAISS's memory, no intermediate copy) or an index FAISS already read, with
        its ``ann_slot`` map (slots already remapped), and HNSW's deferred vectors float32[P, D]
        (``tail``: what :meth:`tail` held; their ANN ids follow the graph's), with where each write's vectors
        start in it (``groups``: :meth:`tail_groups`; None: one write).

        :raises ValueError: the structure's vector count plus the tail's differs from ``ann_slot``'s.
        """
        faiss = _faiss()
        self.cancel_build()
        if hasattr(data, "stat") and data.stat().st_size == 0:  # an untrained IVF's empty file
            data = b""
        if isinstance(data, (bytes, bytearray, memoryview)):
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8)) if len(data) else None
        elif data is None or hasattr(data, "ntotal"):
            index = data
        else:
            index = faiss.read_index(str(data))
        p = 0 if tail is None else int(tail.shape[0])
        if self.params.kind == "hnsw" and index is not None and int(index.ntotal) + p != int(np.asarray(ann_slot).size):
            raise ValueError(f"the saved structure holds {index.ntotal} vectors and {p} deferred ones, its id map "
                             f"{np.asarray(ann_slot).size}")
        self._index = index
        self._tail = np.zeros((0, self.dim), dtype=np.float32) if not p else np.asarray(tail, dtype=np.float32)
        self._tail_at, self._tail_n = 0, p
        at = int(index.ntotal) if index is not None else 0
        self._groups = [at + int(g) for g in (groups if groups is not None and len(groups) else [0])] if p else []
        self.ann_slot = np.asarray(ann_slot, dtype=np.int64).copy()
        self.dead = int((self.ann_slot < 0).sum())
        self.trained_at, self._selector = int(trained_at), None
        if self.params.kind == "hnsw" and self._index is None:
            self._index = self._new_hnsw()
        self._copies = Copies.of_index(self._index) if self.params.kind == "hnsw" else Copies()

