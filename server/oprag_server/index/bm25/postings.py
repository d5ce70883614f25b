"""Per-shard BM25 postings: an immutable CSR segment (:mod:`.segment`) plus a small mutable
delta of recent writes, chunk lengths, and scoring of chunks given the corpus-global idf
vector and avgdl.

See :mod:`oprag_server.index.bm25` for the reference computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from . import crc_files, delta_files
from .delta import Delta, accumulate
from .files import link_same
from .merging import _DELTA, _NONE, _SEG, MergeMixin
from .okapi import as_slot as _as_slot, check_avgdl, check_query, check_slots
from .segment import MAX_SLOT, Segment

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_F64 = np.zeros(0, dtype=np.float64)


class PostingsIndex(MergeMixin):
    """Mutable inverted index of one shard; chunks are identified by int *slots*.

    Storage:
        * a :class:`~.segment.Segment`: term dictionary and CSR postings arrays (int32 slots,
          uint16/uint32 tf), immutable, possibly memory-mapped from a snapshot;
        * deletes as a live mask (``_where`` below): a removed chunk's postings stay in the
          segment until the next merge;
        * the *delta* (:class:`~.delta.Delta`): the chunks added since the last merge as
          sorted numpy runs with the delta's own term ids, assigned when a batch is added
          (:meth:`add_batch` builds a batch's postings with numpy, no per-posting Python);
        * ``_where`` int8 per slot: the layer holding the chunk's live postings (segment,
          frozen delta of a background merge, delta, none);
        * dense per-slot arrays ``doc_len float64[capacity]`` and ``live bool[capacity]``
          where ``capacity > max slot ever added`` (slots should therefore be small,
          densely allocated non-negative ints below 2**31; 10 bytes per slot of capacity).

    :meth:`merge` folds the delta into a new segment and drops dead postings (build, then
    swap); :meth:`maybe_merge` does it (with ``background=True`` in a thread, see
    :mod:`.merging`) once the delta holds :attr:`MERGE_MIN` postings and a
    :attr:`MERGE_DIV`-th of the segment's, or dead postings are a quarter of it, so the total
    merge work stays proportional to the postings written.

    Scoring takes the *global* idf and avgdl (:class:`CorpusStats`): scores equal the
    single-index rank_bm25 ones on every shard. Not thread-safe (one shard loop drives it; a
    background merge thread reads only immutable inputs).
    """

    #: ``score_all`` uses a dense accumulator when the number of postings visited is at
    #: least ``capacity / _DENSE_RATIO``, else a sort-based sparse one.
    _DENSE_RATIO = 16
    #: the delta is merged once it holds this many postings and 1/MERGE_DIV of the segment's (a
    #: bulk load rewrites each posting ~1 + MERGE_DIV times: 4, not 8, since issue 13's ingest9)
    MERGE_MIN, MERGE_DIV = 65536, 4

    def __init__(self) -> None:
        self._seg = Segment.empty()
        self._seg_df = np.zeros(0, np.int32)  # live postings per segment term
        self._seg_dead = 0  # dead postings in the segment
        self._delta = Delta()
        self._frozen: Delta | None = None  # the delta a background merge is folding in
        self._pending: list | None = None  # [thread, result segment | exception, build s, install's parts]
        self._gone: list[int] = []  # segment and frozen chunks removed since a merge started (merging.py)
        # per slot: where its live postings are (_NONE, _SEG, _FROZEN, _DELTA)
        self._where = np.zeros(0, dtype=np.int8)
        self._doc_len = np.zeros(0, dtype=np.float64)
        self._live = np.zeros(0, dtype=bool)
        self._n_live = 0
        self._total_len = 0
        # pending statistics delta since the last drain_delta()
        self._d_n = 0
        self._d_len = 0
        self._d_df: dict[str, int] = {}
        self._d_removed = False  # a remove() since the last drain_delta() (zero counts possible)
        self.merges = 0
        self.last_merge_s = 0.0  # build time of the last merge (background or not)
        self.last_swap_s = 0.0  # time the caller's thread spent installing it
        self.last_merge_error: Exception | None = None  # of a background merge that failed

    def _grow(self, slot: int) -> None:
        cap = len(self._live)
        if slot < cap:
            return
        new_cap = max(slot + 1, 2 * cap, 64)
        for name, dt in (("_doc_len", np.float64), ("_live", bool), ("_where", np.int8)):
            a = np.zeros(new_cap, dtype=dt)
            old = getattr(self, name)
            a[: old.size] = old
            setattr(self, name, a)

    def add(self, slot: int, tokens: Sequence[str]) -> None:
        """Index chunk ``slot`` with analysed ``tokens`` (its length is ``len(tokens)``). An empty token list is allowed
        (a live chunk of length 0 that matches nothing, counted in ``N`` and avgdl like rank_bm25's empty documents).

        Raises:
            ValueError: ``slot`` outside ``[0, 2**31-1]`` or already live (remove it first).
            TypeError: ``slot`` is not an int.
        """
        self.add_batch([slot], [tokens])

    def add_batch(self, slots: Sequence[int], token_lists: Sequence[Sequence[str]]) -> None:
        """Index chunks ``slots[i]`` with analysed tokens ``token_lists[i]`` at once: term ids
        are assigned and the postings built with numpy for the whole batch (see :meth:`add`).

        Raises:
            ValueError: a slot outside ``[0, 2**31-1]``, already live, or twice in the batch;
                ``len(slots) != len(token_lists)``. Nothing is added then.
            TypeError: a slot is not an int.
        """
        slots = self._new_slots(slots, len(token_lists))
        if slots:
            self._added(slots, np.fromiter(map(len, token_lists), np.int64, count=len(slots)),
                        self._delta.add_batch(slots, token_lists))

    def add_ids(self, slots: Sequence[int], gids: np.ndarray, lens: np.ndarray, table) -> None:
        """:meth:`add_batch` of the tokens that shard-wide term ids stand for (``gids`` int64 row after row,
        ``lens`` int64 per row, of :class:`...term_ids.TermTable` ``table``): the same state; raises as it."""
        slots = self._new_slots(slots, len(lens))
        if slots:
            lens = np.asarray(lens, np.int64)
            self._added(slots, lens, self._delta.add_ids(slots, gids, lens, table))

    def _new_slots(self, slots: Sequence[int], n: int) -> list[int]:
        slots = [_as_slot(s) for s in slots]
        if len(slots) != n:
            raise ValueError("add_batch: slots and token_lists differ in length")
        for s in slots:
            if s < 0 or s > MAX_SLOT:
                raise ValueError(f"slot must lie in [0, {MAX_SLOT}], got {s}")
            if self.has_slot(s):
                raise ValueError(f"slot {s} is already indexed; remove() it first")
        if len(set(slots)) != len(slots):
            raise ValueError("add_batch: a slot appears twice")
        if slots:
            self._grow(max(slots))
        return slots

    def _added(self, slots: list[int], lens: np.ndarray, uc: tuple[np.ndarray, np.ndarray]) -> None:
        d_df, terms = self._d_df, self._delta.terms
        if not d_df:  # (the usual case: one batch per commit, drained after it) one C-level build
            self._d_df = dict(zip(map(terms.__getitem__, uc[0].tolist()), uc[1].tolist()))
        else:
            for i, n in zip(uc[0].tolist(), uc[1].tolist()):
                d_df[terms[i]] = d_df.get(terms[i], 0) + n
        s = np.asarray(slots, np.int64)
        self._doc_len[s] = lens
        self._live[s] = True
        self._where[s] = _DELTA
        n_tok = int(lens.sum())
        self._n_live += len(slots)
        self._total_len += n_tok
        self._d_n += len(slots)
        self._d_len += n_tok

    def remove(self, slot: int) -> None:
        """Remove chunk ``slot``. :raises KeyError: ``slot`` is not live (never added or already removed;
        check :meth:`has_slot` first for a no-op instead)."""
        slot = _as_slot(slot)
        if not self.has_slot(slot):
            raise KeyError(slot)
        w = int(self._where[slot])
        if w == _SEG:
            tids = self._seg.doc_term_ids(slot)
            assert tids is not None
            self._seg_df[tids] -= 1
            self._seg_dead += int(tids.size)
            terms = self._seg.terms
        else:
            layer = self._delta if w == _DELTA else self._frozen
            tids = layer.remove(slot)
            terms = layer.terms
        if w != _DELTA and self._pending is not None:  # in the segment being built: dead there
            self._gone.append(slot)
        d_df = self._d_df
        self._d_removed = True
        for t in map(terms.__getitem__, tids.tolist()):
            d_df[t] = d_df.get(t, 0) - 1
        n_tok = int(self._doc_len[slot])
        self._doc_len[slot] = 0.0
        self._live[slot] = False
        self._where[slot] = _NONE
        self._n_live -= 1
        self._total_len -= n_tok
        self._d_n -= 1
        self._d_len -= n_tok

    def __len__(self) -> int:
        """Number of live chunks."""
        return self._n_live

    def has_slot(self, slot: int) -> bool:
        """True if ``slot`` is live."""
        return 0 <= slot < self._live.size and bool(self._live[slot])

    @property
    def total_len(self) -> int:
        """Sum of live chunk lengths (tokens)."""
        return self._total_len

    def slots(self) -> np.ndarray:
        """Live slots, int64 ascending."""
        return np.flatnonzero(self._live).astype(np.int64, copy=False)

    def doc_len(self, slots: np.ndarray) -> np.ndarray:
        """Lengths (tokens) of live chunks, float64, shaped as ``slots``. :raises KeyError: a slot is not live."""
        s = check_slots(slots, self._live)
        return self._doc_len[s]

    def df(self, term: str) -> int:
        """Number of live chunks of this shard containing ``term``."""
        tid = self._seg.vocab.get(term)
        n = (int(self._seg_df[tid]) if tid is not None else 0) + self._delta.df(term)
        return n + self._frozen.df(term) if self._frozen is not None else n

    def drain_delta(self) -> tuple[int, int, dict[str, int]]:
        """Changes since the previous call: ``(n_delta, total_len_delta, df_delta)`` (``df_delta`` omits terms
        whose net change is 0; for :meth:`CorpusStats.apply_delta`). Resets the pending delta."""
        # only additions since the last call: every count is positive already
        out = (self._d_n, self._d_len, {t: d for t, d in self._d_df.items() if d} if self._d_removed else self._d_df)
        self._d_removed, self._d_n, self._d_len, self._d_df = False, 0, 0, {}
        return out

    def full_stats(self) -> tuple[int, int, dict[str, int]]:
        """Current totals ``(n_docs, total_len, df)`` (does not touch the pending delta)."""
        terms = self._seg.terms
        df = {terms[i]: int(v) for i, v in zip(np.flatnonzero(self._seg_df).tolist(),
                                                self._seg_df[self._seg_df > 0].tolist())}
        for layer in self._layers():
            for t, n in layer.df_items():
                df[t] = df.get(t, 0) + n
        return self._n_live, self._total_len, df

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``postings`` (segment and per-slot arrays, the BM25 top-m's scratch and wide-term rows, the
        delta at an estimated 100 bytes per posting) and ``terms`` (:meth:`.segment.Segment.nbytes`, plus the delta's
        dict and term strings); docs/architecture.md "Memory accounting". A memory-mapped segment (:meth:`load`,
        :meth:`adopt_files`) counts in full, though only the pages read are resident."""
        arrays, terms = self._seg.nbytes()
        per_slot = self._doc_len.nbytes + self._live.nbytes + self._where.nbytes + self._seg_df.nbytes
        sc = self.__dict__.get("_topm_scratch")  # the BM25 top-m's scratch and built wide rows (listed_top)
        per_slot += sc.nbytes() if sc is not None else 0
        for layer in self._layers():
            arrays += layer.nbytes()
            terms += layer.terms_nbytes()
        return {"postings": int(arrays + per_slot), "terms": int(terms)}

    @property
    def segment(self) -> Segment:
        """The current immutable segment (the delta is not in it until :meth:`merge`)."""
        return self._seg

    def save(self, d: Path, merge: bool = True) -> list[Path]:
        """Merge (``merge`` False: the caller did, or :func:`.delta_files.keeps`), write the segment under ``d`` (slots
        ``0..s-1``: a load's), its lengths (``doc_len.npy``), their CRC-32s (:mod:`.crc_files`) and the delta
        (:func:`.delta_files.write`; ValueError where that refuses it). :returns: the files (the caller fsyncs them)."""
        if merge:
            self.merge()
        src, out = self._doc_len_src, d / "doc_len.npy"
        files = self._save_segment(d)
        out.unlink(missing_ok=True)  # (never written in place: it may be linked elsewhere)
        if not (src is not None and src[1] is not None and src[0]() is self._seg and link_same(src[1], out.name, out)):
            np.save(out, self._doc_len[self._seg.doc_slots.astype(np.int64)].astype(np.int64))
        return crc_files.write(d, [*files, out]) + delta_files.write(self, d)

    @classmethod
    def load(cls, d: Path, mmap: bool = True) -> "PostingsIndex":
        """An index holding what :meth:`save` wrote (chunks at slots ``0..n-1``, the segment's first).
        :raises ValueError: inconsistent arrays. :raises OSError: a missing file."""
        crc_files.check(d)  # (a damaged file raises, named: the caller analyses the stored texts again)
        seg, doc_len = Segment.load(d, mmap=mmap), np.load(d / "doc_len.npy")
        n = int(seg.doc_slots.size)
        if doc_len.shape != (n,) or (n and int(seg.doc_slots[-1]) != n - 1):
            raise ValueError("postings snapshot: chunk lengths do not match the segment")
        ix = cls()
        ix._grow(max(n - 1, 0))
        ix._seg, ix._seg_df, ix._n_live, ix._total_len = seg, seg.df(), n, int(doc_len.sum())
        ix._live[:n] = True
        ix._where[:n] = _SEG
        ix._doc_len[:n] = doc_len
        delta_files.restore(ix, d)  # (the chunks added after the segment's, when the snapshot kept its delta)
        return ix

    # -- scoring --------------------------------------------------------------------
    def score(self, slots: np.ndarray, terms: Sequence[str], idf: np.ndarray, avgdl: float, k1: float = 1.5,
              b: float = 0.75) -> np.ndarray:
        """BM25 scores of exactly the given chunks.

        Per query term position ``i`` in order (repeats count again), as
        ``rank_bm25.BM25Okapi.get_scores``::

            score += idf[i] * (tf * (k1+1) / (tf + k1 * (1 - b + b * doc_len / avgdl)))

        Args:
            slots: int64 ``[M]`` live slots (any order, duplicates allowed).
            terms: query tokens ``[T]``.
            idf: float64 ``[T]`` global idf per query position (``CorpusStats.query_idf``).
            avgdl: global average chunk length in tokens (``CorpusStats.avgdl``).
                ``0.0`` -> all scores 0 (no division).
            k1, b: BM25 parameters.

        Returns:
            float64 ``[M]`` aligned with ``slots``.

        Raises:
            KeyError: some slot is not live.
            ValueError: ``len(idf) != len(terms)``; ``avgdl`` negative/NaN/inf.
            TypeError: ``slots`` is not an integer array.
        """
        s = check_slots(slots, self._live)
        idf = check_query(terms, idf)
        if s.size == 0 or not check_avgdl(avgdl):
            return np.zeros(s.shape, dtype=np.float64)
        # the segment's postings in one compiled pass (kernels.bm25_segment: per chunk the same
        # additions in the same order as rank_bm25); the length part of the denominator,
        # element-wise the same floats rank_bm25 computes, comes back for the delta layers
        from .. import kernels  # noqa: PLC0415 - numba (~170 MB resident) only in processes that score
        from .listed_top import wide_rows  # noqa: PLC0415 - it imports this module
        vocab, seg_df, seg = self._seg.vocab, self._seg_df, self._seg
        tids = np.array([-1 if t is None or not seg_df[t] else t for t in map(vocab.get, terms)], np.int64)
        out, norm = kernels.bm25_segment(s.reshape(-1), self._where, _SEG, self._doc_len, tids, idf, seg.offsets,
                                         seg.slots, seg.tf, float(avgdl), float(k1), float(b), *wide_rows(self, tids))
        out = out.reshape(s.shape)
        self._add_delta_scores(out, s, terms, idf, k1, norm)
        return out

    def _add_delta_scores(self, out: np.ndarray, s: np.ndarray, terms: Sequence[str], idf: np.ndarray,
                          k1: float, norm: np.ndarray) -> None:
        """Add the delta layers' BM25 terms to float64[M] ``out`` for slots int64[M] ``s`` in place
        (``norm``: float64[M], the length part of each chunk's denominator). A chunk is in the
        segment or in one delta layer, so each gets one addition per term, in term order."""
        layers = [(d, c) for d, c in self._delta_layers() if d.n]  # live postings
        for i, t in enumerate(terms):
            for layer, code in layers:
                a = layer.arrays(t, self._where, code)
                if a is None:
                    continue
                ps, ptf = a
                pos = ps.searchsorted(s)
                np.minimum(pos, len(ps) - 1, out=pos)
                hit = np.flatnonzero(ps[pos] == s)
                if hit.size:
                    tf = ptf[pos[hit]]
                    out[hit] += idf[i] * (tf * (k1 + 1) / (tf + norm[hit]))

    def score_all(
        self,
        terms: Sequence[str],
        idf: np.ndarray,
        avgdl: float,
        k1: float = 1.5,
        b: float = 0.75,
    ) -> tuple[np.ndarray, np.ndarray]:
        """BM25 scores of every live chunk containing at least one query term.

        Only the postings lists of the query terms are visited (cost proportional to
        the sum of their lengths, plus ``O(capacity)`` when the dense accumulator is
        chosen).  Each chunk's score is accumulated in query-term order, so it equals
        ``rank_bm25``'s ``get_scores`` value for that chunk; every chunk not returned
        has score exactly 0 there.  A returned chunk may still score 0 (query term with
        idf 0) or negative (negative epsilon floor).

        Args:
            terms, idf, avgdl, k1, b: as in :meth:`score`.

        Returns:
            ``(slots int64 [K] ascending, scores float64 [K])``; both empty when no
            live chunk contains a query term, or when ``avgdl == 0``.

        Raises:
            ValueError: ``len(idf) != len(terms)``; ``avgdl`` negative/NaN/inf.
        """
        idf = check_query(terms, idf)
        if not check_avgdl(avgdl):
            return _EMPTY_I64.copy(), _EMPTY_F64.copy()
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        for i, t in enumerate(terms):
            a = self._term_arrays(t)
            if a is None:
                continue
            ps, ptf = a
            contrib = idf[i] * (
                ptf * (k1 + 1) / (ptf + k1 * (1 - b + b * self._doc_len[ps] / avgdl))
            )
            parts.append((ps, contrib))
        if not parts:
            return _EMPTY_I64.copy(), _EMPTY_F64.copy()
        if len(parts) == 1:
            return parts[0][0].copy(), parts[0][1]
        return accumulate(parts, len(self._live), self._DENSE_RATIO)

    def __repr__(self) -> str:
        return f"PostingsIndex(chunks={len(self)}, segment_terms={len(self._seg.terms)}, delta_terms={len(self._delta.terms)})"

