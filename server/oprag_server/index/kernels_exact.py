"""Compiled BM25 of a shard's every chunk for exact mode (``full_hybrid``,
:meth:`..shards.exact.ExactMixin._exact_scores`): the values of
:meth:`.bm25.postings.PostingsIndex.score_all` bit for bit, read at given slots, in one pass over
the query terms' postings into a per-slot accumulator (instead of numpy's per-term temporaries,
their accumulation and a sort of the slots into the dense index's row order). The numpy path
stays the reference it is tested against (``tests/unit/test_kernels_exact.py``)."""

from __future__ import annotations

import numpy as np
from numba import njit

from . import kernels  # noqa: F401 - sets numba's cache directory as the kernels do

_JIT = dict(cache=True, nogil=True)


@njit(**_JIT)
def bm25_at(where, seg_code, doc_len, tids, idf, offsets, pslots, ptf, d_off, d_slots, d_tf, at, avgdl, k1, b):
    """float64[A]: the BM25 score of each slot of int64[A] ``at`` (0.0 for a chunk holding no
    query term, or not live): per chunk one addition per query position ``i``, in query order,
    from 0.0, of ``idf[i] * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * doc_len / avgdl)))``, the
    operations of ``score_all``'s numpy expression (rank_bm25's ``get_scores`` values).

    :param tids: int64[T] segment term id per query position (-1: none); ``offsets`` int64[V+1],
        ``pslots`` int32[P], ``ptf`` uint16/uint32[P]: the CSR segment (a posting is live where
        ``where[slot] == seg_code``). :param d_off: int64[T+1], ``d_slots`` int64[Q], ``d_tf``
        float64[Q]: per query position the live postings of the delta layers (a chunk is in the
        segment or in one layer). Every slot is below ``doc_len.size``.
    """
    acc = np.zeros(doc_len.size, np.float64)
    one_b, k1p = 1.0 - b, k1 + 1.0
    for i in range(tids.size):
        w, t = idf[i], tids[i]
        if t >= 0:
            for p in range(offsets[t], offsets[t + 1]):
                x = np.int64(pslots[p])
                if where[x] == seg_code:
                    tf = np.float64(ptf[p])
                    acc[x] += w * (tf * k1p / (tf + k1 * (one_b + b * doc_len[x] / avgdl)))
        for p in range(d_off[i], d_off[i + 1]):
            x, tf = d_slots[p], d_tf[p]
            acc[x] += w * (tf * k1p / (tf + k1 * (one_b + b * doc_len[x] / avgdl)))
    out = np.empty(at.size, np.float64)
    for j in range(at.size):
        out[j] = acc[at[j]]
    return out
