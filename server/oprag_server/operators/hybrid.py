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
with no query term). The BM25 list is ordered by (BM25 desc, dense desc, chunk id asc)
(:mod:`..index.lexical_list`): on an HNSW / IVF shard whose list's last BM25 score is shared by
unlisted chunks (``tied``), ``d_N(s)`` is raised to the last listed chunk's dense score, above
every unlisted member of that tie (which the approximate dense list need not hold: trial38b).
A shard whose dense list is complete has no chunk outside it. When the
k-th fused score of the union is strictly above ``max_s UB_s`` (or no shard has an outside
chunk), no chunk outside the union can enter the top-k nor tie into it: the top-k is
*certified* equal to fusing every chunk with the same ranges. Otherwise the uncertified
queries are asked again (at most ``RetrievalConfig.widen_rounds`` times; lists that reach every
eligible chunk end it), growing by :attr:`Widening.FACTOR` only the list whose side of the
bound failed (:func:`_sides`: the BM25 list alone when 0 in place of ``l(s)`` would pass and
the dense minimum in place of ``d_N(s)`` would not, or when either would, in the first round,
:data:`EITHER`; the dense list alone in the converse case; else both); a one-sided round's
lists are joined with the other list kept from the earlier round. A query still uncertified
keeps the last union's top-k and reports ``certified`` false; so does, at once, a query whose
bound fails only by a tie (the k-th fused score equal to the bound) in a round that changed
no hit of its top-k (:attr:`Widening.STOP_ON_TIE`: a tie group larger than the lists).

Ranges (chosen to equal exact mode's): dense ``[min(union, each shard's minimum), union max]``
where a flat shard's minimum is exact over its eligible rows (so ranges, fused scores and the
certified top-k equal ``full_hybrid``'s bit for bit) and an HNSW / IVF shard's is the lowest
score its index finds (:meth:`..shards.search.Searcher._ann_lows`: never below the exact one); BM25 ``[min, max]`` of the union and each shard's
``lexical_min`` (the lowest BM25 score of its eligible chunks, 0 for one with no query term, exact also
with negative scores: :meth:`..shards.exact.ExactMixin._lexical_min`). With HNSW / IVF the dense list is approximate, so the bound is a heuristic
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
from ..index import kernels_merge
from ..index.fusion import fuse_minmax, lexical_listed, top_k_order
from ..shards.protocol import Candidates, QueryBatch, SearchReply, SearchRequest
from .union import fuse_rank, union_cols
from .union_ids import _hit_ranks, _objects, _UnionIds  # noqa: F401 (re-exported)


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
    ids: np.ndarray  # object[M] of str (merge_union: a _UnionIds, read like one)
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
            np.concatenate([_objects(p.chunk_ids) for _, p in parts]),
            np.concatenate([np.asarray(p.dense, dtype=np.float64) for _, p in parts]),
            np.concatenate([np.asarray(p.lexical, dtype=np.float64) for _, p in parts]),
        )

    def take(self, idx) -> "_Cols":
        idx = np.asarray(idx, dtype=np.int64)
        return _Cols(self.shard[idx], self.slot[idx], self.ids[idx], self.dense[idx], self.lexical[idx])

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
    """M, the BM25 list length per shard in the first round: ``cfg.lexical_candidates`` or (0) ``max(4 * top_k, 64)``."""
    return cfg.lexical_candidates or max(4 * spec.top_k, 64)


def exact_dense(kind: str, ann_check: int, shards: int, chunks: int) -> bool:
    """Whether the shards' dense lists are exact for a corpus of ``chunks`` live chunks: a ``flat`` index (``kind``),
    or HNSW / IVF with at most ``shards`` x ``ann_check`` chunks, where each shard ranks from its check sample holding
    every chunk (:mod:`..shards.ann_check`; routing spreads chunks unevenly, so a shard may hold a few more: this
    picks a first N, a cost, and the bound certifies or widens whatever it)."""
    return kind == "flat" or 0 < chunks <= ann_check * shards


def first_candidates(cfg: RetrievalConfig, mode: str, method: str, grouped: bool, top_k: int, exact: bool) -> int:
    """``candidates`` 0: min-max ``hybrid``, not grouped, ``exact`` dense lists (:func:`exact_dense`):
    ``max(hybrid_candidates, 4 * top_k)`` (the bound certifies whatever N, else widens; HNSW / IVF beams find
    ``ef_search`` rows whatever N, and at 1M N 64 widened 25% of SciFact queries); else ``candidates``."""
    if mode == "hybrid" and method == "minmax" and not grouped and cfg.hybrid_candidates and exact:
        return min(max(cfg.hybrid_candidates, 4 * top_k), cfg.max_candidates)
    return cfg.candidates


def merge_union(replies: dict[int, SearchReply], j: int, spec: RetrieveSpec) -> tuple[list[_Cand], bool, str]:
    """Query ``j``'s fused top-k over the union of every shard's dense and BM25 lists, whether
    the threshold bound certifies it (module docstring), and which lists to widen if not.

    The union holds, per shard in reply order, the dense list and then the BM25 list's chunks
    that are not in it (a shard's lists have distinct slots). ``dense_rank`` / ``lexical_rank``
    are computed for the k hits only (:func:`_hit_ranks`): the same positions as ordering the
    whole union (:func:`_rank_lists`), which a NaN score still does.

    :param replies: shard -> reply of a hybrid search with ``m`` > 0 (``lexical``, ``listed`` set).
    :returns: ``(top-k candidates, certified, sides, tie)``: ``sides`` (:func:`_sides`) is ``""``
        when certified, else ``"dense"``, ``"lexical"``, ``"either"`` or ``"both"``; ``tie``: not
        certified only because the k-th fused score *equals* the bound (:class:`Widening`).
    """
    reps = list(replies.items())
    if not reps:
        return [], True, "", False
    i8, f8 = np.int64, np.float64
    cd = [rep.candidates[j] for _, rep in reps]
    cl = [rep.lexical[j] for _, rep in reps]
    ls = tuple(np.ascontiguousarray(c.slots, dtype=i8) for c in cl)
    shard, slot, dense, lexical, extra, off, dmn, lmn, rng, exact = union_cols(
        np.asarray([s for s, _ in reps], dtype=i8), tuple(np.ascontiguousarray(c.slots, dtype=i8) for c in cd),
        tuple(np.ascontiguousarray(c.dense, dtype=f8) for c in cd),
        tuple(np.ascontiguousarray(c.lexical, dtype=f8) for c in cd), ls,
        tuple(np.ascontiguousarray(c.dense, dtype=f8) for c in cl),
        tuple(np.ascontiguousarray(c.lexical, dtype=f8) for c in cl))
    ids, bounds, unlisted, dmins, lmins = [], [], False, [], []
    off = off.tolist()
    for k, (s, rep) in enumerate(reps):
        ids += ((cd[k].chunk_ids, None), (cl[k].chunk_ids, extra[off[k]:off[k + 1]]))
        eligible, listed, nd, nl = rep.eligible[j], rep.listed[j], len(cd[k].slots), ls[k].size
        if eligible <= 0:
            continue
        dmins.append(rep.dense_min[j])
        unlisted |= listed < eligible  # some chunk scores BM25 exactly 0
        if rep.lexical_min is not None:  # (every eligible chunk may hold a query term: exact mode's minimum)
            lmins.append(float(rep.lexical_min[j]))
        if nd >= eligible:  # the dense list is the whole shard
            continue
        if not nd:
            bounds.append((np.inf, np.inf))  # nothing to bound with (an ANN found nothing)
            continue
        lb = 0.0 if nl >= listed else max(float(lmn[k]) if nl else float(np.asarray(cl[k].lexical).min()), 0.0)
        db = float(dmn[k])
        if rep.tied is not None and rep.tied[j] and nl and rep.dense_index != "flat":
            db = max(db, float(cl[k].dense[-1]))  # an unlisted chunk of the BM25 tie: at most the last one's dense
        bounds.append((db, lb))
    u = _Cols(shard, slot, _UnionIds(ids), dense, lexical)
    if not len(u.ids):
        return [], not bounds, "" if not bounds else "both", False
    rng = rng.tolist() if exact else [u.dense.min(), u.dense.max(), u.lexical.min(), u.lexical.max()]  # (numpy's)
    dr = (min(float(rng[0]), *dmins), float(rng[1]))
    lr = (min(float(rng[2]), 0.0 if unlisted else np.inf, *lmins), max(float(rng[3]), 0.0 if unlisted else -np.inf))
    w = {"dense_range": dr, "lexical_range": lr, "dense_weight": spec.dense_weight,
         "lexical_weight": spec.lexical_weight}
    bt = np.array([[d for d, _ in bounds], [lb for _, lb in bounds]], dtype=np.float64).reshape(2, -1)  # (rows: C order)
    # compiled: scores, top-k, (below) ranks and the bound ``ub`` (fuse_top's scores are fuse_minmax's bit for
    # bit); the numpy path with ids where ties or NaNs need it
    scores, top, strict, drank, ok_d, lrank, ok_l, ub, finite = fuse_rank(
        u.dense, u.lexical, float(dr[0]), float(dr[1]), float(lr[0]), float(lr[1]), float(spec.dense_weight),
        float(spec.lexical_weight), int(spec.top_k), int(spec.candidates), bt[0], bt[1])
    top = top.tolist() if strict else top_k_order(scores, u.ids, spec.top_k)
    certified, sides, tie = True, "", False
    if bounds:
        certified = finite and len(top) >= spec.top_k and float(scores[top[-1]]) > ub
        if not certified:
            sides = _sides(bt.T, float(scores[top[-1]]) if finite and len(top) >= spec.top_k else None, w)
            tie = finite and len(top) >= spec.top_k and float(scores[top[-1]]) == ub
    rows = np.asarray(top, dtype=np.int64)
    if not strict:  # (the kernel ranked the strict top-k only)
        drank, ok_d = kernels_merge.hit_ranks(u.dense, rows, int(spec.candidates), False)
        lrank, ok_l = kernels_merge.hit_ranks(u.lexical, rows, int(spec.candidates), True)
    if ok_d and ok_l:
        pass
    elif np.isnan(u.dense).any() or np.isnan(u.lexical).any():  # no total order: as before, by sorting
        d_order, l_order = _rank_lists(u, spec.candidates)
        drank, lrank = _ranks(len(u.ids), d_order), _ranks(len(u.ids), l_order)
        drank, lrank = drank[top], lrank[top]
    else:  # ties inside the rank window: by id, for the side whose ranks were not exact (at 1M most are BM25
        # ties of chunks with the same terms and length, the dense ranks exact: recomputing them cost ~40 us)
        if not ok_d:
            drank = _hit_ranks(u.dense, u.ids, top, spec.candidates, False)
        if not ok_l:
            lrank = _hit_ranks(u.lexical, u.ids, top, spec.candidates, True)
    cols = (u.shard[rows].tolist(), u.slot[rows].tolist(), [u.ids[i] for i in top], u.dense[rows].tolist(),
            u.lexical[rows].tolist(), scores[rows].tolist(), drank.tolist(), lrank.tolist())  # (u.cand's values)
    return [_Cand(*c) for c in zip(*cols)], certified, sides, tie


def _sides(b: np.ndarray, kth: float | None, w: dict) -> str:
    """Which lists an uncertified query widens, from the shards' bounds float64[S, 2] (N-th
    dense score, BM25 bound ``l``), the k-th fused score (None: fewer than k, or an infinite
    bound) and the fusion's ranges and weights ``w``. Widening the BM25 list alone can at best
    lower ``l`` to 0 (the list complete), the dense list alone its N-th score to the dense
    minimum (``w["dense_range"][0]``). ``"lexical"``: for every shard whose bound fails, 0 in
    place of its ``l`` would pass and its dense minimum in place of its N-th score would not;
    ``"dense"`` the converse; ``"either"`` when both would (:class:`Widening` grows
    :data:`EITHER` in a query's first widening round, both lists after); ``"both"`` when
    neither alone would (N and M grow together, as before this rule)."""
    if kth is None:
        return "both"
    fail = fuse_minmax(b[:, 0], b[:, 1], **w) >= kth
    d, lx = b[fail, 0], b[fail, 1]
    lex_ok = bool((fuse_minmax(d, np.zeros_like(lx), **w) < kth).all())
    dense_ok = bool((fuse_minmax(np.full_like(d, w["dense_range"][0]), lx, **w) < kth).all())
    if lex_ok and dense_ok:
        return "either"
    return "lexical" if lex_ok else "dense" if dense_ok else "both"


#: the list a query's first widening round grows when either alone could certify (``"both"``,
#: ``"lexical"`` or ``"dense"``; measured in bench/RESULTS.md, "one-sided widening")
EITHER = "lexical"


class Widening:
    """The rounds of one dense-first query group: the first round's M, which queries the bound
    did not certify, and the next, wider requests for those (module docstring).

    Only the lists the bound needs grow (:func:`_sides`): a query whose BM25 side failed asks
    the shards for the BM25 list alone (N = 0: no dense search), one whose dense side failed
    for the dense list alone (M = 0), and each round's lists are joined with the lists of the
    same query kept from the earlier rounds before the merge."""

    #: N and M grow by this factor per round
    FACTOR = 4

    #: A query whose bound fails only by a tie (the k-th fused score equals the bound: inside a
    #: group of chunks with equal scores, e.g. one boilerplate text in thousands of documents,
    #: larger than the lists) in a widening round that left its top-k unchanged stops widening:
    #: the lists break ties by dense score and chunk id, so a chunk outside them that ties the k-th hit comes
    #: after the chunks listed, and wider lists keep returning the same top-k (a 20,000-copy
    #: group widened 3 times for ~240-370 ms, bench/RESULTS.md, session 27). It stays uncertified.
    #: Not with dense weight 0: chunks with no query term then tie at 0 whatever their dense score (trial33).
    STOP_ON_TIE = True

    def __init__(self, cfg: RetrievalConfig, specs: list[RetrieveSpec], bound: bool) -> None:
        """:param specs: the group's specs; :param bound: dense-first mode (else no BM25 lists)."""
        self.specs, self.cap = specs, cfg.widen_rounds
        self.m = max((lexical_candidates(cfg, s) for s in specs if bounded(s)), default=0) if bound else 0
        self.own = [lexical_candidates(cfg, s) if bounded(s) else self.m for s in specs]  # each query's own M
        self.state: list[bool | None] = [None] * len(specs)
        self.sides = [""] * len(specs)
        self.rounds, self.round_of = 0, [0] * len(specs)
        self.nf, self.mf = [1] * len(specs), [1] * len(specs)  # N and M factors reached per query
        self.kept: list[dict | None] = [None] * len(specs)  # per query: shard -> (reply, index) of its lists
        self.last: list[list | None] = [None] * len(specs)  # per query: the last round's top-k
        self.stuck = [False] * len(specs)  # per query: a tie, and the round before's top-k (STOP_ON_TIE)
        self._asked: dict[int, tuple[bool, bool]] = {}  # query -> (dense, BM25) asked this time

    def merge(self, merge_certified, replies: dict, jj: int, j: int) -> list:
        """Merge reply query ``jj`` as group query ``j`` with ``merge_certified`` (the
        retriever's: ``(replies, j, spec) -> (top-k, certified or None[, sides])``), joined
        with the lists of the earlier rounds of ``j``; records whether it is certified and
        which sides to widen; returns the top-k."""
        if self.m:
            replies, jj = self._join(replies, jj, j)
        got = merge_certified(replies, jj, self.specs[j])
        top, self.state[j] = got[0], got[1]
        self.sides[j] = got[2] if len(got) > 2 else "both"
        last, self.last[j] = self.last[j], top
        self.stuck[j] = (self.STOP_ON_TIE and self.specs[j].dense_weight > 0 and len(got) > 3 and bool(got[3])
                         and last is not None and [(c.shard, c.slot) for c in top] == [(c.shard, c.slot) for c in last])
        return top

    def _join(self, replies: dict, jj: int, j: int) -> tuple[dict, int]:
        """``(replies, index)`` to merge for query ``j``: this round's as they are when both
        lists were asked, else per shard a one-query reply of this round's lists where asked
        and the kept ones elsewhere. Keeps the result's lists (references, no copies). A BM25
        list longer than the query's own M (times its factor: a query of a larger top_k in the
        same batch asked for more) is cut to it: a list ranked by score desc, then a fixed order,
        cut is the shorter list, so merge, bound and reply equal the query's alone (trial31; the
        order is (score desc, dense desc, chunk id asc) since trial38b, still prefix-closed)."""
        dense, lex = self._asked.pop(j, (True, True))
        kept, m = self.kept[j], self.own[j] * self.mf[j]
        if (dense and lex) or kept is None or any(s not in kept for s in replies):
            self.kept[j] = kept = {s: (rep, jj) for s, rep in replies.items()}
            if any(rep.lexical is None for rep in replies.values()) or \
                    all(len(rep.lexical[jj].slots) <= m for rep in replies.values()):
                return replies, jj
            dense = lex = True  # (every list this round's: one-query replies with the BM25 lists cut)
        out = {}
        for s, rep in replies.items():
            old, oj = kept[s]
            c = rep.candidates[jj] if dense else old.candidates[oj]
            src, k = (rep, jj) if lex else (old, oj)
            lx, n_l = src.lexical[k], src.listed[k]
            tied = [bool(src.tied[k])] if src.tied is not None else None
            if len(lx.slots) > m:
                tied = [bool(lx.lexical[m] == lx.lexical[m - 1])]  # (a prefix is the query's own list)
                lx = Candidates(lx.slots[:m], lx.chunk_ids[:m], lx.dense[:m], lx.lexical[:m])
            lmin = [src.lexical_min[k]] if src.lexical_min is not None else None
            dmin = min(rep.dense_min[jj], old.dense_min[oj])
            out[s] = SearchReply([c], [rep.eligible[jj]], [dmin], rep.dense_index, rep.knobs, None, [lx], [n_l], lmin,
                                 tied)
        self.kept[j] = {s: (rep, 0) for s, rep in out.items()}
        return out, 0

    def next_round(self, req: SearchRequest) -> tuple[list[int], SearchRequest] | None:
        """The group queries to ask again and the request, or None: every query is certified
        or has no bound, or its rounds are spent. Each query asks for N times its dense factor
        (0 when its dense list does not grow) and M times its BM25 factor (0 likewise), each
        factor ``FACTOR`` times the last when it grows; queries asking the same go together."""
        todo = [j for j, c in enumerate(self.state)
                if c is False and self.round_of[j] < self.cap and not self.stuck[j]] if self.m else []
        if not todo:
            return None
        want = {}
        for j in todo:
            side = self.sides[j] if self.sides[j] != "either" else EITHER if self.round_of[j] == 0 else "both"
            dense, lex = side in ("dense", "both"), side in ("lexical", "both")
            want[j] = (dense, lex, self.nf[j] * (self.FACTOR if dense else 1), self.mf[j] * (self.FACTOR if lex else 1))
        key = want[todo[0]]
        todo = [j for j in todo if want[j] == key]
        dense, lex, nf, mf = key
        for j in todo:
            self.nf[j], self.mf[j], self._asked[j] = nf, mf, (dense, lex)
            self.round_of[j] += 1
        self.rounds = max(self.rounds, max(self.round_of[j] for j in todo))
        b = req.batch
        sub = QueryBatch(b.q[todo], [b.terms[i] for i in todo], [b.idf[i] for i in todo], b.avgdl, b.k1, b.b,
                         [b.filters[i] for i in todo] if b.filters else None)
        return todo, SearchRequest(sub, req.mode, req.n * nf if dense else 0, req.ef_search, req.nprobe, req.fetch_k,
                                   self.m * mf if lex else 0)

    def counts(self) -> tuple[int, int]:
        """``(widened, uncertified)``: queries asked again at least once; queries the bound
        never certified."""
        return sum(r > 0 for r in self.round_of), sum(c is False for c in self.state)

    def report(self, j: int, info: RetrievalInfo) -> None:
        """Set ``lexical_candidates``, ``certified`` and ``widen_rounds`` of group query ``j``."""
        if self.state[j] is not None:
            info.lexical_candidates = self.own[j] * self.mf[j]
            info.certified, info.widen_rounds = bool(self.state[j]), self.round_of[j]
