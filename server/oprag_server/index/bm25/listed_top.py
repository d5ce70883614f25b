"""A shard's exact BM25 top-m over its allowed chunks (dense-first hybrid's BM25 list,
:meth:`oprag_server.shards.search.Searcher.search`): compiled (:func:`..kernels.bm25_listed_top`)
over the query terms' postings only (the CSR segment with its live mask, and the delta layers),
with the numpy path, :meth:`.postings.PostingsIndex.score_all`, as the reference it is tested
against (``tests/unit/test_kernels.py``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .merging import _SEG
from .okapi import check_avgdl, check_query
from .postings import PostingsIndex

_EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.float64), 0)


def listed_top(ix: PostingsIndex, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float, b: float,
               m: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The chunks that can be in the top-m by BM25 among the live ``allowed`` chunks (None: all)
    whose score is not 0 (:func:`..fusion.lexical_listed`), and how many of those there are.

    :param terms, idf, avgdl, k1, b: as :meth:`.postings.PostingsIndex.score_all` (whose values
        these are, bit for bit). :param m: >= 1. :param allowed: int64[A] ascending slots.
    :returns: ``(slots int64[C], scores float64[C], listed)``: every such chunk scoring at least
        the m-th largest score, in no particular order (C >= min(m, listed); the caller breaks
        ties by chunk id, :func:`..fusion.top_k_order`).
    :raises ValueError: ``len(idf) != len(terms)``; ``avgdl`` negative/NaN/inf; ``m`` < 1.
    """
    from .. import kernels  # noqa: PLC0415 - numba only in processes that score

    idf = check_query(terms, idf)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if not check_avgdl(avgdl) or not terms:
        return _EMPTY
    seg, seg_df, vocab = ix._seg, ix._seg_df, ix._seg.vocab  # noqa: SLF001 - the index's own package
    tids = np.array([-1 if t is None or not seg_df[t] else t for t in map(vocab.get, terms)], np.int64)
    d_slots, d_tf, d_off = [], [], [0]
    for t in terms:
        for layer, code in ix._delta_layers():  # noqa: SLF001
            a = layer.arrays(t, ix._where, code)  # noqa: SLF001
            if a is not None:
                d_slots.append(a[0])
                d_tf.append(a[1])
        d_off.append(sum(map(len, d_slots)))
    ds = np.concatenate(d_slots).astype(np.int64, copy=False) if d_slots else np.zeros(0, np.int64)
    dt = np.concatenate(d_tf).astype(np.float64, copy=False) if d_tf else np.zeros(0, np.float64)
    every = allowed is None
    al = np.zeros(0, np.int64) if every else np.ascontiguousarray(allowed, dtype=np.int64)
    return kernels.bm25_listed_top(ix._where, _SEG, ix._doc_len, tids, idf, seg.offsets, seg.slots, seg.tf,  # noqa: SLF001
                                   np.asarray(d_off, np.int64), ds, dt, al, every, int(m), float(avgdl),
                                   float(k1), float(b))


def listed_top_reference(ix: PostingsIndex, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float,
                         b: float, m: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`listed_top` in numpy (every listed allowed chunk, a superset of what it returns):
    :meth:`.postings.PostingsIndex.score_all`, then the listed and allowed ones."""
    slots, lex = ix.score_all(terms, idf, avgdl, k1, b)
    keep = lex != 0.0
    if allowed is not None:
        keep &= np.isin(slots, allowed)
    return slots[keep], lex[keep], int(np.count_nonzero(keep))
