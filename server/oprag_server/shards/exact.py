"""Exact hybrid on a shard (``full_hybrid``): every eligible chunk scored, in one round for both
fusions: min-max (:meth:`ExactMixin.exact_minmax`: score ranges, rank lists and the chunks that
can be in the top-k whatever the corpus-wide ranges) and rank fusion (:meth:`ExactMixin.exact_lists`).
A mixin of :class:`.search.Searcher`, which provides ``store``, ``_canonical``, ``_every`` and ``_fields``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import records
from ..index.bm25.listed_top import scores_at
from ..index.fusion import fuse_minmax, lexical_listed, lexical_span_bound, refine_top, top_k_order
from .protocol import (Candidates, ExactListsReply, ExactListsRequest, ExactMinmaxReply, ExactMinmaxRequest,
                       QueryBatch)

_EPS = np.finfo(np.float64).eps


def _kernels_band():
    """:mod:`..index.kernels_band` (numba: imported on first use, as ``search._kernels``)."""
    from ..index import kernels_band  # noqa: PLC0415

    return kernels_band


def id_ranks(ids: np.ndarray) -> np.ndarray:
    """int64[N]: each of the distinct chunk ids' position in ascending (Python ``str``) order.
    A fixed-width unicode sort (code points, as ``str``); ``sorted`` when that cannot tell two
    ids apart (numpy drops trailing NULs)."""
    u = ids.astype(str) if ids.size else np.zeros(0, "U1")
    order = np.argsort(u, kind="stable")
    if order.size > 1 and (u[order[1:]] == u[order[:-1]]).any():
        order = np.asarray(sorted(range(ids.size), key=ids.__getitem__), dtype=np.int64)
    rank = np.empty(ids.size, np.int64)
    rank[order] = np.arange(ids.size)
    return rank


class ExactMixin:
    """The exact-mode operations of a shard's searcher."""

    _ranks: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))
    _order: tuple = (-1, np.zeros(0, np.int64), np.zeros(0, np.int64))  # (store version, order, sorted slots)

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
        dense_all = st.dense.score_all(q)
        out = []
        for i in range(q.shape[0]):
            allowed = st.allowed(filters[i])
            # BM25 of every row's chunk in row order (score_all's values; compiled: listed_top.scores_at)
            lexical = scores_at(st.postings, qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b, row_slots)
            if allowed is None:
                out.append((self._every(row_slots.size), dense_all[i].astype(np.float64), lexical, q[i]))
                continue
            order, sorted_slots = self._slot_order(row_slots)
            rows = order[np.searchsorted(sorted_slots, allowed)] if allowed.size else np.zeros(0, np.int64)
            out.append((rows, dense_all[i][rows].astype(np.float64), lexical[rows], q[i]))
        return out

    def _slot_order(self, row_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(order, sorted slots)`` of int64[R] ``row_slots`` (the dense index's, stable), kept
        until the next write."""
        if self._order[0] != self.store.version or self._order[1].size != row_slots.size:
            order = np.argsort(row_slots, kind="stable")
            self._order = (self.store.version, order, row_slots[order])
        return self._order[1], self._order[2]

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

    def _id_ranks(self) -> np.ndarray:
        """:func:`id_ranks` of every row (dense index order), kept until the next write."""
        if self._ranks[0] != self.store.version or self._ranks[1].size != len(self.store.dense):
            self._ranks = (self.store.version, id_ranks(self.store.row_ids()))
        return self._ranks[1]

    def _band(self, rows, d, lx, q, k: int, weights, lspan_max: float = np.inf) -> tuple[np.ndarray, np.ndarray]:
        """The chunks that can be in the top-k of a min-max fusion with these weights, whatever the
        corpus-wide ranges (:func:`..index.kernels_band.band`, from the approximate dense scores
        and their error bound: a superset of the band of the canonical scores).

        ``lspan_max``: an upper bound of the corpus-wide BM25 span.
        :returns: positions into ``rows`` and their canonical dense scores."""
        kb, r = _kernels_band(), self._id_ranks()[rows]
        wd, wl = weights
        if wd > 0:
            err = self.store.dense.score_error(q)
            e2 = 2.000001 * err + 4.0 * _EPS * float(np.abs(d).max(initial=0.0))
            pos = kb.band(d, lx if wl > 0 else np.zeros(d.size), r, k, e2, kb.second_margin(wd, wl, lspan_max))
        else:
            pos = kb.band(lx, np.zeros(d.size), r, k)
        return pos, self._canonical(q, rows[pos])

    def exact_minmax(self, req: ExactMinmaxRequest) -> ExactMinmaxReply:
        """Exact min-max hybrid in one round: score every eligible chunk (dense: one matrix
        product; BM25: postings of the query terms only, every other chunk scores exactly 0) and
        return per query the local score ranges (canonical dense), the local top-``n`` dense and
        BM25 lists (for ranks), the chunks that can be in the top-``k[i]`` whatever the ranges
        (:meth:`_band`, canonical dense scores) and the stored fields of the top-k fused with the
        local ranges (usually the global top-k's: no FETCH follows)."""
        scores = self._exact_scores(req.batch)
        B = len(scores)
        ranges = np.zeros((4, B), dtype=np.float64)
        slots, row_ids = self.store.dense.slots, self.store.row_ids()
        bands, dls, lls, fields = [], [], [], []
        for i, (rows, d, lx, q) in enumerate(scores):
            if rows.size:
                ranges[:, i] = (*self._dense_range(rows, d, q), lx.min(), lx.max())
            lspan = lexical_span_bound(req.batch.idf[i], req.batch.k1)
            pos, dc = self._band(rows, d, lx, q, int(req.k[i]), req.weights[i], lspan) if rows.size else \
                (np.zeros(0, np.int64), np.zeros(0))
            ids = row_ids[rows[pos]]
            bands.append(Candidates(slots[rows[pos]], ids.tolist(), dc, lx[pos]))
            fused = fuse_minmax(dc, lx[pos], dense_range=tuple(ranges[:2, i]), lexical_range=tuple(ranges[2:, i]),
                                dense_weight=req.weights[i][0], lexical_weight=req.weights[i][1])
            fields.append(self._fields(bands[-1].slots[top_k_order(fused, ids, int(req.k[i]))]))
            dl, ll = self._lists(rows, d, lx, q, int(req.n))
            dls.append(dl)
            lls.append(ll)
        ranges = ranges.tolist()
        return ExactMinmaxReply([int(rows.size) for rows, *_ in scores], ranges[0], ranges[1], ranges[2], ranges[3],
                                bands, dls, lls, fields)

    def exact_lists(self, req: ExactListsRequest) -> ExactListsReply:
        """Exact retrieval for rank fusion: the local top-``n`` dense and BM25 lists over every
        eligible chunk, in one round."""
        scores = self._exact_scores(req.batch)
        lists = [self._lists(rows, d, lx, q, int(req.n)) for rows, d, lx, q in scores]
        return ExactListsReply([int(rows.size) for rows, *_ in scores],
                               [dl for dl, _ in lists], [ll for _, ll in lists])
