"""The ``retrieve`` operator: broadcast a query batch to every shard, gather local top-N, reduce
to the global top-k, score BM25 with corpus-global statistics and fuse.

Modes (per query):

``hybrid`` (dense-first)
    every shard returns its dense top-N (N = ``candidates``) with exact BM25Okapi scores of
    those candidates; the frontend keeps the global dense top-N, min-max normalises dense and
    BM25 scores over that candidate set and ranks by the weighted sum.
``full_hybrid`` (exact)
    every chunk is scored dense and BM25 (postings lists: only chunks containing a query term
    are visited; the others score exactly 0). Round 1 gathers corpus-wide score ranges, round 2
    fuses with them on each shard and returns local top-k; the frontend merges.
``dense`` / ``lexical``
    one retriever; the other score is still reported for each hit.

Ranking ties are broken by ascending chunk id everywhere, so results are deterministic.
BM25 follows rank_bm25 0.2.2 ``BM25Okapi`` (idf with the epsilon floor, N, document
frequencies and average length over all shards).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import numpy as np

from ..config import BM25Config, RetrievalConfig
from ..index.analyzer import Analyzer
from ..index.bm25 import CorpusStats
from ..shards.pool import ShardPool
from .fusion import fuse_minmax, minmax_params, top_k_order

MODES = ("hybrid", "dense", "lexical", "full_hybrid")


@dataclass(frozen=True)
class RetrieveSpec:
    """What one query asks of the retrieve operator."""

    mode: str = "hybrid"
    top_k: int = 5
    candidates: int = 128
    dense_weight: float = 0.5
    lexical_weight: float = 0.5


@dataclass
class Hit:
    chunk_id: str
    doc_id: str
    title: str
    text: str
    score: float
    dense_score: float
    lexical_score: float
    shard: int
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class _Cand:
    shard: int
    slot: int
    chunk_id: str
    dense: float
    lexical: float
    score: float = 0.0


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
        self._tokens = itertools.count(1)

    async def retrieve(
        self, qvecs: np.ndarray, texts: list[str], specs: list[RetrieveSpec]
    ) -> tuple[list[list[Hit]], dict[str, float]]:
        """Retrieve for a batch of B queries.

        :param qvecs: float32[B, D] L2-normalised query vectors.
        :param texts: B query texts (analysed for BM25).
        :param specs: B per-query specs; queries sharing a mode are searched as one matrix.
        :returns: B ranked hit lists (at most ``top_k`` each; fewer when the corpus is smaller),
            and timings in seconds: ``retrieve`` (shard fan-out and gather, fetch of hit
            fields) and ``rerank`` (frontend BM25 statistics, global merge and fusion).
        """
        t_start = time.perf_counter()
        rerank = 0.0
        terms = [self.analyzer.tokens(t) for t in texts]
        idf = [self.stats.query_idf(t, self.bm25.epsilon) for t in terms]
        avgdl = self.stats.avgdl
        results: list[list[_Cand]] = [[] for _ in specs]
        by_mode: dict[str, list[int]] = {}
        for i, s in enumerate(specs):
            by_mode.setdefault(s.mode, []).append(i)
        for mode, idx in by_mode.items():
            q = np.ascontiguousarray(qvecs[idx], dtype=np.float32)
            common = {"q": q, "terms": [terms[i] for i in idx], "idf": [idf[i] for i in idx], "avgdl": avgdl,
                      "k1": self.bm25.k1, "b": self.bm25.b}
            if mode == "full_hybrid":
                merged, dt = await self._full(common, [specs[i] for i in idx])
                rerank += dt
            else:
                n = max(specs[i].candidates if mode == "hybrid" else specs[i].top_k for i in idx)
                replies = await self.pool.broadcast("search", {**common, "mode": mode, "n": n})
                t = time.perf_counter()
                merged = [self._merge(replies, j, specs[i]) for j, i in enumerate(idx)]
                rerank += time.perf_counter() - t
            for j, i in enumerate(idx):
                results[i] = merged[j]
        hits = await self._materialise(results)
        total = time.perf_counter() - t_start
        return hits, {"retrieve": total - rerank, "rerank": rerank}

    def _merge(self, replies: list[list[dict]], j: int, spec: RetrieveSpec) -> list[_Cand]:
        cands: list[_Cand] = []
        for shard, rep in enumerate(replies):
            r = rep[j]
            for s, cid, d, lx in zip(r["slots"].tolist(), r["chunk_ids"], r["dense"].tolist(), r["lexical"].tolist()):
                cands.append(_Cand(shard, s, cid, d, lx))
        if not cands:
            return []
        ids = [c.chunk_id for c in cands]
        if spec.mode == "lexical":
            scores = np.array([c.lexical for c in cands])
        elif spec.mode == "dense":
            scores = np.array([c.dense for c in cands])
        else:  # dense-first hybrid: global dense top-N, then fuse over that candidate set
            dense = np.array([c.dense for c in cands])
            keep = top_k_order(dense, ids, spec.candidates)
            cands = [cands[i] for i in keep]
            ids = [c.chunk_id for c in cands]
            dense = np.array([c.dense for c in cands])
            lex = np.array([c.lexical for c in cands])
            scores = fuse_minmax(
                dense,
                lex,
                dense_range=minmax_params(dense),
                lexical_range=minmax_params(lex),
                dense_weight=spec.dense_weight,
                lexical_weight=spec.lexical_weight,
            )
        order = top_k_order(scores, ids, spec.top_k)
        out = []
        for i in order:
            c = cands[i]
            c.score = float(scores[i])
            out.append(c)
        return out

    async def _full(self, common: dict, specs: list[RetrieveSpec]) -> tuple[list[list[_Cand]], float]:
        token = f"full-{next(self._tokens)}"
        r1 = await self.pool.broadcast("full1", {**common, "token": token})
        dranges, lranges = [], []
        for j in range(len(specs)):
            parts = [rep[j] for rep in r1 if rep[j]["n"] > 0]
            if not parts:
                dranges.append((0.0, 0.0))
                lranges.append((0.0, 0.0))
                continue
            dranges.append((min(p["dmin"] for p in parts), max(p["dmax"] for p in parts)))
            lranges.append((min(p["lmin"] for p in parts), max(p["lmax"] for p in parts)))
        k = max(s.top_k for s in specs)
        r2 = await self.pool.broadcast(
            "full2",
            {"token": token, "dense_range": dranges, "lexical_range": lranges, "k": k,
             "dense_weight": specs[0].dense_weight, "lexical_weight": specs[0].lexical_weight},
        )
        t = time.perf_counter()
        out = []
        for j, spec in enumerate(specs):
            cands = []
            for shard, rep in enumerate(r2):
                r = rep[j]
                for s, cid, d, lx, f in zip(r["slots"].tolist(), r["chunk_ids"], r["dense"].tolist(),
                                            r["lexical"].tolist(), r["fused"].tolist()):
                    cands.append(_Cand(shard, s, cid, d, lx, f))
            order = top_k_order(np.array([c.score for c in cands]), [c.chunk_id for c in cands], spec.top_k)
            out.append([cands[i] for i in order])
        return out, time.perf_counter() - t

    async def _materialise(self, results: list[list[_Cand]]) -> list[list[Hit]]:
        want: dict[int, list[int]] = {}
        for cands in results:
            for c in cands:
                want.setdefault(c.shard, []).append(c.slot)
        fetched: dict[tuple[int, int], dict | None] = {}
        if want:
            shards = sorted(want)
            replies = await asyncio.gather(*[self.pool.call(s, "fetch", {"slots": want[s]}) for s in shards])
            for s, rep in zip(shards, replies):
                for slot, rec in zip(want[s], rep):
                    fetched[(s, slot)] = rec
        out = []
        for cands in results:
            hits = []
            for c in cands:
                rec = fetched.get((c.shard, c.slot))
                if rec is None:
                    continue
                hits.append(
                    Hit(
                        chunk_id=c.chunk_id,
                        doc_id=rec["doc_id"],
                        title=rec["title"],
                        text=rec["text"],
                        score=c.score,
                        dense_score=c.dense,
                        lexical_score=c.lexical,
                        shard=c.shard,
                        metadata=json.loads(rec["metadata"]) if rec["metadata"] else {},
                    )
                )
            out.append(hits)
        return out
