"""Shard-side search over a :class:`~oprag_server.shards.chunks.ChunkStore`: candidate
generation (dense top-n with BM25 of those, or BM25 top-n), exact hybrid (every eligible chunk
scored, one round: :mod:`.exact`) and fetching stored fields.

Scores are float64; ties are broken by ascending chunk id (see
:func:`oprag_server.index.fusion.top_k_order`). BM25 uses the corpus-global idf and average
length sent by the frontend.

Identical content, identical score: every dense score returned is canonical
(:func:`oprag_server.index.dense.fixed_order_dot`), whatever the batch, the shard, the filter
or the mode. The fast approximate scores (FAISS, BLAS, or a flat index's int8 copy:
:mod:`oprag_server.index.kernels_scan`) only pick the candidates: each top-n is refined exactly
(:func:`oprag_server.index.fusion.refine_top`), computing the canonical score of the few
candidates within the approximation's error bound of the cut only, so a chunk left out can never
outrank one kept.
"""

from __future__ import annotations

import functools
import importlib
import time

import numpy as np

from .. import records
from ..index.bm25.listed_top import listed_top, listed_top_scored
from ..index.dense_low import LowSeeds
from ..index.fusion import refine_top, top_k_order
from ..index.lexical_list import order_lexical_list
from . import ann_check, beams
from .chunks import ChunkStore
from .carried import FieldsMixin, Later
from .exact import ExactMixin
from .protocol import Candidates, QueryBatch, SearchReply, SearchRequest

_NO_ROWS = np.zeros(0, np.int64)


@functools.cache
def _index_module(name: str):
    """``..index.<name>`` (a numba module), imported on first use and kept (an ``importlib`` lookup per use cost ~10 us
    of a search): numba costs ~170 MB per process; the frontend imports this module (the shard entry) without searching."""
    return importlib.import_module(f"..index.{name}", __package__)


_kernels, _kernels_scan, _kernels_low, _kernels_refine = (
    functools.partial(_index_module, m) for m in ("kernels", "kernels_scan", "kernels_low", "kernels_refine"))


class Searcher(ExactMixin, FieldsMixin):
    """Read side of one shard (exact mode: :class:`.exact.ExactMixin`; stored fields: :class:`.carried.FieldsMixin`)."""

    SAMPLE = 512  #: vectors sampled (evenly by slot) to estimate the corpus-wide dense minimum

    #: approximate scores of a flat index from its int8 copy (:mod:`..index.kernels_scan`);
    #: False: the float32 BLAS scan (the same results, tested)
    int8_scan = True

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._i8 = None  # the int8 copy of the vectors (created on the first flat scan)
        self._rows_n = _NO_ROWS
        self._dmin: tuple[int, dict[bytes, float]] = (-1, {})  # (store version, query bytes -> estimate)
        self._low = LowSeeds()  # HNSW: seeds of the dense-minimum search
        self._later: Later | None = None  # the last search sent with fields_later (its fields not sent yet)
        self._check: ann_check.SampleCheck | None = None  # HNSW / IVF: the sample a dense list is checked against

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
        lexical = listed = lexical_min = tied = None
        st.dense.last_knobs = {}  # (lexical: no dense search, no knob)
        if req.mode in ("hybrid", "dense"):
            if n == 0:  # a widening round for the BM25 list alone (operators/hybrid.py): no dense search
                tops, lows = [(_NO_ROWS, np.zeros(0, np.float64))] * B, [np.inf] * B
            elif st.dense.params.kind == "flat":  # compiled: every row scanned, the exact top-n
                tops, lows = self._kernel_tops(q, allowed, n)
            else:
                plain = [i for i, a in enumerate(allowed) if a is None]
                faiss_res, lows, knobs = {}, [None] * B, {}
                for ef, which in beams.of(st, req, plain).items():
                    faiss_res |= self._dense_tops(q, which, n, ef, req.nprobe)
                    knobs, got = beams.widest(knobs, st.dense.last_knobs), self._ann_lows(q, which, ef, req.nprobe)
                    lows = [got[i] if i in which else low for i, low in enumerate(lows)]  # (knobs: not the minimum's)
                st.dense.last_knobs = knobs or st.dense.last_knobs
                tops = [faiss_res.get(i) for i in range(B)]
                for i in range(B):
                    if tops[i] is None:
                        tops[i], lows[i] = self._dense_top(q[i], n, allowed[i], low=True)
            if any(low is None for low in lows):
                est = self._dense_min_estimate(q).tolist()
                lows = [est[i] if low is None else low for i, low in enumerate(lows)]
            dense_min = lows
            # the BM25 list first: a pass over every posting also gives the candidates' BM25
            score = [functools.partial(st.postings.score, tops[i][0], qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b)
                     for i in range(B)]
            tops_l = [self._lexical_top(q[i], qb, i, allowed[i], int(req.m), tops[i][0], score[i])
                      for i in range(B)] if req.mode == "hybrid" and req.m > 0 else None
            for i in range(B):
                slots, dense = tops[i]
                lex = tops_l[i][2] if tops_l is not None else score[i]()
                cands.append(Candidates(slots, st.ids(slots), dense, lex))
            if tops_l is not None:
                lexical, listed, tied = [t[0] for t in tops_l], [t[1] for t in tops_l], [t[3] for t in tops_l]
                lexical_min = [self._lexical_min(qb, i, allowed[i], eligible[i], listed[i], lexical[i]) for i in range(B)]
        elif req.mode == "lexical":
            dense_min = [np.inf] * B
            for i in range(B):
                slots, lex = st.postings.score_all(qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b)
                keep = lex != 0.0  # the BM25 list only (README: lexical ranks): idf-0 terms score 0
                if allowed[i] is not None:
                    keep &= np.isin(slots, allowed[i], assume_unique=True)
                slots, lex = slots[keep], lex[keep]
                cids = st.ids(slots)
                order = top_k_order(lex, cids, n)
                slots = slots[order]
                dense = self._canonical(q[i], st.dense.rows(slots))
                cands.append(Candidates(slots, [cids[j] for j in order], dense, lex[order]))
        else:
            raise ValueError(f"unknown search mode {req.mode!r}")
        fields = None
        if req.fetch_k > 0:  # the hits' fields now (or in the FIELDS reply right behind), so that no FETCH follows
            later = Later(req, cands, lexical, dense_min, st.version)
            if req.fields_later:
                self._later = later
            else:
                fields = later.fields(self)
        return SearchReply(cands, eligible, dense_min, st.dense.params.kind, st.dense.last_knobs or None, fields,
                           lexical, listed, lexical_min, tied)

    def _lexical_top(self, q: np.ndarray, qb: QueryBatch, i: int, allowed: np.ndarray | None,
                     m: int, cand: np.ndarray, score_cand) -> tuple[Candidates, int, np.ndarray, bool]:
        """Query ``i``'s exact BM25 top-m over the allowed live chunks whose BM25 score is not 0
        (the lexical ranked list, :func:`.fusion.lexical_listed`), each with its canonical dense score; and how many such chunks there are (the list is
        complete when that is <= m). BM25 visits only the query terms' postings, compiled
        (:func:`.bm25.listed_top.listed_top`: ``PostingsIndex.score_all``'s values, rank_bm25's).

        With it, the BM25 of the dense candidates' slots int64[C] ``cand``: from the pass when it
        read every posting of the query, else ``score_cand()`` before a pruned pass
        (:func:`.bm25.listed_top.listed_top_scored`).

        Ordered by (BM25 desc, canonical dense desc, chunk id asc): a tie at the list's last score
        lists its members with the highest dense scores (:func:`..index.lexical_list.order_lexical_list`).

        :returns: ``(Candidates, listed, float64[C], tied)``."""
        st = self.store
        slots, lex, listed, cand_lex = listed_top_scored(st.postings, qb.terms[i], qb.idf[i], qb.avgdl, qb.k1, qb.b,
                                                         m, allowed, cand, score_cand, st.version)
        # ids are read only for ties (the slot-indexed id array of the store)
        order = _kernels_refine().rank_top(lex, st._slot_ids, m, rows=slots)  # noqa: SLF001
        order, dense, tied = order_lexical_list(lex, order, lambda p: self._canonical(q, st.dense.rows(slots[p])),
                                                lambda p: st._slot_ids[int(slots[p])], self._approx_at(q, slots))  # noqa: SLF001
        top = slots[order]
        return Candidates(top, st.ids(top), dense, lex[order]), listed, cand_lex, tied

    @staticmethod
    def _skyband_slots(c: Candidates, lex: Candidates | None, k: int, cone=None) -> np.ndarray:
        """Slots of the k-skyband (:func:`.fusion.skyband`) of the dense candidates ``c`` and,
        when given, the BM25 list ``lex`` (deduplicated): every chunk of this shard that can be
        in a monotone fusion's top-k of the two lists. ``cone``: ``(weights, dense minimum, idf,
        k1)`` of a min-max fusion, which keeps only the skyband's chunks that can be in its top-k
        (:mod:`..index.kernels_cone`; about half of them). :func:`..index.kernels_carry.band_slots`."""
        from ..index.kernels_carry import band_slots  # noqa: PLC0415 - numba only in processes that search

        return band_slots(c, lex, k, cone)

    def warm(self) -> float:
        """Compile (or load from numba's cache) the kernels of the candidate step for this shard's own arrays
        (:func:`.kernels.warm`, then one candidate step and one BM25 scoring of the first chunk; the MaxScore kernel
        and the segment's term bounds of the BM25 top-m; the HNSW dense-minimum seeds, :class:`..index.dense_low.
        LowSeeds`; the ANN check's sample), so that the first query is not slow. :returns: seconds taken."""
        t = _kernels().warm()
        st, t0 = self.store, time.perf_counter()
        from ..index import (kernels_band, kernels_carry, kernels_cone, kernels_exact, kernels_fields,  # noqa: PLC0415
                             kernels_topm, kernels_wide, kernels_wide_keep)

        _kernels_low().warm()
        kernels_topm.warm()
        kernels_exact.warm()
        kernels_wide.warm()
        kernels_wide_keep.warm()
        _kernels_scan().warm()
        kernels_cone.warm()
        kernels_carry.warm()
        _kernels_refine().warm()
        kernels_band.warm()
        kernels_fields.warm()
        listed_top(st.postings, ["\x00"], np.ones(1), 1.0, 1.5, 0.75, 1)  # the segment's term bounds
        if st.dense.params.kind == "hnsw" and st.dense.ann is not None:
            self._low.prepare(st.dense.ann)  # build the seeds
        ann_check.prepare(self)  # the ANN check's sample
        if len(st.dense) and st.dense.params.kind == "flat":
            slots, _ = self._kernel_tops(st.dense.vectors[:1].copy(), [None], 1)[0][0]
            st.postings.score(slots, [], np.zeros(0), 1.0)
        return t + time.perf_counter() - t0

    def _kernel_tops(self, q: np.ndarray, allowed: list, n: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], list]:
        """Per query of float32[B, D] ``q``: the exact top-n ``(slots int64[n'], canonical
        float64[n'])`` (ties: chunk id) of the allowed rows (None: all), from one scan (the int8 copy, else BLAS) and
        :func:`.kernels.dense_step`; the same result as :meth:`_dense_tops` / :meth:`_dense_top`
        over a flat index (their numpy path, used here when a score is not finite).

        :returns: the tops and, per query, the *exact* lowest canonical score over the allowed
            rows (from the same scan: only rows within twice the error bound of the lowest
            approximate score are scored canonically, the k = 1 argument of ``refine_top``;
            ``inf`` when none is allowed), or None where the numpy path ran. It is the minimum
            exact mode normalises with, so dense-first ranges equal exact mode's with a flat
            index."""
        dense, kernels = self.store.dense, _kernels()
        vecs, row_slot = dense.vectors, dense.slots
        i8 = self._int8_rows()
        out, lows = [], []
        for i in range(q.shape[0]):
            qi, every = q[i], allowed[i] is None
            rows = _NO_ROWS if every else dense.rows(allowed[i])
            # unfiltered: the kernel also takes the minimum (its sample argument: every row)
            kr, m = _kernels_refine(), vecs.shape[0] if every else rows.size
            # the int8 steps below in one call (kernels_refine.flat_top_one); a query not finite takes the numpy path
            fused = kr.flat_top_one(vecs, i8.codes, i8.scale, i8.rb, i8.e, i8.c, qi, n, self._every(m)) \
                if i8 is not None and every else None
            if fused is not None and fused[5] != kr.QUERY_NOT_FINITE:
                short, ex, order, ties, low, status = fused
            elif i8 is not None and np.isfinite(qi).all():  # a quarter of the bytes read (kernels_scan)
                qn = _kernels_scan().query_norm(qi)  # |q|, once for the three bounds below
                approx, err = i8.scores(qi, None if every else rows), i8.error(qi, qn)
                sample = self._every(m) if every else _NO_ROWS
                short, ex, order, ties, low, status = kr.dense_step_fast(
                    vecs, rows, every, approx, qi, err, n, sample, kr.fast_error(i8.c + i8.e, vecs.shape[1], qi, qn),
                    i8.rb, i8.row_scale(qi, qn))
            else:
                approx, err = (vecs if every else vecs[rows]) @ qi, dense.score_error(qi)
                sample = self._every(m) if every else _NO_ROWS
                short, ex, order, ties, low, status = kernels.dense_step(vecs, rows, every, approx, qi, err, n, sample)
            if status != kernels.OK:
                out.append(self._dense_tops(q, [i], n)[i] if every else self._dense_top(qi, n, allowed[i]))
                lows.append(None)
                continue
            if every or not m:
                lows.append(float(low))
            else:
                near = np.flatnonzero(approx <= np.float64(approx.min()) + 2.0 * err)
                lows.append(float(self._canonical(qi, rows[near]).min()))
            r = short if every else rows[short]
            kk = min(n, m)
            order = np.asarray(top_k_order(ex, self.store.row_ids(), kk, rows=r), np.int64) if ties else order[:kk]
            out.append((row_slot[r[order]], ex[order]))
        return out, lows

    def _every(self, n: int) -> np.ndarray:
        """int64[n]: 0 .. n-1 (kept until n changes)."""
        if self._rows_n.size != n:
            self._rows_n = np.arange(n, dtype=np.int64)
        return self._rows_n

    def _canonical(self, q: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float64[M]: canonical scores of float32[D] ``q`` with the rows int64[M] (compiled
        :func:`.kernels_low.canonical_rows`, the values of ``DenseIndex.exact_rows``)."""
        vecs, pos = self.store.dense.vectors_for(np.asarray(rows, np.int64))  # (no copy of every vector)
        return _kernels_low().canonical_rows(vecs, pos, np.ascontiguousarray(q, dtype=np.float32))

    def _dmin_memo(self) -> dict[bytes, float]:
        """Dense-minimum estimates by query bytes, dropped on a write (at most 4,096 kept)."""
        if self._dmin[0] != self.store.version or len(self._dmin[1]) >= 4096:
            self._dmin = (self.store.version, {})
        return self._dmin[1]

    def _refine(self, q: np.ndarray, slots: np.ndarray, approx: np.ndarray, n: int,
                complete: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """Top-n of ``slots`` by canonical score (ties: chunk id), from approximate scores
        float[M] (see :func:`refine_top`; None: ``approx`` was a partial list that must grow)."""
        dense, ids = self.store.dense, self.store._slot_ids  # noqa: SLF001 (ranked compiled: no chunk id read)
        r = refine_top(approx, dense.score_error(q), lambda pos: self._canonical(q, dense.rows(slots[pos])), None, n,
                       complete=complete, rank=lambda ex, sh, kk: _kernels_refine().rank_top(ex, ids, kk, rows=slots[sh]))
        return None if r is None else (slots[r[0]], r[1])

    def _dense_tops(self, q: np.ndarray, which: list[int], n: int, ef_search: int = 0,
                    nprobe: int = 0, check: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Unfiltered top-n of the queries ``which`` of float32[B, D] ``q``: one FAISS call for a few more than n,
        refined by canonical score; a query whose cut is too close to the last fetched score is asked again with four
        times as many (rare). With an approximate index (HNSW ``ef_search``, IVF ``nprobe``) the candidates are what it
        finds, scored canonically; with ``check`` a list a sampled chunk proves incomplete is searched again with a
        wider beam or more lists, and a shard the sample holds whole is ranked exactly from it (:mod:`.ann_check`)."""
        if check and (got := ann_check.whole_tops(self, q, which, n)) is not None:  # (a sample holding every chunk)
            return got
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
        if check and self.store.dense.params.kind != "flat" and self.store.dense.params.ann_check and out:
            ann_check.widened(self, ann_check.check_of(self), q, out, n, ef_search, nprobe)
        return out

    def _dense_top(self, q: np.ndarray, n: int, allowed: np.ndarray, low: bool = False):
        """Top-n of the allowed slots int64[M] by canonical score (ties: chunk id); with ``low``
        ``(top, lowest canonical score of the allowed slots)`` from the same scores (the k = 1
        argument of ``refine_top``; ``inf`` when none is allowed)."""
        if allowed.size == 0:
            return ((allowed, np.zeros(0, np.float64)), np.inf) if low else (allowed, np.zeros(0, np.float64))
        dense = self.store.dense
        approx = dense.score_slots(q, allowed)
        top = self._refine(q, allowed, approx, n)
        if not low:
            return top
        near = allowed[approx <= np.float64(approx.min()) + 2.0 * dense.score_error(q)]
        return top, float(self._canonical(q, dense.rows(near)).min())

    def _ann_lows(self, q: np.ndarray, plain: list[int], ef_search: int, nprobe: int) -> list:
        """Per query of float32[B, D] ``q``: for the unfiltered ones (``plain``), the dense minimum for an approximate
        index. HNSW: the lowest canonical score among the shard's extreme seeds and the chunks a bottom-layer search for
        ``-q`` from the lowest seeds keeps (:class:`..index.dense_low.LowSeeds`, int8 copy; those within twice its error
        of the lowest int8 score scored canonically; None when no vector is live), and the check sample's lowest (only
        where it can be lower). IVF: the lower of the sample's lowest (else :meth:`_dense_min_estimate`) and the
        canonical score of the chunk the index finds nearest to ``-q`` (k = 1). All are scores of real chunks, never
        below the exact minimum; a sample of every chunk: the exact minimum (:meth:`.ann_check.SampleCheck.lows`)."""
        out, check = [None] * q.shape[0], self._check if plain else None
        whole = check.lows(self, q, plain, True) if check is not None else None  # (a sample of every chunk: exact)
        if not plain or whole is not None:
            return [dict(zip(plain, whole or ())).get(i) for i in range(q.shape[0])]
        dense = self.store.dense
        if dense.params.kind == "hnsw" and dense.ann is not None:  # from the seeds (index/dense_low.py)
            ann = dense.ann
            self._low, ann.seeds = (self._low if ann.seeds is None else ann.seeds), None  # (a compaction's: hnsw_build)
            cands, st = self._low.candidates(ann, q[plain], ef_search), ann.storage()
            for j, i in enumerate(plain):  # the walk's lowest, then the sample's where it can be lower (low_below)
                c = cands[j] if cands[j] is not None else _NO_ROWS
                low = min(self._tail_low(ann, q[i], dense.score_error(q[i])),
                          float(_kernels_low().canonical_rows(st, c, q[i]).min()) if c.size else np.inf)
                got = check.low_below(self, q[i], low) if check is not None else None
                if cands[j] is not None or got is not None:  # (else: no seeds, no sample: estimated by the caller)
                    low = min(low, np.inf if got is None else got)
                    out[i] = low if np.isfinite(low) else None
            return out
        sampled = dict(zip(plain, (check.lows(self, q, plain, False) if check is not None else None) or ()))
        est = None if all(sampled.get(i) is not None for i in plain) else self._dense_min_estimate(q[plain])
        slots, _ = dense.search(-q[plain], 1, ef_search, nprobe)
        for j, i in enumerate(plain):
            s = np.asarray(slots[j], np.int64)
            found = float(self._canonical(q[i], dense.rows(s)).min()) if s.size else np.inf
            out[i] = min(float(est[j]) if sampled.get(i) is None else sampled[i], found)
        return out

    @staticmethod
    def _tail_low(ann, q: np.ndarray, err: float) -> float:
        """The exact lowest canonical score of float32[D] ``q`` over the live vectors waiting
        outside the HNSW graph (:attr:`.ann.AnnIndex.pending`; ``inf`` when none), which the
        seeds do not cover: one scan of the tail, canonical scores within ``2 * err`` of its
        lowest float32 score (the k = 1 argument of ``refine_top``)."""
        if not ann.pending:
            return np.inf
        tail = ann.tail()
        live = np.flatnonzero(ann.ann_slot[int(ann._index.ntotal):] >= 0)  # noqa: SLF001
        if not live.size:
            return np.inf
        approx = tail[live] @ q
        near = live[approx <= np.float64(approx.min()) + 2.0 * err]
        return float(_kernels_low().canonical_rows(np.ascontiguousarray(tail), near, q).min())

    def _dense_min_estimate(self, q: np.ndarray) -> np.ndarray:
        """float64[B]: the lowest canonical inner product of each query with a fixed (by slot)
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
