"""The ``retrieve`` operator: broadcast a query batch to every shard, gather local top-N, reduce
to the global top-k, score BM25 with corpus-global statistics and fuse.

Modes (per query):

``hybrid`` (dense-first)
    every shard returns its dense top-N (N = ``candidates``) with exact BM25Okapi scores of
    those candidates, and (min-max fusion) its exact BM25 top-M with the dense scores of those;
    the frontend fuses the union of the lists and certifies the top-k with the threshold bound
    of Fagin et al. (widening N and M until it holds: :mod:`.hybrid`). With rank
    fusion (rrf) it keeps the global dense top-N and fuses over that window.
``full_hybrid`` (exact)
    every chunk is scored dense and BM25 (postings lists: only chunks containing a query term
    are visited; the others score exactly 0). In one round each shard returns its score ranges,
    its rank lists and (min-max) every chunk that can be in the top-k whatever the corpus-wide
    ranges (:mod:`..index.kernels_band`); the frontend takes the global ranges and fuses those.
``dense`` / ``lexical``
    one retriever; the other score is still reported for each hit.

Ranking ties are broken by ascending chunk id everywhere, so results are deterministic.
BM25 follows rank_bm25 0.2.2 ``BM25Okapi`` (idf with the epsilon floor, N, document
frequencies and average length over all shards).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from ..config import BM25Config, RetrievalConfig
from ..domain import FUSED_MODES, MODES, Hit, RetrievalInfo, RetrieveSpec  # noqa: F401 (re-exported)
from ..index import kernels_merge
from ..index.analyzer import Analyzer
from ..index.bm25 import CorpusStats
from ..index.fusion import fuse_minmax, lexical_listed, minmax_params, top_k_order
from ..shards.packed import row_fields
from ..shards.pool import ShardError, ShardPool
from ..shards.protocol import (ExactListsRequest, ExactMinmaxRequest, FetchReply, FetchRequest, Op, QueryBatch,
                               SearchReply, SearchRequest)
from . import union
from .hybrid import _Cand, _Cols, _rank_lists, _ranks, _UnionIds, Widening, bounded, merge_union  # noqa: F401 (re-exported)

log = logging.getLogger("oprag")


def _fuse_cols(c: _Cols, d_order: np.ndarray, l_order: np.ndarray, spec: RetrieveSpec,
               dense_range=None, lexical_range=None) -> list[_Cand]:
    """Fuse every row of ``c`` given its dense and BM25 list orders; return the top-k."""
    if not len(c.ids):
        return []
    drank, lrank = _ranks(len(c.ids), d_order), _ranks(len(c.ids), l_order)
    if spec.fusion == "rrf":
        k = float(spec.rrf_k)
        scores = np.where(drank > 0, spec.dense_weight / (k + drank), 0.0) + \
            np.where(lrank > 0, spec.lexical_weight / (k + lrank), 0.0)
    else:
        scores = fuse_minmax(c.dense, c.lexical, dense_range=dense_range or minmax_params(c.dense),
                             lexical_range=lexical_range or minmax_params(c.lexical),
                             dense_weight=spec.dense_weight, lexical_weight=spec.lexical_weight)
    return [c.cand(i, float(scores[i]), int(drank[i]), int(lrank[i])) for i in top_k_order(scores, c.ids, spec.top_k)]


def _scores_ids(lists: list, side: str) -> tuple[np.ndarray, _UnionIds]:
    """float64[M] scores (``side``: ``"dense"`` or ``"lexical"``) of the shards' lists in order,
    and their chunk ids read on demand (:class:`.hybrid._UnionIds`: no object array built)."""
    sc = [np.asarray(getattr(c, side), dtype=np.float64) for c in lists]
    return (np.concatenate(sc) if sc else np.zeros(0)), _UnionIds([(c.chunk_ids, None) for c in lists])


def _rank_of(score: float, cid: str, scores: np.ndarray, ids: list[str], n: int, lexical: bool) -> int:
    """1-based rank of (score, cid) within the top-n of a (score desc, id asc) list; 0 outside
    (always 0 for a ``lexical`` score that is not listed: 0)."""
    if lexical and not lexical_listed(np.float64(score)):
        return 0
    better = int(np.count_nonzero(scores > score)) + sum(1 for i in np.nonzero(scores == score)[0].tolist()
                                                         if ids[i] < cid)
    return better + 1 if better < n else 0


#: most candidates (all shards) a one-retriever merge orders in Python (:func:`_merge_small`)
_SMALL = 64


def _merge_small(replies: dict, j: int, lexical: bool, k: int) -> list[_Cand] | None:
    """The one-retriever (dense or lexical mode) top-k of query ``j`` over every shard's few
    candidates, ordered by Python sorts instead of ~30 numpy calls on arrays of a few elements:
    the same order as :func:`top_k_order` (score desc, chunk id asc, position asc over the
    shards' lists in reply order) and the same ranks as :func:`_rank_lists` over the top-k.
    None when a score is NaN (no total order: the numpy path decides as before)."""
    sh, sl, ids, d, lx = [], [], [], [], []
    for s, rep in replies.items():
        c = rep.candidates[j]
        n = len(c.slots)
        sh += [s] * n
        sl += np.asarray(c.slots, dtype=np.int64).tolist()
        ids.extend(c.chunk_ids)
        d += np.asarray(c.dense, dtype=np.float64).tolist()
        lx += np.asarray(c.lexical, dtype=np.float64).tolist()
    if any(x != x for x in d) or any(x != x for x in lx):
        return None
    key = lx if lexical else d
    top = sorted(range(len(key)), key=lambda i: (-key[i], ids[i]))[:k]  # stable: position breaks id ties
    drank = {i: r for r, i in enumerate(sorted(top, key=lambda i: (-d[i], ids[i])), 1)}
    lrank = {i: r for r, i in enumerate(sorted((i for i in top if lx[i] != 0.0), key=lambda i: (-lx[i], ids[i])), 1)}
    return [_Cand(int(sh[i]), sl[i], ids[i], d[i], lx[i], key[i], drank[i], lrank.get(i, 0)) for i in top]


class _Carried:
    """The stored fields the shards' replies carried (``fields``: per query a :class:`FetchReply`
    with ``slots``), looked up by ``(shard, slot)`` when a hit needs them: no index is built over
    the ~40 carried per query and shard, of which a top-k uses a few."""

    __slots__ = ("by", "later")

    def __init__(self) -> None:
        self.by: dict[int, list[FetchReply]] = {}
        self.later: list = []  # (shard, awaitable FieldsReply): fields sent behind a reply (ShardPool.gather_partial)

    def add(self, replies: dict) -> None:
        for s, rep in replies.items():
            self._keep(s, getattr(rep, "fields", None))

    def _keep(self, shard: int, fields: list[FetchReply] | None) -> None:
        self.by.setdefault(shard, []).extend(f for f in fields or () if f.slots)

    async def arrived(self) -> None:
        """Add the fields of the FIELDS replies sent behind the search replies (a failed or empty
        one adds nothing: the hits it would have held are fetched)."""
        later, self.later = self.later, []
        for s, fut in later:
            try:
                rep = await fut
            except ShardError:
                continue
            self._keep(s, rep.fields)

    def get(self, key: tuple[int, int]) -> tuple[FetchReply, int] | None:
        """``(reply, position)`` of the fields of slot ``key[1]`` of shard ``key[0]``, or None."""
        for f in self.by.get(key[0], ()):
            try:
                return f, f.slots.index(key[1])
            except ValueError:
                continue
        return None


def _knobs(replies: dict) -> dict[str, int]:
    """The largest ef_search / nprobe any shard's candidate search used."""
    out: dict[str, int] = {}
    for rep in replies.values():
        for k, v in (getattr(rep, "knobs", None) or {}).items():
            out[k] = max(out.get(k, 0), int(v))
    return out


class Retriever:
    """Frontend half of retrieval. Callers hold the index read lock around :meth:`retrieve`."""

    def __init__(
        self,
        pool: ShardPool,
        stats: CorpusStats,
        analyzer: Analyzer,
        bm25: BM25Config,
        cfg: RetrievalConfig,
    ) -> None:
        self.pool = pool
        self.stats = stats
        self.analyzer = analyzer
        self.bm25 = bm25
        self.cfg = cfg
        self.dense_index = pool.dense.kind if getattr(pool, "dense", None) else "flat"
        #: called with (widened, uncertified) query counts of each dense-first batch (metrics)
        self.on_widen = None
        t = time.perf_counter()
        kernels_merge.warm()  # the compiled merge core (numba's cache), before the first query
        union.warm()
        log.info("frontend merge kernels ready in %.1f s (compiled, or loaded from numba's cache)", time.perf_counter() - t)

    @staticmethod
    def info(spec: RetrieveSpec, searched: int = 0) -> RetrievalInfo:
        fusion = spec.fusion if spec.mode in FUSED_MODES else "none"
        w = (spec.dense_weight, spec.lexical_weight) if fusion != "none" else (0.0, 0.0)  # (none ran: one list)
        return RetrievalInfo(spec.mode, "weighted_minmax" if fusion == "minmax" else fusion, *w,
                             spec.rrf_k if fusion == "rrf" else 0, spec.candidates, searched)

    async def retrieve(
        self, qvecs: np.ndarray, texts: list[str], specs: list[RetrieveSpec]
    ) -> tuple[list[list[Hit]], dict[str, float], list[RetrievalInfo]]:
        """Retrieve for a batch of B queries.

        :param qvecs: float32[B, D] L2-normalised query vectors.
        :param texts: B query texts (analysed for BM25).
        :param specs: B per-query specs; queries sharing a mode and fusion (HNSW / IVF: and knobs) are one matrix.
        :returns: B ranked hit lists (at most ``top_k`` each; fewer when fewer chunks are
            eligible), timings in seconds (``retrieve``: all of it; ``fusion``: the frontend part
            of it, BM25 statistics, global merge and fusion), and B
            :class:`RetrievalInfo`.
        """
        t_start = time.perf_counter()
        terms = [self.analyzer.tokens(t) for t in texts]
        idf = [self.stats.query_idf(t, self.bm25.epsilon) for t in terms]
        avgdl = self.stats.avgdl
        fusion_s = time.perf_counter() - t_start
        results: list[list[_Cand]] = [[] for _ in specs]
        infos = [self.info(s) for s in specs]
        fetched = _Carried()  # the fields the replies carried
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(specs):  # (HNSW / IVF find what their knobs and window let them: equal ones share a search)
            key = (s.mode, s.fusion) if s.mode == "full_hybrid" else (s.mode, "", s.ef_search, s.nprobe, s.candidates, s.top_k)
            groups.setdefault(key[:2] if self.dense_index == "flat" else key, []).append(i)
        for (mode, fusion, *_), idx in groups.items():
            q = np.ascontiguousarray(qvecs[idx], dtype=np.float32)
            batch = QueryBatch(q, [terms[i] for i in idx], [idf[i] for i in idx], avgdl, self.bm25.k1, self.bm25.b,
                               [list(specs[i].filters) for i in idx] if any(specs[i].filters for i in idx) else None)
            gspecs = [specs[i] for i in idx]
            if mode == "full_hybrid":
                merged, searched, dt, missing = await (self._full_rrf(batch, gspecs) if fusion == "rrf"
                                                       else self._full_minmax(batch, gspecs, fetched))
            else:
                n = max(sp.candidates if mode == "hybrid" else sp.top_k for sp in gspecs)
                wid = Widening(self.cfg, gspecs, mode == "hybrid")
                req = SearchRequest(batch, mode, n, max(sp.ef_search for sp in gspecs),
                                    max(sp.nprobe for sp in gspecs), max(sp.top_k for sp in gspecs), wid.m,
                                    [(sp.dense_weight, sp.lexical_weight) if wid.m and bounded(sp) else None
                                     for sp in gspecs] if mode == "hybrid" else None)
                replies, missing = await self.pool.gather_partial(Op.SEARCH, req, fields_into=fetched.later)
                t = time.perf_counter()
                fetched.add(replies)
                merged = [wid.merge(self._merge_certified, replies, j, j) for j in range(len(idx))]
                searched = [sum(rep.eligible[j] for rep in replies.values()) for j in range(len(idx))]
                dt = time.perf_counter() - t
                while (todo := wid.next_round(req)) is not None:  # the bound did not hold: ask again, wider
                    more, miss = await self.pool.gather_partial(Op.SEARCH, todo[1])
                    t = time.perf_counter()
                    fetched.add(more)
                    missing = sorted(set(missing) | set(miss))
                    for jj, j in enumerate(todo[0]):
                        merged[j] = wid.merge(self._merge_certified, more, jj, j)
                    dt += time.perf_counter() - t
                if wid.m and self.on_widen is not None:
                    self.on_widen(*wid.counts())
            fusion_s += dt
            knobs = _knobs(replies) if mode != "full_hybrid" else {}
            for j, i in enumerate(idx):
                results[i] = merged[j]
                if mode == "hybrid":
                    wid.report(j, infos[i])
                infos[i].chunks_searched = searched[j]
                infos[i].missing_shards = sorted(missing)
                infos[i].dense_index = self.dense_index
                infos[i].ef_search, infos[i].nprobe = knobs.get("ef_search", 0), knobs.get("nprobe", 0)
        await fetched.arrived()
        hits, lost = await self._materialise(results, fetched)
        for i, lost_i in enumerate(lost):
            if lost_i:
                infos[i].missing_shards = sorted(set(infos[i].missing_shards) | lost_i)
        return hits, {"retrieve": time.perf_counter() - t_start, "fusion": fusion_s}, infos

    def _merge(self, replies: dict[int, SearchReply], j: int, spec: RetrieveSpec) -> list[_Cand]:
        """Query ``j``'s top-k from the shards' search replies (no instance state is used)."""
        return Retriever._merge_certified(replies, j, spec)[0]

    @staticmethod
    def _merge_certified(replies: dict[int, SearchReply], j: int, spec: RetrieveSpec
                         ) -> tuple[list[_Cand], bool | None]:
        """:meth:`_merge`, and whether the threshold bound certifies the hybrid min-max top-k
        (None: no bound, another mode or fusion, or the shards sent no BM25 lists)."""
        if spec.mode == "hybrid" and bounded(spec) and all(rep.lexical for rep in replies.values()) and replies:
            return merge_union(replies, j, spec)
        if spec.mode == "hybrid":  # rrf: the global dense top-N, BM25 of those, fused
            allc = _Cols.of([(s, rep.candidates[j]) for s, rep in replies.items()])
            win = allc.take(top_k_order(allc.dense, allc.ids, spec.candidates))
            if not len(win.ids):  # (nothing eligible: an empty store, a filter that matches nothing)
                return [], None
            d_order, l_order = _rank_lists(win, spec.candidates)
            return _fuse_cols(win, d_order, l_order, spec, *Retriever._dense_first_ranges(replies, j, win)), None
        # one retriever: rank by its score; ranks in both lists are reported over the top-k
        if sum(len(rep.candidates[j].slots) for rep in replies.values()) <= _SMALL:
            top = _merge_small(replies, j, spec.mode == "lexical", spec.top_k)
            if top is not None:
                return top, None
        allc = _Cols.of([(s, rep.candidates[j]) for s, rep in replies.items()])
        key = allc.lexical if spec.mode == "lexical" else allc.dense
        top = allc.take(top_k_order(key, allc.ids, spec.top_k))
        d_order, l_order = _rank_lists(top, spec.top_k)
        drank, lrank = _ranks(len(top.ids), d_order), _ranks(len(top.ids), l_order)
        score = top.lexical if spec.mode == "lexical" else top.dense
        return [top.cand(i, float(score[i]), int(drank[i]), int(lrank[i])) for i in range(len(top.ids))], None

    @staticmethod
    def _dense_first_ranges(replies: dict[int, SearchReply], j: int, window: _Cols):
        """Normalisation ranges of dense-first fusion, chosen to agree with exact mode:
        dense ``[corpus minimum estimated from each shard's fixed vector sample, top score]``;
        BM25 ``[0, best candidate]`` (most chunks contain no query term, so the corpus minimum
        is 0), or the window's own range when the window is the whole eligible corpus."""
        est = [rep.dense_min[j] for rep in replies.values()]
        dmin = min([float(window.dense.min()), *est])
        whole = len(window.ids) >= sum(rep.eligible[j] for rep in replies.values())
        lmin = float(window.lexical.min()) if whole else min(0.0, float(window.lexical.min()))
        return (dmin, float(window.dense.max())), (lmin, float(window.lexical.max()))

    async def _full_minmax(self, batch: QueryBatch, specs: list[RetrieveSpec], fetched: _Carried):
        """Exact min-max hybrid in one round (``EXACT_MINMAX``): the corpus-wide ranges from the
        shards' local ones, then the top-k of the union of the shards' bands fused with them (it
        holds the global top-k: :mod:`..index.kernels_band`)."""
        req = ExactMinmaxRequest(batch, [s.top_k for s in specs], max(s.candidates for s in specs),
                                 [(s.dense_weight, s.lexical_weight) for s in specs])
        replies, missing = await self.pool.gather_partial(Op.EXACT_MINMAX, req)
        t = time.perf_counter()
        fetched.add(replies)
        out, searched = [], []
        for j, spec in enumerate(specs):
            parts = [rep for rep in replies.values() if rep.eligible[j] > 0]
            searched.append(sum(p.eligible[j] for p in parts))
            if not parts:
                out.append([])
                continue
            band = _Cols.of([(s, rep.band[j]) for s, rep in replies.items()])
            fused = fuse_minmax(band.dense, band.lexical,
                                dense_range=(min(p.dense_min[j] for p in parts), max(p.dense_max[j] for p in parts)),
                                lexical_range=(min(p.lexical_min[j] for p in parts),
                                               max(p.lexical_max[j] for p in parts)),
                                dense_weight=spec.dense_weight, lexical_weight=spec.lexical_weight)
            # the lists' scores only; their ids are read for ties with a hit (_rank_of)
            dls, lls = [rep.dense_lists[j] for rep in replies.values()], [rep.lexical_lists[j] for rep in replies.values()]
            d_sc, d_ids = _scores_ids(dls, "dense")
            l_sc, l_ids = _scores_ids(lls, "lexical")
            out.append([
                band.cand(i, float(fused[i]),
                          _rank_of(band.dense[i], band.ids[i], d_sc, d_ids, spec.candidates, False),
                          _rank_of(band.lexical[i], band.ids[i], l_sc, l_ids, spec.candidates, True))
                for i in top_k_order(fused, band.ids, spec.top_k)
            ])
        return out, searched, time.perf_counter() - t, missing

    async def _full_rrf(self, batch: QueryBatch, specs: list[RetrieveSpec]):
        n = max(s.candidates for s in specs)
        replies, missing = await self.pool.gather_partial(Op.EXACT_LISTS, ExactListsRequest(batch, n))
        t = time.perf_counter()
        out, searched = [], []
        for j, spec in enumerate(specs):
            searched.append(sum(rep.eligible[j] for rep in replies.values()))
            dl = _Cols.of([(s, rep.dense_lists[j]) for s, rep in replies.items()])
            ll = _Cols.of([(s, rep.lexical_lists[j]) for s, rep in replies.items()])
            dl = dl.take(top_k_order(dl.dense, dl.ids, spec.candidates))
            pos = np.nonzero(lexical_listed(ll.lexical))[0]
            ll = ll.take(pos[top_k_order(ll.lexical[pos], ll.ids[pos], spec.candidates)]
                         if pos.size else pos)
            both = _Cols(np.concatenate([dl.shard, ll.shard]), np.concatenate([dl.slot, ll.slot]), np.concatenate([dl.ids, ll.ids]),
                         np.concatenate([dl.dense, ll.dense]), np.concatenate([dl.lexical, ll.lexical]))
            first = {}
            for i, cid in enumerate(both.ids):
                first.setdefault(cid, i)
            rows = both.take(list(first.values()))
            at = {cid: i for i, cid in enumerate(rows.ids)}
            d_order = np.asarray([at[c] for c in dl.ids], dtype=np.int64)
            l_order = np.asarray([at[c] for c in ll.ids], dtype=np.int64)
            out.append(_fuse_cols(rows, d_order, l_order, spec))
        return out, searched, time.perf_counter() - t, missing

    async def _materialise(self, results: list[list[_Cand]], fetched: _Carried | None = None
                           ) -> tuple[list[list[Hit]], list[set[int]]]:
        """The stored fields of every hit: those the search replies carried (``fetched``), the
        rest fetched (one call per shard).
        :returns: hits and, per query, the shards whose hits could not be fetched (they died
        meanwhile)."""
        fetched = fetched or _Carried()
        flat = [c for cands in results for c in cands]
        at: list[tuple[FetchReply, int] | None] = [fetched.get((c.shard, c.slot)) for c in flat]
        todo = [i for i, a in enumerate(at) if a is None]
        failed: list[int] = []
        if todo:
            got, failed = await self.pool.scatter(
                Op.FETCH, todo, lambda i: flat[i].shard,
                lambda idx: FetchRequest([flat[i].slot for i in idx]))
            for idx, rep in got.values():
                for k, i in enumerate(idx):
                    at[todo[i]] = (rep, k)
        out, lost = [], []
        pos = 0
        for cands in results:
            hits, gone = [], set()
            for c in cands:
                where, pos = at[pos], pos + 1
                if where is None or not where[0].found[where[1]]:
                    if c.shard in failed:
                        gone.add(c.shard)
                    continue
                doc_id, title, text, meta = row_fields(*where)
                hits.append(Hit(chunk_id=c.chunk_id, doc_id=doc_id, title=title, text=text,
                                score=c.score, dense_score=c.dense, lexical_score=c.lexical, shard=c.shard,
                                metadata=json.loads(meta) if meta and meta != "{}" else {},
                                dense_rank=c.dense_rank, lexical_rank=c.lexical_rank))
            out.append(hits)
            lost.append(gone)
        return out, lost
