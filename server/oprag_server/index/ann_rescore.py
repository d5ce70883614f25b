"""The float32 ranking of an IVF's candidates (:meth:`.dense.DenseIndex.search`): the lists hold
8-bit codes (:mod:`.ann`), which pick more candidates than asked; the dense index's own float32
copy of the vectors ranks them, so a search returns float32 inner products as with a flat index."""

from __future__ import annotations

from typing import Callable

import numpy as np


def rescored(vecs: np.ndarray, rows_of: Callable[[np.ndarray], np.ndarray], q: np.ndarray, slots: np.ndarray,
             k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of each row of int64[B, F] candidate ``slots`` (-1: none) by their float32
    inner product with float32[B, D] ``q``, read from float32[N, D] ``vecs`` at ``rows_of(slots)``
    (-1: absent, skipped), descending (ties: candidate order): ``(slots int64[B, k], scores
    float32[B, k])``, -1 / -inf padding a row with fewer."""
    ids = np.full((q.shape[0], k), -1, np.int64)
    scores = np.full((q.shape[0], k), -np.inf, np.float32)
    for i in range(q.shape[0]):
        s = slots[i][slots[i] >= 0]
        rows = rows_of(s)
        s, rows = s[rows >= 0], rows[rows >= 0]
        sc = vecs[rows] @ q[i]
        top = np.argsort(-sc, kind="stable")[:k]
        ids[i, :top.size], scores[i, :top.size] = s[top], sc[top]
    return ids, scores
