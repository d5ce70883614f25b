"""Shard-side search over a :class:`~oprag_server.shards.chunks.ChunkStore`: candidate
generation (dense top-n with BM25 of those, or BM25 top-n), the exact hybrid rounds (every
eligible chunk scored; min-max in two rounds, rank lists in one) and fetching stored fields.

Scores are float64; ties are broken by ascending chunk id (see
:func:`oprag_server.index.fusion.top_k_order`). BM25 uses the corpus-global idf and average
length sent by the frontend.

Identical content, identical score: every dense score returned is canonical
(:func:`oprag_server.index.dense.fixed_order_dot`), whatever the batch, the shard, the filter
or the mode. The fast float32 scores (FAISS, BLAS) only pick the candidates: each top-n is
refined exactly (:func:`oprag_server.index.fusion.refine_top`), computing the canonical score
of the few candidates near the cut only, so a chunk left out can never outrank one kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .. import records
from ..index.fusion import fuse_minmax, lexical_listed, refine_top, skyband, top_k_order
from .chunks import ChunkStore
from .protocol import (Candidates, ExactFuseReply, ExactFuseRequest, ExactListsReply, ExactListsRequest,
                       ExactRangesReply, ExactRangesRequest, FetchReply, FetchRequest, QueryBatch, SearchReply,
                       SearchRequest)

_MAX_CACHED_ROUNDS = 64
_NO_ROWS = np.zeros(0, np.int64)


def _kernels():
    """:mod:`..index.kernels`, imported on first use: numba costs ~170 MB resident per process,
    and the frontend imports this module (the shard process entry point) without searching."""
    from ..index import kernels  # noqa: PLC0415

    return kernels


class Searcher:
    """Read side of one shard. Holds the exact-mode round-1 scores until round 2."""

    #: vectors sampled (strided) to estimate the corpus-wide dense minimum
    SAMPLE = 512

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._rounds: dict[str, tuple[int, list[tuple]]] = {}
        self._dmin: tuple[int, dict[bytes, float]] = (-1, {})  # (store version, query bytes -> estimate)

    # ------------------------------------------------------------------ candidates
    def search(self, req: SearchRequest) -> SearchReply:
        """Batched candidate generation for B queries (one FAISS call for the unfiltered ones).

        :raises ValueError: unknown mode, or query vectors of the wrong width.
        """
        st, qb = self.store, req.batch
        st.postings.poll_merge(raise_errors=False)  # install a finished background merge
        q = records.as_query_matrix(qb.q, st.dim)
        B, n = q.shape[0], int(req.n)
        allowed = [st.allowed(f) for f in (qb.filters or [None] * B)]
        eligible = [len(st.dense) if a is None else int(a.size) for a in allowed]
        cands: list[Candidates] = []
        if req.mode in ("hybrid", "dense"):
            st.dense.last_knobs = {}
            if st.dense.params.kind == "flat":  # compiled: every row scanned, the exact top-n
                tops = self._kernel_tops(q, allowed, n)
            else:
                plain = [i for i, a in enumerate(allowed) if a is None]
                faiss_res = self._dense_tops(q, plain, n, req.ef_search, req.nprobe) if plain else {}
                tops = [faiss_res[i] if i in faiss_res else self._dense_top(q[i], n, allowed[i]) for i in range(B)]
            dense_min = self._dense_min_estimate(q).tolist()
            for i in range(B):
                slots, dense = tops[i]
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
                dense = self._canonical(q[i], st.dense.rows(slots))
                cands.append(Candidates(slots, [cids[j] for j in order], dense, lex[order]))
        else:
            raise ValueError(f"unknown search mode {req.mode!r}")
        fields = None
        if req.fetch_k > 0:  # the hits' fields now, so that no FETCH round trip follows
            k = int(req.fetch_k)
            # one score ranks (candidates come ranked by it): its top-k; hybrid: the k-skyband
            fields = [self._fields(c.slots[:k] if req.mode != "hybrid" else c.slots[skyband(c.dense, c.lexical, k)])
                      for c in cands]
        return SearchReply(cands, eligible, dense_min, st.dense.params.kind, st.dense.last_knobs or None, fields)

    def warm(self) -> float:
        """Compile (or load from numba's cache) the kernels of the candidate step for this
        shard's own arrays (:func:`.kernels.warm`, then one candidate step and one BM25 scoring
        of the first chunk), so that the first query is not slow. :returns: seconds taken."""
        t = _kernels().warm()
        st, t0 = self.store, time.perf_counter()
        if len(st.dense) and st.dense.params.kind == "flat":
            slots, _ = self._kernel_tops(st.dense.vectors[:1].copy(), [None], 1)[0]
            st.postings.score(slots, [], np.zeros(0), 1.0)
        return t + time.perf_counter() - t0

    def _kernel_tops(self, q: np.ndarray, allowed: list, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query of float32[B, D] ``q``: the exact top-n ``(slots int64[n'], canonical
        float64[n'])`` (ties: chunk id) of the allowed rows (None: all), from one BLAS scan and
        :func:`.kernels.dense_step`; the same result as :meth:`_dense_tops` / :meth:`_dense_top`
        over a flat index (their numpy path, used here when a score is not finite). An
        unfiltered query also leaves its dense-minimum estimate in the memo of
        :meth:`_dense_min_estimate` (the kernel computes it from the same scan)."""
        dense, kernels = self.store.dense, _kernels()
        vecs, row_slot = dense.vectors, dense.slots
        sample = dense.sample(self.SAMPLE)[0]
        memo = self._dmin_memo()
        out = []
        for i in range(q.shape[0]):
            qi, every = q[i], allowed[i] is None
            key = qi.tobytes() if every else b""
            rows = _NO_ROWS if every else dense.rows(allowed[i])
            approx = (vecs if every else vecs[rows]) @ qi
            short, ex, order, ties, low, status = kernels.dense_step(
                vecs, rows, every, approx, qi, dense.score_error(qi), n,
                sample if every and key not in memo else _NO_ROWS)
            if status != kernels.OK:
                out.append(self._dense_tops(q, [i], n)[i] if every else self._dense_top(qi, n, allowed[i]))
                continue
            if every and key not in memo:
                memo[key] = float(low)
            r = short if every else rows[short]
            kk = min(n, approx.size)
            order = np.asarray(top_k_order(ex, self.store.row_ids(), kk, rows=r), np.int64) if ties else order[:kk]
            out.append((row_slot[r[order]], ex[order]))
        return out

    def _canonical(self, q: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float64[M]: canonical scores of float32[D] ``q`` with the rows int64[M] (compiled
        :func:`.kernels.canonical_rows`, the values of ``DenseIndex.exact_rows``)."""
        return _kernels().canonical_rows(self.store.dense.vectors, np.asarray(rows, np.int64),
                                       np.ascontiguousarray(q, dtype=np.float32))

    def _dmin_memo(self) -> dict[bytes, float]:
        """Dense-minimum estimates by query bytes, dropped on a write (at most 4,096 kept)."""
        if self._dmin[0] != self.store.version or len(self._dmin[1]) >= 4096:
            self._dmin = (self.store.version, {})
        return self._dmin[1]

    def _refine(self, q: np.ndarray, slots: np.ndarray, approx: np.ndarray, n: int,
                complete: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """Top-n of ``slots`` by canonical score (ties: chunk id), from approximate scores
        float[M] (see :func:`refine_top`; None: ``approx`` was a partial list that must grow)."""
        dense = self.store.dense
        r = refine_top(approx, dense.score_error(q), lambda pos: self._canonical(q, dense.rows(slots[pos])),
                       self.store.ids(slots), n, complete=complete)
        return None if r is None else (slots[r[0]], r[1])

    def _dense_tops(self, q: np.ndarray, which: list[int], n: int, ef_search: int = 0,
                    nprobe: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Unfiltered top-n of the queries ``which`` of float32[B, D] ``q``: one FAISS call for a
        few more than n, refined by canonical score; a query whose cut is too close to the last
        fetched score is asked again with four times as many (rare). With an approximate index
        (HNSW ``ef_search``, IVF ``nprobe``) the candidates are what it finds; their scores are
        still canonical."""
        total = len(self.store.dense)
        fetch = min(total, n + max(16, n // 4))
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        while which:
            ids, scores = self.store.dense.search(q[which], fetch, ef_search, nprobe)
            again = []
            for j, i in enumerate(which):
                got = self._refine(q[i], ids[j], scores[j], n, complete=fetch >= total)
                if got is None:
                    again.append(i)
                else:
                    out[i] = got
            which, fetch = again, min(total, fetch * 4)
        return out

    def _dense_top(self, q: np.ndarray, n: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-n of the allowed slots int64[M] by canonical score (ties: chunk id)."""
        if allowed.size == 0:
            return allowed, np.zeros(0, np.float64)
        return self._refine(q, allowed, self.store.dense.score_slots(q, allowed), n)  # type: ignore[return-value]

    def _dense_min_estimate(self, q: np.ndarray) -> np.ndarray:
        """float64[B]: the lowest canonical inner product of each query with a fixed strided
        sample of at most :attr:`SAMPLE` of this shard's vectors (all of them when the shard is
        smaller): a cheap estimate of the corpus-wide dense minimum that dense-first fusion
        normalises with. Kept per query vector until the next write (a repeated query costs a
        lookup)."""
        dense = self.store.dense
        n = len(dense)
        if n == 0:
            return np.full(q.shape[0], np.inf)
        memo = self._dmin_memo()
        keys = [row.tobytes() for row in q]
        todo = [i for i, key in enumerate(keys) if key not in memo]
        if todo:
            rows, sample = dense.sample(self.SAMPLE)
            approx = q[todo] @ sample.T
            low = approx.min(axis=1)
            for j, i in enumerate(todo):
                # only a sample within twice the error bound of the lowest FAISS-kernel score
                # can hold the lowest canonical one (the argument of refine_top, for k = 1)
                near = rows[approx[j] <= low[j] + 2.0 * dense.score_error(q[i])]
                memo[keys[i]] = float(self._canonical(q[i], near).min())
        return np.array([memo[key] for key in keys], np.float64)

    # ------------------------------------------------------------------ exact hybrid
    def _exact_scores(self, qb: QueryBatch) -> list[tuple]:
        """Every eligible chunk's dense and BM25 score, per query.

        :returns: per query ``(rows int64[M], dense float64[M], lexical float64[M], q float32[D])``
            where rows index the dense index's row order (see :meth:`ChunkStore.row_ids`);
            ``dense`` is approximate (one BLAS product), refined where it is ranked
            (:meth:`_dense_exact`).
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
            out.append((rows, dense_all[i][rows].astype(np.float64), lexical[rows], q[i]))
        return out

    def _dense_exact(self, q: np.ndarray, rows: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """positions int64[S] into ``rows`` -> their canonical dense scores float64[S]."""
        return lambda pos: self._canonical(q, rows[pos])

    def _dense_range(self, rows, d, q) -> tuple[float, float]:
        """Canonical (min, max) dense score over the rows (approximate scores ``d``)."""
        exact, err = self._dense_exact(q, rows), self.store.dense.score_error(q)
        _, hi = refine_top(d, err, exact, range(d.size), 1)
        _, lo = refine_top(-d, err, lambda pos: -exact(pos), range(d.size), 1)
        return float(-lo[0]), float(hi[0])

    def _lists(self, rows, d, lx, q, n: int) -> tuple[Candidates, Candidates]:
        """Local top-n by canonical dense score and top-n by BM25 (non-zero scores only:
        ``lexical_listed``), each entry with both scores."""
        ids = self.store.row_ids()[rows]
        exact = self._dense_exact(q, rows)
        od, dd = refine_top(d, self.store.dense.score_error(q), exact, ids, n)
        pos = np.nonzero(lexical_listed(lx))[0]
        ol = np.asarray(pos[top_k_order(lx[pos], ids[pos], n)] if pos.size else pos, dtype=np.int64)
        slots = self.store.dense.slots
        return tuple(Candidates(slots[rows[o]], ids[o].tolist(), de, lx[o])  # type: ignore
                     for o, de in ((od, dd), (ol, exact(ol))))

    def exact_ranges(self, req: ExactRangesRequest) -> ExactRangesReply:
        """Exact hybrid, round 1: score every eligible chunk (dense: one matrix product; BM25:
        postings of the query terms only, every other chunk scores exactly 0), keep the arrays
        under ``token`` and return the local score ranges."""
        scores = self._exact_scores(req.batch)
        B = len(scores)
        eligible = [int(rows.size) for rows, *_ in scores]
        ranges = np.zeros((4, B), dtype=np.float64)
        for i, (rows, d, lx, q) in enumerate(scores):
            if rows.size:
                ranges[:, i] = (*self._dense_range(rows, d, q), lx.min(), lx.max())
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
        top, dls, lls, fields = [], [], [], []
        for i, (rows, d, lx, q) in enumerate(scores):
            dr, wd = tuple(req.dense_range[i]), req.dense_weight[i]

            def fuse(dense, lexical):
                return fuse_minmax(dense, lexical, dense_range=dr, lexical_range=tuple(req.lexical_range[i]),
                                   dense_weight=wd, lexical_weight=req.lexical_weight[i])

            exact = self._dense_exact(q, rows)
            span = dr[1] - dr[0]
            # the fused score moves by at most wd / span times the dense error (plus rounding)
            err = (wd / span if span > 0 else 0.0) * self.store.dense.score_error(q) * 1.001 + 1e-9
            ids = row_ids[rows]
            order, fused = refine_top(fuse(d, lx), err, lambda pos: fuse(exact(pos), lx[pos]), ids, int(req.k))
            top.append(Candidates(slots[rows[order]], ids[order].tolist(), exact(order), lx[order], fused))
            fields.append(self._fields(top[-1].slots))
            dl, ll = self._lists(rows, d, lx, q, int(req.n))
            dls.append(dl)
            lls.append(ll)
        return ExactFuseReply(top, dls, lls, fields)

    def exact_lists(self, req: ExactListsRequest) -> ExactListsReply:
        """Exact retrieval for rank fusion: the local top-``n`` dense and BM25 lists over every
        eligible chunk, in one round."""
        scores = self._exact_scores(req.batch)
        lists = [self._lists(rows, d, lx, q, int(req.n)) for rows, d, lx, q in scores]
        return ExactListsReply([int(rows.size) for rows, *_ in scores],
                               [dl for dl, _ in lists], [ll for _, ll in lists])

    # ------------------------------------------------------------------ fetch
    def fetch(self, req: FetchRequest) -> FetchReply:
        """Stored fields of the given slots (``found`` False for a slot deleted meanwhile)."""
        found, doc_ids, titles, texts, metadata = self.store.fields.hit_fields(req.slots)
        return FetchReply(found=found, doc_ids=doc_ids, titles=titles, texts=texts, metadata=metadata)

    def _fields(self, slots: np.ndarray) -> FetchReply:
        """:meth:`fetch` of live slots int64[M], with ``slots`` set (carried by a search reply)."""
        rep = self.fetch(FetchRequest(slots.tolist()))
        rep.slots = slots.tolist()
        return rep
