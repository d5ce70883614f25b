"""The vectors of chosen slots out of an HNSW structure file (:meth:`.ann.AnnIndex.write`)."""

from __future__ import annotations

import numpy as np

from . import ann_vectors
from .ann_copies import hnsw_storage


def read_vectors(path, ann_slot: np.ndarray, slots: np.ndarray, tail: np.ndarray | None = None) -> np.ndarray:
    """float32[M, D]: the vectors of ``slots`` (int64[M], each live in ``ann_slot``) out of an
    HNSW structure file (:meth:`AnnIndex.write`) and its deferred rows ``tail`` (ANN ids after the
    file's): what a shard whose index kind changed needs from a snapshot written with HNSW,
    whose vectors are only there.

    :raises ValueError: not an HNSW file, or a slot not in ``ann_slot``.
    """
    index = ann_vectors.read(path)
    if not hasattr(index, "hnsw"):
        raise ValueError(f"{path}: not an HNSW structure")
    ann_slot = np.asarray(ann_slot, dtype=np.int64)
    live = np.flatnonzero(ann_slot >= 0)
    order = np.argsort(ann_slot[live], kind="stable")
    by_slot = ann_slot[live][order]
    slots = np.asarray(slots, dtype=np.int64)
    pos = np.clip(np.searchsorted(by_slot, slots), 0, max(by_slot.size - 1, 0))
    if slots.size and (not by_slot.size or (by_slot[pos] != slots).any()):
        raise ValueError(f"{path}: a slot has no vector in the structure")
    st = hnsw_storage(index)
    if tail is not None and len(tail):
        st = np.concatenate([st, np.asarray(tail, dtype=np.float32)])
    return st[live[order][pos]]  # a gather: a copy, made while the index is alive
