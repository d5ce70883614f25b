"""A shard's BM25 list for dense-first hybrid retrieval, ordered by (BM25 desc, canonical dense
desc, chunk id asc): the order in which a min-max fusion with a positive dense weight ranks chunks
of equal BM25, so that when the list's last BM25 score is shared by more chunks than the list
holds (a tie of thousands: a query term every chunk of a kind holds alike), the chunks of the tie
listed are the ones with the highest dense scores, not the first chunk ids.

Why (trial38b #1): an IVF shard's dense list misses low-scoring chunks far from the query (its
``nprobe`` lists hold none of them) and a list cut inside such a tie by chunk id held other members;
the exact top-10, members of the tie told apart only by their dense scores, sat in neither list and
the bound certified 5 of them. Listed by dense, an unlisted member of the tie scores at most the
last listed one's dense score, which the frontend's bound uses
(:func:`oprag_server.operators.hybrid.merge_union`), and a prefix of the list is the shorter list
of the same query (a longer list cut to a query's own M, :class:`..operators.hybrid.Widening`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


#: a tie at the cut this large is first screened by approximate scores (``approx_at``), then only the members that can
#: be among the best are scored canonically (~3 ms per 10K members a shard canonically)
SCREEN = 1024


def order_lexical_list(lex: np.ndarray, top: np.ndarray, dense_at: Callable[[np.ndarray], np.ndarray],
                       id_at: Callable[[int], str], approx_at=None) -> tuple[np.ndarray, np.ndarray, bool]:
    """The BM25 list of m chunks among C candidates.

    :param lex: float64[C] BM25 scores of every candidate scoring at least the m-th largest
        (:func:`.bm25.listed_top.listed_top`: ties at the m-th score all included).
    :param top: int64[m'] positions of the top-m by (score desc, chunk id asc)
        (:func:`.kernels_refine.rank_top`), m' = min(m, C).
    :param dense_at: positions int64[P] -> float64[P] canonical dense scores.
    :param id_at: position -> chunk id (read only to order chunks equal in both scores).
    :param approx_at: None, or positions int64[P] -> ``(float[P] approximate dense scores, bound)`` each within
        ``bound`` of its canonical score (or None: none to give): a tie of more than :data:`SCREEN` members is
        screened with it first (the argument of :func:`.fusion.refine_top`; the same list).
    :returns: ``(positions int64[m'], dense float64[m'], tied)``: the list ordered by (BM25 desc,
        dense desc, chunk id asc), its dense scores, and whether candidates beyond it share its
        last BM25 score (the list's last chunk then has the lowest dense score of the tie's listed
        members, and no unlisted member scores above it). NaN scores order last and never tie.
    """
    k = int(top.size)
    if not k:
        return top, np.zeros(0, np.float64), False
    cut = lex[top[-1]]
    in_list = lex[top] == cut
    tied = bool(lex.size > k and cut == cut and np.count_nonzero(lex == cut) > np.count_nonzero(in_list))
    pos = top
    if tied:  # the tie's members with the highest dense scores, ties by chunk id
        tie = np.flatnonzero(lex == cut)
        keep, need = top[~in_list], int(np.count_nonzero(in_list))
        got = approx_at(tie) if approx_at is not None and tie.size > SCREEN else None
        if got is not None:  # (outside the screen: canonical below the need-th best's, strictly)
            a, err = np.asarray(got[0], np.float64), float(got[1])
            tie = tie[a >= float(np.partition(a, a.size - need)[a.size - need]) - 2.0 * err]
        dt = np.asarray(dense_at(tie), np.float64)
        o = np.argsort(-dt, kind="stable")
        thr = dt[o[need - 1]]
        nan = thr != thr  # (NaN dense scores order last: every other member is chosen, then NaNs by id)
        sure, eq = (np.flatnonzero(dt == dt), np.flatnonzero(dt != dt)) if nan else \
            (np.flatnonzero(dt > thr), np.flatnonzero(dt == thr))  # (indices into tie)
        eq = np.asarray(sorted(eq.tolist(), key=lambda j: id_at(int(tie[j])))[: need - sure.size], np.int64)
        chosen = np.concatenate([sure, eq])
        pos = np.concatenate([keep, tie[chosen]])
        d = np.concatenate([np.asarray(dense_at(keep), np.float64), dt[chosen]])  # (the tie's: scored above)
    else:
        d = np.asarray(dense_at(pos), np.float64)
    ls = lex[pos]
    if not tied and not np.any(ls[1:] == ls[:-1]):  # no equal BM25: the (score desc, id asc) order stands
        return pos, d, False
    o = _order(ls, d, pos, id_at)
    return pos[o], d[o], tied


def _order(ls: np.ndarray, d: np.ndarray, pos: np.ndarray, id_at) -> np.ndarray:
    """Permutation of (BM25 desc, dense desc, chunk id asc); NaN last on either score."""
    kd, kl = np.nan_to_num(-d, nan=np.inf), np.nan_to_num(-ls, nan=np.inf)  # (NaN: inf, after -inf's max float)
    o = np.lexsort((kd, kl))
    a, b = kl[o], kd[o]
    same = np.flatnonzero((a[1:] == a[:-1]) & (b[1:] == b[:-1]))
    if not same.size:
        return o
    o = o.copy()
    i = 0
    while i < same.size:  # runs of chunks equal in both scores: by chunk id
        j = i
        while j + 1 < same.size and same[j + 1] == same[j] + 1:
            j += 1
        lo, hi = int(same[i]), int(same[j]) + 2
        o[lo:hi] = sorted(o[lo:hi].tolist(), key=lambda p: id_at(int(pos[p])))
        i = j + 1
    return o
