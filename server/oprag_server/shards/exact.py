"""Exact hybrid on a shard (``full_hybrid``): every eligible chunk scored, min-max in two
rounds (:meth:`ExactMixin.exact_ranges`, :meth:`ExactMixin.exact_fuse`), rank lists in one
(:meth:`ExactMixin.exact_lists`). A mixin of :class:`.search.Searcher` (moved out of it
unchanged), which provides ``store``, ``_rounds``, ``_canonical`` and ``_fields``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import records
from ..index.fusion import fuse_minmax, lexical_listed, refine_top, top_k_order
from .protocol import (Candidates, ExactFuseReply, ExactFuseRequest, ExactListsReply, ExactListsRequest,
                       ExactRangesReply, ExactRangesRequest, QueryBatch)

_MAX_CACHED_ROUNDS = 64


class ExactMixin:
    """The exact-mode operations of a shard's searcher."""

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
