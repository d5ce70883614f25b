"""Shard-side search over a :class:`~oprag_server.shards.chunks.ChunkStore`: candidate
generation (dense top-n with BM25 of those, or BM25 top-n), the exact hybrid rounds (every
eligible chunk scored; min-max in two rounds, rank lists in one) and fetching stored fields.

Scores are float64; ties are broken by ascending chunk id (see
:func:`oprag_server.index.fusion.top_k_order`). BM25 uses the corpus-global idf and average
length sent by the frontend.
"""

from __future__ import annotations

import numpy as np

from .. import records
from ..index.fusion import fuse_minmax, lexical_listed, top_k_order
from .chunks import ChunkStore
from .protocol import (Candidates, ExactFuseReply, ExactFuseRequest, ExactListsReply, ExactListsRequest,
                       ExactRangesReply, ExactRangesRequest, FetchReply, FetchRequest, QueryBatch, SearchReply,
                       SearchRequest)

_MAX_CACHED_ROUNDS = 64


class Searcher:
    """Read side of one shard. Holds the exact-mode round-1 scores until round 2."""

    #: vectors sampled (strided) to estimate the corpus-wide dense minimum
    SAMPLE = 512

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._rounds: dict[str, tuple[int, list[tuple]]] = {}

    # ------------------------------------------------------------------ candidates
    def search(self, req: SearchRequest) -> SearchReply:
        """Batched candidate generation for B queries (one FAISS call for the unfiltered ones).

        :raises ValueError: unknown mode, or query vectors of the wrong width.
        """
        st, qb = self.store, req.batch
        q = records.as_query_matrix(qb.q, st.dim)
        B, n = q.shape[0], int(req.n)
        allowed = [st.allowed(f) for f in (qb.filters or [None] * B)]
        eligible = [len(st.dense) if a is None else int(a.size) for a in allowed]
        cands: list[Candidates] = []
        if req.mode in ("hybrid", "dense"):
            dense_min = self._dense_min_estimate(q).tolist()
            plain = [i for i, a in enumerate(allowed) if a is None]
            faiss_res = {}
            if plain:
                ids, scores = st.dense.search(q[plain], n)
                faiss_res = {i: (ids[j], scores[j].astype(np.float64)) for j, i in enumerate(plain)}
            for i in range(B):
                slots, dense = faiss_res[i] if i in faiss_res else self._dense_top(q[i], n, allowed[i])
                lex = st.postings.score(slots, qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b)
                cands.append(Candidates(slots, st.ids(slots), dense, lex))
        elif req.mode == "lexical":
            dense_min = [np.inf] * B
            for i in range(B):
                slots, lex = st.postings.score_all(qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b)
                if allowed[i] is not None:
                    keep = np.isin(slots, allowed[i], assume_unique=True)
                    slots, lex = slots[keep], lex[keep]
                cids = st.ids(slots)
                order = top_k_order(lex, cids, n)
                slots = slots[order]
                dense = st.dense.score_slots(q[i], slots).astype(np.float64)
                cands.append(Candidates(slots, [cids[j] for j in order], dense, lex[order]))
        else:
            raise ValueError(f"unknown search mode {req.mode!r}")
        return SearchReply(cands, eligible, dense_min)

    def _dense_top(self, q: np.ndarray, n: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Top-n slots by inner product (FAISS, or exact numpy scoring of the allowed slots)."""
        dense = self.store.dense
        if allowed is None:
            ids, scores = dense.search(q[None, :], n)
            return ids[0], scores[0].astype(np.float64)
        if allowed.size == 0:
            return allowed, np.zeros(0, np.float64)
        sc = dense.score_slots(q, allowed).astype(np.float64)
        order = top_k_order(sc, allowed.tolist(), n)  # ties: lower slot first
        return allowed[order], sc[order]

    def _dense_min_estimate(self, q: np.ndarray) -> np.ndarray:
        """float64[B]: the lowest inner product of each query with a fixed strided sample of at
        most :attr:`SAMPLE` of this shard's vectors (all of them when the shard is smaller): a
        cheap estimate of the corpus-wide dense minimum that dense-first fusion normalises with."""
        dense = self.store.dense
        n = len(dense)
        if n == 0:
            return np.full(q.shape[0], np.inf)
        sample = dense.vectors[:: max(1, -(-n // self.SAMPLE))]
        return (q @ sample.T).min(axis=1).astype(np.float64)

    # ------------------------------------------------------------------ exact hybrid
    def _exact_scores(self, qb: QueryBatch) -> list[tuple]:
        """Every eligible chunk's dense and BM25 score, per query.

        :returns: per query ``(rows int64[M], dense float64[M], lexical float64[M])`` where
            rows index the dense index's row order (see :meth:`ChunkStore.row_ids`).
        """
        st = self.store
        q = records.as_query_matrix(qb.q, st.dim)
        filters = qb.filters or [None] * q.shape[0]
        row_slots = st.dense.slots
        order = np.argsort(row_slots, kind="stable")
        sorted_slots = row_slots[order]
        dense_all = st.dense.score_all(q)
        out = []
        for i in range(q.shape[0]):
            allowed = st.allowed(filters[i])
            lslots, lex = st.postings.score_all(qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b)
            lexical = np.zeros(len(row_slots), dtype=np.float64)
            if lslots.size:
                lexical[order[np.searchsorted(sorted_slots, lslots)]] = lex
            if allowed is None:
                rows = np.arange(len(row_slots), dtype=np.int64)
            else:
                rows = order[np.searchsorted(sorted_slots, allowed)] if allowed.size else np.zeros(0, np.int64)
            out.append((rows, dense_all[i][rows].astype(np.float64), lexical[rows]))
        return out

    def _lists(self, rows, d, lx, n: int) -> tuple[Candidates, Candidates]:
        """Local top-n by dense and top-n by BM25 (non-zero scores only: ``lexical_listed``), each
        entry with both scores."""
        ids = self.store.row_ids()[rows]
        od = np.asarray(top_k_order(d, ids, n), dtype=np.int64)
        pos = np.nonzero(lexical_listed(lx))[0]
        ol = np.asarray(pos[top_k_order(lx[pos], ids[pos], n)] if pos.size else pos, dtype=np.int64)
        slots = self.store.dense.slots
        return tuple(Candidates(slots[rows[o]], ids[o].tolist(), d[o], lx[o]) for o in (od, ol))  # type: ignore

    def exact_ranges(self, req: ExactRangesRequest) -> ExactRangesReply:
        """Exact hybrid, round 1: score every eligible chunk (dense: one matrix product; BM25:
        postings of the query terms only, every other chunk scores exactly 0), keep the arrays
        under ``token`` and return the local score ranges."""
        scores = self._exact_scores(req.batch)
        B = len(scores)
        eligible = [int(rows.size) for rows, _, _ in scores]
        ranges = np.zeros((4, B), dtype=np.float64)
        for i, (rows, d, lx) in enumerate(scores):
            if rows.size:
                ranges[:, i] = (d.min(), d.max(), lx.min(), lx.max())
        ranges = ranges.tolist()
        if len(self._rounds) > _MAX_CACHED_ROUNDS:
            self._rounds.clear()
        self._rounds[req.token] = (self.store.version, scores)
        return ExactRangesReply(eligible, ranges[0], ranges[1], ranges[2], ranges[3])

    def exact_fuse(self, req: ExactFuseRequest) -> ExactFuseReply:
        """Exact hybrid, round 2: fuse with the corpus-global ranges; return the local top-k by
        (fused desc, chunk id asc) and the local top-``n`` dense and BM25 lists (for ranks).

        :raises KeyError: no round 1 under ``token``. :raises RuntimeError: a write came between.
        """
        version, scores = self._rounds.pop(req.token)
        if version != self.store.version:
            raise RuntimeError("the index changed between the two rounds of an exact query")
        slots, row_ids = self.store.dense.slots, self.store.row_ids()
        top, dls, lls = [], [], []
        for i, (rows, d, lx) in enumerate(scores):
            fused = fuse_minmax(d, lx, dense_range=tuple(req.dense_range[i]), lexical_range=tuple(req.lexical_range[i]),
                                dense_weight=req.dense_weight[i], lexical_weight=req.lexical_weight[i])
            ids = row_ids[rows]
            order = np.asarray(top_k_order(fused, ids, int(req.k)), dtype=np.int64)
            top.append(Candidates(slots[rows[order]], ids[order].tolist(), d[order], lx[order], fused[order]))
            dl, ll = self._lists(rows, d, lx, int(req.n))
            dls.append(dl)
            lls.append(ll)
        return ExactFuseReply(top, dls, lls)

    def exact_lists(self, req: ExactListsRequest) -> ExactListsReply:
        """Exact retrieval for rank fusion: the local top-``n`` dense and BM25 lists over every
        eligible chunk, in one round."""
        scores = self._exact_scores(req.batch)
        lists = [self._lists(rows, d, lx, int(req.n)) for rows, d, lx in scores]
        return ExactListsReply([int(rows.size) for rows, _, _ in scores],
                               [dl for dl, _ in lists], [ll for _, ll in lists])

    # ------------------------------------------------------------------ fetch
    def fetch(self, req: FetchRequest) -> FetchReply:
        """Stored fields of the given slots (``found`` False for a slot deleted meanwhile)."""
        chunks = self.store.chunks
        recs = [chunks.get(int(s)) for s in req.slots]
        return FetchReply(
            found=[r is not None for r in recs],
            doc_ids=[r.doc_id if r else "" for r in recs],
            titles=[r.title if r else "" for r in recs],
            texts=[r.text if r else "" for r in recs],
            metadata=[r.metadata if r else "" for r in recs],
        )
