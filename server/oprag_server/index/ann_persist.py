"""Saving and restoring :class:`.ann.AnnIndex`'s FAISS structure (a snapshot's ``dense.faiss``), with its id map
and HNSW's deferred vectors (:mod:`.ann`).

HNSW's stored vectors are saved beside the graph, in parts that a later write links while they hold the same rows
(:mod:`.ann_vectors`). A structure that has not changed since it was written to (or loaded from) a file is saved as
a hard link to that file (:meth:`AnnPersist.write`): a snapshot that only session turns caused (trial52 #4) wrote
every HNSW graph again, ~0.9 GB a 500K-vector shard. "Not changed" is read from :class:`ChangeLock`, the lock every
change of the structure holds (its count of acquisitions), with the FAISS object and its vector count as a second check.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from . import ann_vectors
from .ann_copies import Copies, hnsw_storage
from .bm25.files import Source, file_ids, link_same
from .ivf_build import locked


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


class ChangeLock:
    """A re-entrant lock that counts how often it was taken (:attr:`count`): ``AnnIndex._mut``, held by every change
    of the structure and by a background build's reads. An unchanged count means an unchanged structure; a read
    under the lock also moves it, which only costs a file written anew (:meth:`AnnPersist.write`)."""

    def __init__(self) -> None:
        self._lock, self.count = threading.RLock(), 0

    def __enter__(self) -> "ChangeLock":
        self._lock.acquire()
        self.count += 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class AnnPersist:
    """The persistence half of :class:`.ann.AnnIndex` (a mixin: it uses its ``_index``, ``_tail``, ``ann_slot``,
    ``params``, ``_mut`` (a :class:`ChangeLock`) and the rest :meth:`load` sets)."""

    #: ``(mark, file name, its directory's :data:`.bm25.files.Source`)``: the file the structure was last written to
    #: or loaded from and its :meth:`_mark` then (None: none; a Source of None: the file could not be read)
    _saved: tuple[tuple, str, Source | None] | None = None
    #: HNSW: the parts list and files of that file's stored vectors (:mod:`.ann_vectors`; None: none)
    _parts = None

    def _mark(self) -> tuple:
        """What must be unchanged for the structure to be the one in its saved file: the count of changes (the
        lock's), the FAISS object and its vector count."""
        return self._mut.count, id(self._index), int(self._index.ntotal) if self._index is not None else 0

    def _note_saved(self, path, mark: tuple) -> None:
        p = Path(path)
        self._saved = (mark, p.name, file_ids(p.parent, [p.name]))
        self._parts = ann_vectors.note(p)

    def to_bytes(self) -> bytes:
        """The FAISS structure (``faiss.serialize_index``); empty while an IVF is untrained."""
        self.insert_pending()
        return b"" if self._index is None else _faiss().serialize_index(self._index).tobytes()

    def write(self, path) -> bool:
        """Write the FAISS structure to ``path`` (absent; not fsynced: :func:`.ann_vectors.files` lists what to sync);
        nothing is written while an IVF is untrained. Deferred vectors are not in it (:meth:`tail`). HNSW's stored
        vectors go to parts beside the graph, and the parts of the last write or load that still hold the same rows
        are linked (:mod:`.ann_vectors`). When the structure is unchanged since it was written to or loaded from a
        file that is still there (same device and inode), ``path`` becomes a hard link to that file instead (no
        file is ever written in place, so the two names keep the same bytes); a file system without hard links
        gets the file written. :returns: True when linked."""
        if self._index is None:
            return False
        mark, saved, path = self._mark(), self._saved, Path(path)
        graph = (saved[2], saved[1]) if saved is not None and saved[0] == mark and saved[2] is not None else None
        if hasattr(self._index, "hnsw") and (graph is None or self._parts is not None):  # (else: a file with them)
            linked = ann_vectors.write(self._index, path, hnsw_storage(self._index), self._parts, graph)
        else:
            ann_vectors.remove(path)
            path.unlink(missing_ok=True)  # (a name there may share its file with another: never truncated)
            linked = graph is not None and link_same(graph[0], graph[1], path)  # (link_same: False when gone,
            if not linked:                                                      # replaced or on another device)
                _faiss().write_index(self._index, str(path))
        self._note_saved(path, mark)  # (the mark from before the write: a change meanwhile shows)
        return linked

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
            index = ann_vectors.read(data)
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
        if isinstance(data, (str, os.PathLike)):  # read from this file: a later write may link it
            self._note_saved(data, self._mark())
        else:
            self._saved = self._parts = None

