"""HNSW searches that ran into a group of identical vectors (trial26): a second bottom-layer
search from entries outside the group. Since :mod:`.ann_copies` keeps copies out of the links,
only a graph built before it (read back from an older snapshot, until its next compaction) has
such groups; this covers its searches.

Why a group traps: FAISS builds an HNSW node's neighbour list from its nearest vectors, and
copies of one vector are each other's nearest (inner product 1 with each other, the largest
there is), so once a vector has more copies than a list has room (2M = 64 at the bottom layer
with M 32), the copies' lists hold only copies. A search whose greedy descent enters the group
(likely when the copies are many: the graph's entry point is often one of them) can never leave
it, whatever its ``ef_search``: trial26 found `DENSE` top-10s made only of 300 boilerplate
documents, Recall@10 0.87 over 33 queries (0.43 with 1,588 identical chunks of one document),
where the flat index gave 1.0.

The symptom is in the result: a group's copies score exactly alike (the same float32 inner
product), so a returned list that holds one score :data:`TIES` or more times ran into one. For
those queries only, :func:`escape` runs FAISS's bottom-layer search (``search_level_0``, every
entry in one queue) from the :data:`ENTRIES` best-scoring vectors of a fixed strided sample of
at most :data:`SAMPLE` live graph vectors, one per distinct score and none with a score the
result repeats (so no entry is inside the group it ran into), and merges both result lists by
score (an id once, its larger score; dead ids are excluded by the same selector). Other queries
pay one vectorised check of their returned scores (0 of 300 SciFact queries at 1M, shard 0 of
`bench.scale`'s corpus, fired it).

What it does not repair: linked copies also weaken the graph's links between the *other*
vectors while it is built, so with copies that outnumber the rest about 10:1 some of the other
vectors stay poorly linked (synthetic tests: 0.55-0.94 of the top-10 by score, 0.05-0.33
without this); nor does it return the tied copies with the lowest chunk ids. A compaction
(which re-adds the live vectors through :mod:`.ann_copies`) repairs both.
"""

from __future__ import annotations

import numpy as np

from .ann_copies import hnsw_storage

#: a returned list that holds one score this many times or more ran into a group of copies
TIES = 8
#: graph vectors sampled (strided over ANN ids) for the escape's entries, and entries taken
SAMPLE, ENTRIES = 1024, 32


def tied_rows(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """int64[R]: the rows of FAISS's ``(scores float32[B, k], ids int64[B, k])`` (each row sorted
    by score, -1 ids padding) in which one score occurs :data:`TIES` times or more."""
    if scores.shape[1] < TIES:
        return np.zeros(0, np.int64)
    eq = scores[:, 1:] == scores[:, :-1]
    if not eq.any():  # (the usual case: one comparison)
        return np.zeros(0, np.int64)
    valid = ids >= 0
    eq &= valid[:, 1:] & valid[:, :-1]
    runs = np.lib.stride_tricks.sliding_window_view(eq, TIES - 1, axis=1).all(axis=2).any(axis=1)
    return np.flatnonzero(runs)


def _entries(sc: np.ndarray, sample: np.ndarray, avoid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Up to :data:`ENTRIES` sampled ids ``(int32, their float32 scores)``, best first: one per
    distinct score, none with a score in ``avoid``, -1 padding."""
    vals, first = np.unique(sc, return_index=True)  # ascending
    keep = ~np.isin(vals, avoid)
    vals, first = vals[keep][::-1][:ENTRIES], first[keep][::-1][:ENTRIES]
    ent, dist = np.full(ENTRIES, -1, np.int32), np.zeros(ENTRIES, np.float32)
    ent[:first.size], dist[:first.size] = sample[first], vals
    return ent, dist


def escape(index, live_ids, q: np.ndarray, k: int, params,
           scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's HNSW result ``(scores float32[B, k], ids int64[B, k])`` for float32[B, D] ``q``,
    with the rows that ran into a group of copies (:func:`tied_rows`) searched again from
    entries outside it and merged (module docstring). ``index``: the ``IndexHNSWFlat`` (its
    stored vectors are read only when a row needs the second search); ``live_ids(ids) -> bool[...]``: which ids
    are live; ``params``: the first search's ``SearchParametersHNSW`` (beam, dead-id selector).
    :returns: the same shapes, each row sorted by score (-1 ids, -inf scores padding)."""
    rows = tied_rows(scores, ids)
    if not rows.size or not index.ntotal:
        return scores, ids
    storage = hnsw_storage(index)
    n = storage.shape[0]
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    sample = np.arange(0, n, max(1, -(-n // SAMPLE)), dtype=np.int64)
    sample = sample[live_ids(sample)]
    if not sample.size:
        return scores, ids
    qr = np.ascontiguousarray(q[rows], dtype=np.float32)
    sc = qr @ storage[sample].T
    ent = np.full((rows.size, ENTRIES), -1, np.int32)
    dist = np.zeros((rows.size, ENTRIES), np.float32)
    for r, j in enumerate(rows):
        got = scores[j][ids[j] >= 0]
        ent[r], dist[r] = _entries(sc[r], sample, np.unique(got[np.r_[got[1:] == got[:-1], False]]))
    out_d = np.full((rows.size, k), -np.inf, np.float32)
    out_i = np.full((rows.size, k), -1, np.int64)
    index.search_level_0(rows.size, faiss.swig_ptr(qr), k, faiss.swig_ptr(ent), faiss.swig_ptr(dist),
                         faiss.swig_ptr(out_d), faiss.swig_ptr(out_i), ENTRIES, 2, params)
    scores, ids = scores.copy(), ids.copy()
    for r, j in enumerate(rows):
        s = np.concatenate([np.where(ids[j] >= 0, scores[j], -np.inf), np.where(out_i[r] >= 0, out_d[r], -np.inf)])
        i = np.concatenate([ids[j], out_i[r]])
        order = np.argsort(-s, kind="stable")
        s, i = s[order], i[order]
        first = np.unique(np.where(i >= 0, i, -1 - np.arange(i.size)), return_index=True)[1]  # each id once (its best)
        first = np.sort(first)[:k]
        scores[j], ids[j] = -np.inf, -1
        scores[j][:first.size], ids[j][:first.size] = s[first], np.where(np.isfinite(s[first]), i[first], -1)
    return scores, ids
