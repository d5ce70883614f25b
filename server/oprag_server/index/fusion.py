"""Score fusion: weighted min-max normalisation and ranking with deterministic tie-breaks.

Min-max normalisation maps a score list to ``(s - min) / (max - min)``. A constant list
(``max == min``, including a list of one) carries no ranking information: every normalised
value is defined as 0.0, so that list contributes nothing to the fused score and no NaN or
division by zero can occur.

The lexical ranked list (its ranks feed RRF and ``lexical_rank``) holds every chunk whose
BM25 score is not 0, ranked by score whatever its sign (:func:`lexical_listed`). A score is
negative when a query term's idf is floored at ``epsilon * average_idf`` and that average is
negative (a term in more than half of a corpus of very common terms): such a chunk contains a
query term and still ranks, after every positive one. A chunk that contains no query term
scores exactly 0 and is not in the list; neither is one whose query terms all have idf exactly
0 (a term in exactly half the chunks), since BM25 scores it like a chunk without them.
"""

from __future__ import annotations

import heapq

from collections.abc import Callable

import numpy as np


def minmax_params(x: np.ndarray) -> tuple[float, float]:
    """(min, max) of a float array; (0.0, 0.0) for an empty one."""
    if x.size == 0:
        return 0.0, 0.0
    return float(np.min(x)), float(np.max(x))


def normalise(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """float64 ``(x - lo) / (hi - lo)``; all zeros when ``hi <= lo`` (constant list)."""
    x = np.asarray(x, dtype=np.float64)
    span = hi - lo
    if not span > 0.0:
        return np.zeros_like(x)
    return (x - lo) / span


def fuse_minmax(
    dense: np.ndarray,
    lexical: np.ndarray,
    *,
    dense_range: tuple[float, float],
    lexical_range: tuple[float, float],
    dense_weight: float,
    lexical_weight: float,
) -> np.ndarray:
    """Weighted sum of min-max normalised scores.

    :param dense: float[M] dense scores; :param lexical: float[M] BM25 scores.
    :param dense_range: (min, max) the dense scores are normalised with (over the candidate
        set in dense-first mode, over every chunk in exact mode).
    :returns: float64[M] fused scores in [0, dense_weight + lexical_weight].
    """
    return dense_weight * normalise(dense, *dense_range) + lexical_weight * normalise(lexical, *lexical_range)


def lexical_listed(lexical: np.ndarray) -> np.ndarray:
    """bool[M]: which BM25 scores (float[M]) enter the lexical ranked list: those != 0."""
    return np.asarray(lexical, dtype=np.float64) != 0.0


def lexical_span_bound(idf, k1: float) -> float:
    """``sum_t |idf_t| (k1 + 1)``: the width of an interval that holds every BM25Okapi score of a
    query with idf float[T] and 0 (rank_bm25's term ``idf tf (k1 + 1) / (tf + norm)`` lies between
    ``min(0, idf) (k1 + 1)`` and ``max(0, idf) (k1 + 1)``), so an upper bound of any BM25 span."""
    return float(np.abs(np.asarray(idf, np.float64)).sum()) * (float(k1) + 1.0)


def rank_order(scores: np.ndarray, chunk_ids, rows=None) -> list[int]:
    """Indices ordering ``scores`` descending, ties broken by ascending chunk id.

    :param chunk_ids: the ids (list, or anything indexable by int); with ``rows`` (int64[M]),
        element ``i`` of ``scores`` has id ``chunk_ids[rows[i]]``. Ids are read only for the
        elements in a run of equal scores: a stable argsort orders the rest, and each tied run
        is then sorted by id (the same order as one sort on (score desc, id asc)).
    """
    return _order(scores, chunk_ids if rows is None else _Take(chunk_ids, rows)).tolist()


def _ids_of(ids, idx: list[int]) -> list:
    """``[ids[i] for i in idx]`` in one numpy take where ``ids`` is an array or a chain of
    :class:`_Take` over one (a tied run of thousands of identical chunks: no per-id Python call)."""
    rows = np.asarray(idx, dtype=np.int64)
    base = ids
    while isinstance(base, _Take):
        rows, base = np.asarray(base.rows, dtype=np.int64)[rows], base.ids
    if isinstance(base, np.ndarray):
        return base[rows].tolist()
    return [ids[i] for i in idx]


def _order(scores, ids, limit: int | None = None) -> np.ndarray:
    """:func:`rank_order` as int64[M]; with ``limit`` only its first ``limit`` positions are
    ordered (ties past them are left as they are: :func:`top_k_order` keeps k)."""
    a = np.asarray(scores, dtype=np.float64)
    order = np.argsort(-a, kind="stable")
    ranked = a[order]
    tied = np.flatnonzero(ranked[1:] == ranked[:-1])
    nan = np.isnan(ranked).any()
    if not tied.size and not nan:
        return order  # no ties: the chunk id never decides
    if nan:
        s = a.tolist()
        return np.asarray(sorted(range(len(s)), key=lambda i: (-s[i], ids[i])), dtype=np.int64)
    out = order.tolist()
    start = np.ones(tied.size, bool)  # a tied run starts where the previous pair was not tied
    start[1:] = tied[1:] != tied[:-1] + 1
    end = np.ones(tied.size, bool)
    end[:-1] = start[1:]
    for s, e in zip(tied[start].tolist(), (tied[end] + 2).tolist()):
        if limit is not None and s >= limit:
            break  # (runs in position order: the rest lie past the limit)
        if e - s <= 32:  # (a short run: one id at a time, no array take)
            out[s:e] = sorted(out[s:e], key=ids.__getitem__)  # out[s:e] is ascending: stable as before
            continue
        run = out[s:e]
        key = _ids_of(ids, run).__getitem__
        if limit is not None and e > limit:  # the first limit - s of a long run, by id
            out[s:limit] = [run[j] for j in heapq.nsmallest(limit - s, range(e - s), key=key)]
        else:
            out[s:e] = [run[j] for j in sorted(range(e - s), key=key)]
    return np.asarray(out, dtype=np.int64)


class _Take:
    """``chunk_ids[rows[i]]`` without building the list."""

    __slots__ = ("ids", "rows")

    def __init__(self, ids, rows) -> None:
        self.ids, self.rows = ids, rows

    def __getitem__(self, i: int):
        return self.ids[int(self.rows[i])]

    def __len__(self) -> int:
        return len(self.rows)


def top_k_order(scores: np.ndarray, chunk_ids, k: int, rows=None) -> list[int]:
    """Top-k indices by (score desc, chunk id asc) using partial selection (argpartition),
    keeping every element tied with the k-th score so the tie-break stays exact (``rows``: as
    in :func:`rank_order`)."""
    if rows is not None:
        chunk_ids = _Take(chunk_ids, rows)
    n = len(chunk_ids)
    if k <= 0 or n == 0:
        return []
    scores = np.asarray(scores, dtype=np.float64)
    if n <= k:
        return _order(scores, chunk_ids).tolist()
    part = np.argpartition(-scores, k - 1)[:k]
    kth = scores[part].min()
    cand = np.nonzero(scores >= kth)[0]
    return cand[_order(scores[cand], _Take(chunk_ids, cand), k)[:k]].tolist()


def refine_top(approx: np.ndarray, err: float, exact: Callable[[np.ndarray], np.ndarray], chunk_ids, k: int,
               *, complete: bool = True, rank: Callable | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Top-k by *exact* score (desc, chunk id asc) computing the exact score of a shortlist only.

    :param approx: float[M] approximate scores, each within ``err`` of its exact score (a float,
        or float64[M]: one bound per element; then ``complete`` must be True, ValueError otherwise).
    :param exact: positions int64[S] -> float64[S] exact scores.
    :param chunk_ids: M chunk ids (list or object array) for the tie-break.
    :param rank: ``(exact float64[S], shortlist positions int64[S], k) -> order int64[k']``, :func:`top_k_order`'s
        order of the shortlist (a compiled one: ``kernels_refine.rank_top``); ``chunk_ids`` is then not read.
    :param complete: False when ``approx`` is only the top of a longer list (scores sorted
        descending, e.g. a FAISS top-n): None is then returned when an element outside it could
        still belong to the top-k (ask for more).
    :returns: ``(positions int64[k'], exact float64[k'])``, k' = min(k, M), ranked.

    Exact: with ``t`` the k-th largest approximate score, the k elements at or above ``t`` have
    exact scores >= ``t - err``, while any element with approximate score < ``t - 2 err`` has an
    exact score < ``t - err``: it cannot be in the top-k, so only the rest is scored exactly.
    Per-element bounds: the same argument with ``t - err`` replaced by the k-th largest lower
    bound ``approx_i - err_i``, and an element left out when ``approx_i + err_i`` is below it.
    """
    m = int(np.asarray(approx).size)
    kk = min(int(k), m)
    if kk <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    a = np.asarray(approx, dtype=np.float64)
    if np.ndim(err):  # per-element bounds: keep what can reach the k-th largest lower bound
        if not complete:
            raise ValueError("refine_top: per-element bounds need the complete list")
        e = np.asarray(err, dtype=np.float64)
        lam = float(np.partition(a - e, m - kk)[m - kk])
        short = np.flatnonzero(a + e >= lam)
    else:
        t = float(np.partition(a, m - kk)[m - kk])
        if not complete and not a[-1] < t - 2.0 * err:
            return None
        short = np.flatnonzero(a >= t - 2.0 * err)
    ex = np.asarray(exact(short), dtype=np.float64)
    if rank is not None:
        order = np.asarray(rank(ex, short, kk), dtype=np.int64)
    else:
        order = np.asarray(top_k_order(ex, _Take(chunk_ids, short), kk), dtype=np.int64)
    return short[order], ex[order]


def skyband(dense: np.ndarray, lexical: np.ndarray, k: int) -> np.ndarray:
    """:func:`skyband_reference`, compiled (:func:`.kernels.skyband`) when every score is finite.

    :param dense: float[M]; :param lexical: float[M]. :returns: int64 positions, ascending.
    """
    d = np.ascontiguousarray(dense, dtype=np.float64)
    lx = np.ascontiguousarray(lexical, dtype=np.float64)
    if d.shape != lx.shape or d.ndim != 1:
        return skyband_reference(d, lx, k)
    from . import kernels  # noqa: PLC0415 - numba only where a skyband is computed (shards)

    pos, finite = kernels.skyband(d, lx, int(k))
    return pos if finite else skyband_reference(d, lx, k)


def skyband_reference(dense: np.ndarray, lexical: np.ndarray, k: int, block: int = 512) -> np.ndarray:
    """Positions (ascending int64) of the candidates beaten on both scores by fewer than ``k``
    others: the only ones that can be in a top-k of any fusion that ranks a candidate above one
    it beats on both (the 2-D k-skyband; Papadias et al., "Progressive skyline computation in
    database systems", TODS 2005, section 6).

    ``q`` beats ``p`` when ``dense[q] > dense[p]`` and ``lexical[q] > lexical[p]`` with
    ``lexical[q] != 0`` (a chunk outside the lexical list never outranks a listed one in rank
    fusion, :func:`lexical_listed`). Weighted min-max with positive weights and RRF both rank
    such a ``q`` above ``p``; ties and zero weights are not covered (callers fetch what is
    missing). Pairwise comparisons among the listed chunks only (block rows at a time).
    """
    d = np.asarray(dense, dtype=np.float64)
    lx = np.asarray(lexical, dtype=np.float64)
    m = d.size
    if k <= 0:
        return np.zeros(0, np.int64)
    if m <= k:
        return np.arange(m, dtype=np.int64)
    listed = lx != 0.0
    keep = np.zeros(m, bool)
    # a chunk outside the list (BM25 0) is beaten by exactly the chunks with a higher dense
    # score and BM25 > 0: counted by binary search, no pairwise comparison
    above = np.sort(d[lx > 0.0])
    keep[~listed] = above.size - np.searchsorted(above, d[~listed], side="right") < k
    # a listed chunk can only be beaten by listed ones: pairwise among those
    rows = np.flatnonzero(listed)
    dl, ll = d[rows], lx[rows]
    for s in range(0, rows.size, block):
        e = min(rows.size, s + block)
        keep[rows[s:e]] = ((dl[None, :] > dl[s:e, None]) & (ll[None, :] > ll[s:e, None])).sum(axis=1) < k
    return np.flatnonzero(keep).astype(np.int64)
