"""Dense-first hybrid retrieval on the frontend: the union of the shards' candidate lists, the
threshold bound that certifies its top-k, and widening the lists until the bound holds.

The threshold algorithm (Fagin, Lotem and Naor, "Optimal aggregation algorithms for
middleware", PODS 2001) applied to two sorted lists per shard. Each shard sends (hybrid mode,
min-max fusion; :meth:`oprag_server.shards.search.Searcher.search`):

* its dense top-N (N = ``candidates``), canonical dense and exact BM25 scores, and
* its exact BM25 top-M (M = :func:`lexical_candidates`) among the eligible chunks whose BM25
  score is not 0, with their canonical dense scores, and how many such chunks it has.

The frontend fuses every chunk of the union with the weighted min-max sum. The fused score is
non-decreasing in both scores (weights >= 0, IEEE rounding is monotone), so a chunk of shard s
in neither of s's lists scores at most ``UB_s = w_d * norm(d_N(s)) + w_l * norm(l(s))`` where
``d_N(s)`` is s's N-th dense score and ``l(s)`` is 0 when s's BM25 list is complete (every
other chunk scores exactly 0) else ``max(l_M(s), 0)`` (the M-th BM25 score, or 0 for a chunk
with no query term). A shard whose dense list is complete has no chunk outside it. When the
k-th fused score of the union is strictly above ``max_s UB_s`` (or no shard has an outside
chunk), no chunk outside the union can enter the top-k nor tie into it: the top-k is
*certified* equal to fusing every chunk with the same ranges. Otherwise the uncertified
queries are asked again with N and M times :attr:`Widening.FACTOR` (at most
``RetrievalConfig.widen_rounds`` times; lists that reach every eligible chunk end it); a query
still uncertified keeps the last union's top-k and reports ``certified`` false.

Ranges (chosen to equal exact mode's): dense ``[min(union, each shard's minimum), union max]``
where a flat shard's minimum is exact over its eligible rows (so ranges, fused scores and the
certified top-k equal ``full_hybrid``'s bit for bit) and an HNSW / IVF shard's is estimated from
a fixed vector sample; BM25 ``[min, max]`` of the union and 0 when some eligible chunk has no
listed score, which is exact except for negative BM25 scores (negative idf floor) below a
truncated BM25 list. With HNSW / IVF the dense list is approximate, so the bound is a heuristic
there (an ANN miss above the N-th score is not covered). Rank fusion (rrf) and requests grouped
by document keep the dense window of N, fused over that window (no bound; rrf's analogue would be
``w_d / (k + N + 1) + w_l / (k + M + 1)`` with ranks over the whole lists, not built).

``dense_rank`` / ``lexical_rank`` keep their meaning: the rank in the top ``candidates`` of
the union by dense score, and among its listed BM25 scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import RetrievalConfig
from ..domain import RetrievalInfo, RetrieveSpec
from ..index.fusion import fuse_minmax, lexical_listed, top_k_order
from ..shards.protocol import Candidates, QueryBatch, SearchReply, SearchRequest


@dataclass
class _Cand:
    shard: int
    slot: int
    chunk_id: str
    dense: float
    lexical: float
    score: float = 0.0
    dense_rank: int = 0
    lexical_rank: int = 0


@dataclass
class _Cols:
    """Candidates of several shards as parallel arrays (no per-candidate Python objects)."""

    shard: np.ndarray
    slot: np.ndarray
    ids: np.ndarray  # object[M] of str
    dense: np.ndarray
    lexical: np.ndarray

    @classmethod
    def of(cls, parts: list[tuple[int, Candidates]]) -> "_Cols":
        if not parts:
            z = np.zeros(0)
            return cls(z.astype(np.int64), z.astype(np.int64), z.astype(object), z, z)
        return cls(
            np.concatenate([np.full(len(p.slots), s, dtype=np.int64) for s, p in parts]),
            np.concatenate([np.asarray(p.slots, dtype=np.int64) for _, p in parts]),
            np.concatenate([np.asarray(p.chunk_ids, dtype=object) for _, p in parts]),
            np.concatenate([np.asarray(p.dense, dtype=np.float64) for _, p in parts]),
            np.concatenate([np.asarray(p.lexical, dtype=np.float64) for _, p in parts]),
        )

    def take(self, idx) -> "_Cols":
        idx = np.asarray(idx, dtype=np.int64)
        return _Cols(self.shard[idx], self.slot[idx], self.ids[idx], self.dense[idx],
                     self.lexical[idx])

    def cand(self, i: int, score: float, dense_rank: int, lexical_rank: int) -> _Cand:
        return _Cand(int(self.shard[i]), int(self.slot[i]), self.ids[i], float(self.dense[i]), float(self.lexical[i]),
                     score, dense_rank, lexical_rank)


def _rank_lists(c: _Cols, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the top-n by dense, and of the top-n by BM25 among the listed (non-zero) BM25
    scores (:func:`~oprag_server.index.fusion.lexical_listed`)."""
    d = np.asarray(top_k_order(c.dense, c.ids, n), dtype=np.int64)
    pos = np.nonzero(lexical_listed(c.lexical))[0]
    lx = pos[top_k_order(c.lexical[pos], c.ids[pos], n)] if pos.size else pos
    return d, np.asarray(lx, dtype=np.int64)


def _ranks(n: int, order: np.ndarray) -> np.ndarray:
    """int64[n]: 1-based position of each row in ``order``, 0 for rows not in it."""
    r = np.zeros(n, dtype=np.int64)
    r[order] = np.arange(1, len(order) + 1)
    return r


def bounded(spec: RetrieveSpec) -> bool:
    """Whether a hybrid spec gets the BM25 lists and the bound: min-max fusion, not grouped by
    document (a grouped request's window is the N dense-first chunks, operators/group.py)."""
    return spec.fusion == "minmax" and not spec.group_by_document


def lexical_candidates(cfg: RetrievalConfig, spec: RetrieveSpec) -> int:
    """M, the BM25 list length per shard in the first round: ``cfg.lexical_candidates``, or
    when that is 0, ``max(4 * top_k, 64)``."""
    return cfg.lexical_candidates or max(4 * spec.top_k, 64)


def merge_union(replies: dict[int, SearchReply], j: int, spec: RetrieveSpec) -> tuple[list[_Cand], bool]:
    """Query ``j``'s fused top-k over the union of every shard's dense and BM25 lists, and
    whether the threshold bound certifies it (module docstring).

    The union holds, per shard in reply order, the dense list and then the BM25 list's chunks
    that are not in it (a shard's lists have distinct slots). ``dense_rank`` / ``lexical_rank``
    are computed for the k hits only (:func:`_hit_ranks`): the same positions as ordering the
    whole union (:func:`_rank_lists`), which a NaN score still does.

    :param replies: shard -> reply of a hybrid search with ``m`` > 0 (``lexical``, ``listed`` set).
    :returns: ``(top-k candidates, certified)``.
    """
    shard, slot, ids, dense, lexical = [], [], [], [], []
    bounds, unlisted, dmins = [], False, []
    for s, rep in replies.items():
        d, lx = rep.candidates[j], rep.lexical[j]
        eligible, listed = rep.eligible[j], rep.listed[j]
        ds = np.asarray(d.slots, dtype=np.int64)
        ls = np.asarray(lx.slots, dtype=np.int64)
        if ls.size:  # the BM25 list's chunks not in the dense list (a set: np.isin costs ~60 us here)
            seen = set(ds.tolist())
            extra = np.asarray([i for i, x in enumerate(ls.tolist()) if x not in seen], dtype=np.int64)
        else:
            extra = ls
        n_s = ds.size + extra.size
        shard.append(np.full(n_s, s, dtype=np.int64))
        slot += (ds, ls[extra])
        did = np.asarray(d.chunk_ids, dtype=object) if len(d.chunk_ids) else np.zeros(0, object)
        lid = np.asarray(lx.chunk_ids, dtype=object) if len(lx.chunk_ids) else np.zeros(0, object)
        ids += (did, lid[extra])
        dd, ld = np.asarray(d.dense, dtype=np.float64), np.asarray(lx.dense, dtype=np.float64)
        dl, ll = np.asarray(d.lexical, dtype=np.float64), np.asarray(lx.lexical, dtype=np.float64)
        dense += (dd, ld[extra])
        lexical += (dl, ll[extra])
        if eligible <= 0:
            continue
        dmins.append(rep.dense_min[j])
        unlisted |= listed < eligible  # some chunk scores BM25 exactly 0
        if ds.size >= eligible:  # the dense list is the whole shard
            continue
        if not ds.size:
            bounds.append((np.inf, np.inf))  # nothing to bound with (an ANN found nothing)
            continue
        lb = 0.0 if ls.size >= listed else max(float(ll.min()), 0.0)
        bounds.append((float(dd.min()), lb))
    u = _Cols(np.concatenate(shard), np.concatenate(slot), np.concatenate(ids), np.concatenate(dense),
              np.concatenate(lexical)) if shard else _Cols.of([])
    if not len(u.ids):
        return [], not bounds
    dr = (min(float(u.dense.min()), *dmins), float(u.dense.max()))
    lr = (min(float(u.lexical.min()), 0.0 if unlisted else np.inf), max(float(u.lexical.max()), 0.0 if unlisted else -np.inf))
    w = {"dense_range": dr, "lexical_range": lr, "dense_weight": spec.dense_weight,
         "lexical_weight": spec.lexical_weight}
    scores = fuse_minmax(u.dense, u.lexical, **w)
    top = top_k_order(scores, u.ids, spec.top_k)
    certified = True
    if bounds:
        b = np.asarray(bounds, dtype=np.float64)
        finite = np.isfinite(b).all()
        ub = float(fuse_minmax(b[:, 0], b[:, 1], **w).max()) if finite else np.inf
        certified = finite and len(top) >= spec.top_k and float(scores[top[-1]]) > ub
    if np.isnan(u.dense).any() or np.isnan(u.lexical).any():  # no total order: as before, by sorting
        d_order, l_order = _rank_lists(u, spec.candidates)
        drank, lrank = _ranks(len(u.ids), d_order), _ranks(len(u.ids), l_order)
        drank, lrank = drank[top], lrank[top]
    else:
        drank = _hit_ranks(u.dense, u.ids, top, spec.candidates, False)
        lrank = _hit_ranks(u.lexical, u.ids, top, spec.candidates, True)
    return [u.cand(i, float(scores[i]), int(dr_), int(lr_)) for i, dr_, lr_ in zip(top, drank.tolist(),
                                                                                    lrank.tolist())], certified


def _hit_ranks(vals: np.ndarray, ids: np.ndarray, rows: list[int], n: int, lexical: bool) -> np.ndarray:
    """int64[len(rows)]: the 1-based rank of each of ``rows`` in the top-n of float64[M] ``vals``
    ordered by (score desc, chunk id asc, position asc), 0 outside it; with ``lexical`` over the
    listed scores only (:func:`~oprag_server.index.fusion.lexical_listed`; 0 for a row not
    listed). The position of row r in :func:`_rank_lists`'s order is the number of elements
    ahead of it in that total order: the larger scores (listed ones for ``lexical``), plus the
    equal scores with a smaller id (or the same id earlier). Needs no NaN in ``vals``."""
    r = np.asarray(rows, dtype=np.int64)
    if not r.size:
        return np.zeros(0, np.int64)
    v = vals[r]
    gt = vals[None, :] > v[:, None]
    if lexical:
        gt &= (vals != 0.0)[None, :]
    ahead = gt.sum(axis=1)
    eq = vals[None, :] == v[:, None]
    tied = eq.sum(axis=1) > 1
    tied &= ahead < n
    if lexical:
        tied &= v != 0.0  # not listed: rank 0 whatever its ties
    for q in np.flatnonzero(tied).tolist():  # ties: by id, then position
        me, p = ids[r[q]], int(r[q])
        ahead[q] += sum(1 for t in np.flatnonzero(eq[q]).tolist() if ids[t] < me or (t < p and ids[t] == me))
    out = np.where(ahead < n, ahead + 1, 0)
    if lexical:
        out[v == 0.0] = 0
    return out.astype(np.int64)


class Widening:
    """The rounds of one dense-first query group: the first round's M, which queries the bound
    did not certify, and the next, wider request for those (module docstring)."""

    #: N and M grow by this factor per round
    FACTOR = 4

    def __init__(self, cfg: RetrievalConfig, specs: list[RetrieveSpec], bound: bool) -> None:
        """:param specs: the group's specs; :param bound: dense-first mode (else no BM25 lists)."""
        self.specs, self.cap = specs, cfg.widen_rounds
        self.m = max((lexical_candidates(cfg, s) for s in specs if bounded(s)), default=0) if bound else 0
        self.state: list[bool | None] = [None] * len(specs)
        self.rounds, self.round_of = 0, [0] * len(specs)

    def merge(self, merge_certified, replies: dict, jj: int, j: int) -> list:
        """Merge reply query ``jj`` as group query ``j`` with ``merge_certified`` (the
        retriever's: ``(replies, j, spec) -> (top-k, certified or None)``), recording whether
        it is certified; returns the top-k."""
        top, self.state[j] = merge_certified(replies, jj, self.specs[j])
        self.round_of[j] = self.rounds
        return top

    def next_round(self, req: SearchRequest) -> tuple[list[int], SearchRequest] | None:
        """The group queries to ask again and the request (N and M times ``FACTOR`` per round
        so far), or None: every query is certified or has no bound, or the rounds are spent."""
        todo = [j for j, c in enumerate(self.state) if c is False]
        if not todo or not self.m or self.rounds >= self.cap:
            return None
        self.rounds += 1
        f, b = self.FACTOR ** self.rounds, req.batch
        sub = QueryBatch(b.q[todo], [b.terms[i] for i in todo], [b.idf[i] for i in todo], b.avgdl, b.k1, b.b,
                         [b.filters[i] for i in todo] if b.filters else None)
        return todo, SearchRequest(sub, req.mode, req.n * f, req.ef_search, req.nprobe, req.fetch_k, self.m * f)

    def counts(self) -> tuple[int, int]:
        """``(widened, uncertified)``: queries asked again at least once; queries the bound
        never certified."""
        return sum(r > 0 for r in self.round_of), sum(c is False for c in self.state)

    def report(self, j: int, info: RetrievalInfo) -> None:
        """Set ``lexical_candidates``, ``certified`` and ``widen_rounds`` of group query ``j``."""
        if self.state[j] is not None:
            info.lexical_candidates = self.m * self.FACTOR ** self.round_of[j]
            info.certified, info.widen_rounds = bool(self.state[j]), self.round_of[j]
