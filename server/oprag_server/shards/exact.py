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

    def _lexical_min(self, qb: QueryBatch, i: int, allowed: np.ndarray | None, eligible: int, listed: int,
                     lst: Candidates) -> float:
        """The lowest BM25 score over query ``i``'s eligible chunks of this shard, as exact mode
        takes it for its normalisation (:meth:`.exact.ExactMixin.exact_minmax`): 0.0 when none is
        eligible, or when some eligible chunk scores 0 (``listed < eligible``) and no query term
        has a negative idf (rank_bm25's floor ``epsilon * average idf`` is negative when the
        average is: every score is then <= 0); the BM25 list's lowest (and 0 when some chunk is
        unlisted) when the list holds every listed chunk; else -- a negative idf below a truncated
        list (trial33: a certified top-k that was not ``full_hybrid``'s), or every eligible chunk
        holds a query term and the list is shorter: a small filtered set of chunks that all
        contain "the", say -- every eligible chunk scored (:func:`..index.bm25.listed_top.scores_at`,
        the values of ``PostingsIndex.score_all``; an unlisted chunk scores 0)."""
        if eligible <= 0 or listed < eligible and not (np.asarray(qb.idf[i]) < 0.0).any():
            return 0.0
        if len(lst.slots) >= listed:
            low = float(np.min(lst.lexical)) if len(lst.slots) else 0.0
            return min(low, 0.0) if listed < eligible else low
        st = self.store
        slots = st.dense.slots if allowed is None else allowed
        return float(scores_at(st.postings, qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b, slots).min())

    def _exact_scores(self, qb: QueryBatch) -> list[tuple]:
        """Every eligible chunk's dense and BM25 score, per query.

        :returns: per query ``(rows int64[M], dense float64[M], lexical float64[M], exact, err)``
            where rows index the dense index's row order (see :meth:`ChunkStore.row_ids`);
            ``dense`` is approximate (:meth:`_approx_all`), ``err`` its bound, refined where it
            is ranked by ``exact`` (:meth:`_dense_exact`: positions -> canonical scores).
        """
        st = self.store
        q = records.as_query_matrix(qb.q, st.dim)
        filters = qb.filters or [None] * q.shape[0]
        row_slots = st.dense.slots
        dense_all = self._approx_all(q)
        out = []
        for i in range(q.shape[0]):
            allowed = st.allowed(filters[i])
            # BM25 of every row's chunk in row order (score_all's values; compiled: listed_top.scores_at)
            lexical = scores_at(st.postings, qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b, row_slots)
            d, err = dense_all[i]
            if allowed is None:
                rows = self._every(row_slots.size)
                out.append((rows, d.astype(np.float64), lexical, self._dense_exact(q[i], rows), err))
                continue
            order, sorted_slots = self._slot_order(row_slots)
            rows = order[np.searchsorted(sorted_slots, allowed)] if allowed.size else np.zeros(0, np.int64)
            out.append((rows, d[rows].astype(np.float64), lexical[rows], self._dense_exact(q[i], rows),
                        err if np.ndim(err) == 0 else err[rows]))
        return out

    def _approx_all(self, q: np.ndarray) -> list[tuple[np.ndarray, float | np.ndarray]]:
        """Per query of float32[B, D] ``q``: approximate dense scores float32[R] of every row (row
        order) and ``err``, a bound of ``|approximate - canonical|``. A flat index scans its int8
        copy (:mod:`..index.kernels_scan`, as the hybrid scan: a quarter of the bytes; ``err``
        float64[R], each row's proven bound ``row_scale * rb[r] + 1e-12`` capped by the
        all-rows one, ~1e-3..1e-2); any other kind, or a non-finite query, takes one product
        (:meth:`..index.dense.DenseIndex.score_all`, ``err`` the float
        :meth:`~..index.dense.DenseIndex.score_error`, ~1e-4). A larger bound only widens what
        is scored canonically: the results are the same."""
        dense = self.store.dense
        i8 = self._int8_rows() if dense.params.kind == "flat" and len(dense) and np.isfinite(q).all() else None
        if i8 is None:
            return [(d, dense.score_error(q[i])) for i, d in enumerate(dense.score_all(q))]
        from ..index.kernels_scan import query_norm  # noqa: PLC0415 - numba, loaded already (_int8_rows)

        qn = [query_norm(q[i]) for i in range(q.shape[0])]  # |q|, once for both bounds
        return [(i8.scores(q[i], None), np.minimum(i8.row_scale(q[i], qn[i]) * i8.rb + 1e-12, i8.error(q[i], qn[i])))
                for i in range(q.shape[0])]

    def _approx_at(self, q: np.ndarray, slots: np.ndarray):
        """Positions p -> ``(float32 approximate dense scores of float32[D] q with slots[p], their bound)`` from a
        flat shard's int8 copy, or None without one (:func:`..index.lexical_list.order_lexical_list`'s screen; looked
        up only when a large tie asks)."""
        def at(p):
            dense = self.store.dense
            i8 = self._int8_rows() if dense.params.kind == "flat" and len(dense) and np.isfinite(q).all() else None
            return None if i8 is None else (i8.scores(q, dense.rows(slots[p])), i8.error(q))
        return at

    def _int8_rows(self):
        """The flat index's int8 copy (:class:`..index.kernels_scan.Int8Rows`, rebuilt after a
        write; also the hybrid scan's, :meth:`.search.Searcher._kernel_tops`), or None without
        ``int8_scan``."""
        if not self.int8_scan:
            return None
        if self._i8 is None:
            from ..index import kernels_scan  # noqa: PLC0415 - numba, on first use (search._index_module)

            self._i8 = kernels_scan.Int8Rows()
        return self._i8.of(self.store.dense.vectors, self.store.version)

    def _slot_order(self, row_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(order, sorted slots)`` of int64[R] ``row_slots`` (the dense index's, stable), kept
        until the next write."""
        if self._order[0] != self.store.version or self._order[1].size != row_slots.size:
            order = np.argsort(row_slots, kind="stable")
            self._order = (self.store.version, order, row_slots[order])
        return self._order[1], self._order[2]

    def _dense_exact(self, q: np.ndarray, rows: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """positions int64[S] into ``rows`` -> their canonical dense scores float64[S] with float32[D]
        ``q``, each row's computed once (the range, the band and the lists of one query share rows)."""
        memo, have = np.empty(rows.size, np.float64), np.zeros(rows.size, np.bool_)

        def exact(pos) -> np.ndarray:
            pos = np.asarray(pos, np.int64)
            miss = pos[~have[pos]]
            if miss.size:
                memo[miss] = self._canonical(q, rows[miss])
                have[miss] = True
            return memo[pos]
        return exact

    def _dense_range(self, rows, d, exact, err) -> tuple[float, float]:
        """Canonical (min, max) dense score over the rows (approximate scores ``d``, within ``err``)."""
        _, hi = refine_top(d, err, exact, range(d.size), 1)
        _, lo = refine_top(-d, err, lambda pos: -exact(pos), range(d.size), 1)
        return float(-lo[0]), float(hi[0])

    def _lists(self, rows, d, lx, exact, err, n: int) -> tuple[Candidates, Candidates]:
        """Local top-n by canonical dense score and top-n by BM25 (non-zero scores only:
        ``lexical_listed``), each entry with both scores."""
        ids = self.store.row_ids()[rows]
        od, dd = refine_top(d, err, exact, ids, n)
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

    def _band(self, rows, d, lx, exact, err, k: int, weights,
              lspan_max: float = np.inf) -> tuple[np.ndarray, np.ndarray]:
        """The chunks that can be in the top-k of a min-max fusion with these weights, whatever the
        corpus-wide ranges (:func:`..index.kernels_band.band`).

        First from the approximate dense scores ``d`` and their bound ``err`` (a superset of the
        band of the canonical scores), then, when that kept more than ``k`` chunks, again over
        those with their canonical scores (margin 0): the chunks that "certainly outrank" a chunk
        form a transitive relation, so a chunk the first pass dropped has k certain outrankers,
        and a maximal one among those dropped has all k among the kept: the second pass keeps
        exactly what a pass over every chunk with canonical scores would keep.

        ``lspan_max``: an upper bound of the corpus-wide BM25 span.
        :returns: positions into ``rows`` and their canonical dense scores."""
        kb, r = _kernels_band(), self._id_ranks()[rows]
        wd, wl = weights
        if wd <= 0:
            pos = kb.band(lx, np.zeros(d.size), r, k)
            return pos, exact(pos)
        e2 = 2.000001 * float(np.max(err, initial=0.0)) + 4.0 * _EPS * float(np.abs(d).max(initial=0.0))
        tol = kb.second_margin(wd, wl, lspan_max)
        lw = lx if wl > 0 else np.zeros(d.size)
        pos = kb.band(d, lw, r, k, e2, tol)
        dc = exact(pos)
        if pos.size > k:
            keep = kb.band(dc, lw[pos], r[pos], k, 0.0, tol)
            pos, dc = pos[keep], dc[keep]
        return pos, dc

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
        for i, (rows, d, lx, exact, err) in enumerate(scores):
            if rows.size:
                ranges[:, i] = (*self._dense_range(rows, d, exact, err), lx.min(), lx.max())
            lspan = lexical_span_bound(req.batch.idf[i], req.batch.k1)
            pos, dc = self._band(rows, d, lx, exact, err, int(req.k[i]), req.weights[i], lspan) if rows.size else \
                (np.zeros(0, np.int64), np.zeros(0))
            ids = row_ids[rows[pos]]
            bands.append(Candidates(slots[rows[pos]], ids.tolist(), dc, lx[pos]))
            fused = fuse_minmax(dc, lx[pos], dense_range=tuple(ranges[:2, i]), lexical_range=tuple(ranges[2:, i]),
                                dense_weight=req.weights[i][0], lexical_weight=req.weights[i][1])
            fields.append(self._fields(bands[-1].slots[top_k_order(fused, ids, int(req.k[i]))]))
            dl, ll = self._lists(rows, d, lx, exact, err, int(req.n))
            dls.append(dl)
            lls.append(ll)
        ranges = ranges.tolist()
        return ExactMinmaxReply([int(rows.size) for rows, *_ in scores], ranges[0], ranges[1], ranges[2], ranges[3],
                                bands, dls, lls, fields)

    def exact_lists(self, req: ExactListsRequest) -> ExactListsReply:
        """Exact retrieval for rank fusion: the local top-``n`` dense and BM25 lists over every
        eligible chunk, in one round."""
        scores = self._exact_scores(req.batch)
        lists = [self._lists(rows, d, lx, exact, err, int(req.n)) for rows, d, lx, exact, err in scores]
        return ExactListsReply([int(rows.size) for rows, *_ in scores],
                               [dl for dl, _ in lists], [ll for _, ll in lists])
