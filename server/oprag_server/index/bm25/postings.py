"""BM25 (Okapi variant of ``rank_bm25`` 0.2.2) over sharded, mutable postings.

Reference implementation: ``rank_bm25.BM25Okapi`` 0.2.2 (``rank_bm25.py``):

* ``BM25._initialize``: ``doc_len[d] = len(document)`` (tokens), ``avgdl = sum(doc_len)
  / corpus_size``, ``nd[term]`` = number of documents containing ``term``.
* ``BM25Okapi._calc_idf``: ``idf(t) = log(N - df + 0.5) - log(df + 0.5)`` (natural log)
  for every corpus term; ``average_idf = sum(idf over all corpus terms, negative ones
  included, before flooring) / number of distinct corpus terms``; every term with
  ``idf < 0`` is then replaced by ``epsilon * average_idf``.  ``idf == 0`` (a term in
  exactly half the documents) is NOT floored.
* ``BM25Okapi.get_scores``: for each query token ``q`` *in query order* (a repeated
  token is counted each time)::

      score += idf(q) * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * doc_len / avgdl)))

  with ``idf(q) = 0`` for tokens that are not in the corpus.  Defaults ``k1=1.5,
  b=0.75, epsilon=0.25``.

This module splits that computation:

* :class:`CorpusStats` -- the frontend's corpus-global view (``N``, total length,
  document frequencies), aggregated over shards, producing :meth:`CorpusStats.query_idf`
  and :attr:`CorpusStats.avgdl`.
* :class:`PostingsIndex` -- one per shard; term -> (slot, tf) postings plus document
  lengths; scores chunks given the global idf vector and avgdl.

With the same corpus, ``PostingsIndex.score`` reproduces ``get_scores`` bit-for-bit in
practice (same operation order; the only difference is ``average_idf`` being summed with
numpy's pairwise summation instead of a sequential Python loop, a ~1e-16 relative
difference that only reaches scores through ``epsilon * average_idf``).

Deliberate deviations (``rank_bm25`` raises or produces NaN there):

* Empty corpus / corpus without any term: ``rank_bm25`` raises ``ZeroDivisionError``
  (``avgdl = 0 / 0`` or ``idf_sum / len(idf) = x / 0``).  Here ``avgdl == 0.0``,
  ``average_idf == 0.0``, every idf is 0 and every score is 0 (``score`` returns zeros,
  ``score_all`` returns empty arrays).
* ``avgdl == 0`` passed to the scoring functions: the result is all zeros / empty
  (a corpus whose chunks are all empty contains no term, so every ``tf`` is 0 anyway);
  no division is performed, so there is no NaN and no warning.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "okapi_idf",
    "okapi_idf_floor",
    "okapi_term_weight",
    "CorpusStats",
    "PostingsIndex",
]

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_F64 = np.zeros(0, dtype=np.float64)


# ----------------------------------------------------------------------------------
# Pure formulas
# ----------------------------------------------------------------------------------
def okapi_idf(n_docs: int, df: np.ndarray) -> np.ndarray:
    """Okapi idf ``log(N - df + 0.5) - log(df + 0.5)`` (natural log), element-wise.

    Source: ``rank_bm25.BM25Okapi._calc_idf`` (0.2.2), before the epsilon floor.

    Args:
        n_docs: ``N``, number of documents in the corpus (>= 0).
        df: document frequencies, any integer or float array-like of shape ``[T]``,
            each in ``[0, n_docs]``.

    Returns:
        ``np.ndarray`` float64 ``[T]``.  Negative when ``df > N/2``, 0 when
        ``df == N/2``.

    Raises:
        ValueError: ``n_docs < 0`` or some ``df`` outside ``[0, n_docs]``.
    """
    d = np.asarray(df, dtype=np.float64)
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    if d.size and (d.min() < 0 or d.max() > n_docs):
        raise ValueError("df values must lie in [0, n_docs]")
    return np.log(n_docs - d + 0.5) - np.log(d + 0.5)


def okapi_idf_floor(idf: np.ndarray, average_idf: float, epsilon: float) -> np.ndarray:
    """Epsilon floor: ``idf < 0`` -> ``epsilon * average_idf``; other values unchanged.

    Source: ``rank_bm25.BM25Okapi._calc_idf`` (0.2.2).  Note the floor can itself be
    negative when ``average_idf < 0`` (e.g. a corpus where every term is in every doc).

    Args:
        idf: float64 ``[T]`` raw idf values.
        average_idf: mean raw idf over all distinct corpus terms.
        epsilon: floor factor (rank_bm25 default 0.25).

    Returns:
        float64 ``[T]`` (a new array).
    """
    idf = np.asarray(idf, dtype=np.float64)
    return np.where(idf < 0, epsilon * average_idf, idf)


def okapi_term_weight(
    tf: np.ndarray, doc_len: np.ndarray, avgdl: float, k1: float, b: float
) -> np.ndarray:
    """BM25 saturation ``tf*(k1+1) / (tf + k1*(1 - b + b*doc_len/avgdl))`` element-wise.

    Source: ``rank_bm25.BM25Okapi.get_scores`` (0.2.2), same operation order (so the
    values are bit-identical to rank_bm25's).  The score contribution of one query term
    is ``idf * okapi_term_weight(...)``.

    Args:
        tf: term frequency in each document, float64/int ``[M]`` (>= 0).
        doc_len: document length in tokens, float64/int ``[M]``.
        avgdl: average document length in tokens (> 0).
        k1, b: BM25 parameters (rank_bm25 defaults 1.5, 0.75).

    Returns:
        float64 ``[M]``; 0 where ``tf == 0``.

    Raises:
        ValueError: ``avgdl <= 0`` or not finite (rank_bm25 would produce NaN/inf).
    """
    if not (avgdl > 0 and math.isfinite(avgdl)):
        raise ValueError(f"avgdl must be a finite positive number, got {avgdl}")
    tf = np.asarray(tf, dtype=np.float64)
    doc_len = np.asarray(doc_len, dtype=np.float64)
    return tf * (k1 + 1) / (tf + k1 * (1 - b + b * doc_len / avgdl))


def _check_avgdl(avgdl: float) -> bool:
    """True if scoring should proceed, False if avgdl == 0 (all scores 0)."""
    avgdl = float(avgdl)
    if avgdl == 0.0:
        return False
    if not (avgdl > 0 and math.isfinite(avgdl)):
        raise ValueError(f"avgdl must be finite and >= 0, got {avgdl}")
    return True


# ----------------------------------------------------------------------------------
# Corpus-global statistics (frontend)
# ----------------------------------------------------------------------------------
class CorpusStats:
    """Corpus-global BM25 statistics aggregated over all shards.

    Attributes:
        n_docs: ``N``, number of live documents (chunks), int >= 0.
        total_len: sum of document lengths in tokens, int >= 0.
        df: ``dict[str, int]`` term -> number of live documents containing it; only
            terms with ``df > 0`` are present.
        version: int, incremented on every change (used to cache ``average_idf``).

    Keep it in sync with shards either by feeding every shard's
    :meth:`PostingsIndex.drain_delta` into :meth:`apply_delta`, or by rebuilding with
    :meth:`merge_full` from every shard's :meth:`PostingsIndex.full_stats`.
    Not thread-safe: guard with a lock if updated and queried concurrently.
    """

    __slots__ = ("n_docs", "total_len", "df", "version", "_avg_cache")

    def __init__(
        self, n_docs: int = 0, total_len: int = 0, df: dict[str, int] | None = None
    ) -> None:
        """Build from totals.

        Raises:
            ValueError: negative ``n_docs``/``total_len``, or a ``df`` value outside
                ``[0, n_docs]`` (zero entries are dropped).
        """
        if n_docs < 0 or total_len < 0:
            raise ValueError("n_docs and total_len must be >= 0")
        self.n_docs = int(n_docs)
        self.total_len = int(total_len)
        self.df: dict[str, int] = {}
        for t, v in (df or {}).items():
            v = int(v)
            if v < 0 or v > self.n_docs:
                raise ValueError(f"df[{t!r}]={v} outside [0, n_docs={self.n_docs}]")
            if v:
                self.df[t] = v
        self.version = 0
        self._avg_cache: tuple[int, float] | None = None

    @classmethod
    def merge_full(cls, snapshots: Iterable[tuple[int, int, dict[str, int]]]) -> "CorpusStats":
        """Sum shard snapshots ``(n_docs, total_len, df)`` (from ``full_stats()``).

        Raises:
            ValueError: as the constructor (inconsistent totals).
        """
        n = 0
        tl = 0
        df: dict[str, int] = {}
        for sn, stl, sdf in snapshots:
            n += int(sn)
            tl += int(stl)
            for t, v in sdf.items():
                df[t] = df.get(t, 0) + int(v)
        return cls(n, tl, df)

    def replace_with(self, other: "CorpusStats") -> None:
        """Take ``other``'s totals in place (holders of this object see the new state)."""
        self.n_docs, self.total_len, self.df = other.n_docs, other.total_len, dict(other.df)
        self.version += 1
        self._avg_cache = None

    def apply_delta(self, n_delta: int, len_delta: int, df_delta: dict[str, int]) -> None:
        """Add a shard's change set (from :meth:`PostingsIndex.drain_delta`).

        Terms whose df reaches 0 are dropped.  ``version`` is incremented unless the
        delta is empty.  The update is atomic: on error nothing is changed.

        Raises:
            ValueError: the result would make ``n_docs``, ``total_len`` or some ``df``
                negative (the delta does not belong to this corpus).
        """
        n_delta = int(n_delta)
        len_delta = int(len_delta)
        if not n_delta and not len_delta and not any(df_delta.values()):
            return
        new_n = self.n_docs + n_delta
        new_len = self.total_len + len_delta
        if new_n < 0 or new_len < 0:
            raise ValueError("delta makes n_docs or total_len negative")
        df = self.df
        updates: list[tuple[str, int]] = []
        for t, d in df_delta.items():
            if not d:
                continue
            v = df.get(t, 0) + int(d)
            if v < 0:
                raise ValueError(f"delta makes df[{t!r}] negative")
            updates.append((t, v))
        for t, v in updates:
            if v:
                df[t] = v
            else:
                df.pop(t, None)
        self.n_docs = new_n
        self.total_len = new_len
        self.version += 1

    @property
    def avgdl(self) -> float:
        """Average document length in tokens, ``total_len / n_docs``; 0.0 if empty."""
        return self.total_len / self.n_docs if self.n_docs else 0.0

    @property
    def average_idf(self) -> float:
        """Mean raw Okapi idf over all distinct corpus terms (negative ones included).

        Source: ``rank_bm25.BM25Okapi._calc_idf``.  0.0 when there is no term (rank_bm25
        raises ``ZeroDivisionError``).  Cached per :attr:`version`; recomputed
        vectorised (O(#terms)) only after a change.
        """
        c = self._avg_cache
        if c is not None and c[0] == self.version:
            return c[1]
        if self.df:
            dfs = np.fromiter(self.df.values(), dtype=np.float64, count=len(self.df))
            avg = float(okapi_idf(self.n_docs, dfs).sum() / len(dfs))
        else:
            avg = 0.0
        self._avg_cache = (self.version, avg)
        return avg

    def query_idf(self, terms: Sequence[str], epsilon: float = 0.25) -> np.ndarray:
        """Floored idf of each query term, exactly as ``rank_bm25.BM25Okapi.idf.get(q) or 0``.

        Args:
            terms: query tokens ``[T]`` (repeats allowed; each position gets a value).
            epsilon: floor factor (rank_bm25 default 0.25).

        Returns:
            float64 ``[T]``: ``log(N-df+0.5) - log(df+0.5)`` if that is >= 0,
            ``epsilon * average_idf`` if it is < 0, and 0.0 for terms not in the corpus.
        """
        out = np.zeros(len(terms), dtype=np.float64)
        if not terms or not self.df:
            return out
        n = self.n_docs
        df = self.df
        floor: float | None = None
        for i, t in enumerate(terms):
            f = df.get(t)
            if not f:
                continue
            idf = math.log(n - f + 0.5) - math.log(f + 0.5)
            if idf < 0:
                if floor is None:
                    floor = epsilon * self.average_idf
                idf = floor
            out[i] = idf
        return out

    def snapshot(self) -> tuple[int, int, dict[str, int]]:
        """``(n_docs, total_len, copy of df)``."""
        return self.n_docs, self.total_len, dict(self.df)

    def __eq__(self, other: object) -> bool:
        """Equal totals and df (``version`` is ignored)."""
        if not isinstance(other, CorpusStats):
            return NotImplemented
        return (
            self.n_docs == other.n_docs
            and self.total_len == other.total_len
            and self.df == other.df
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"CorpusStats(n_docs={self.n_docs}, total_len={self.total_len}, "
            f"terms={len(self.df)}, version={self.version})"
        )


# ----------------------------------------------------------------------------------
# Per-shard postings
# ----------------------------------------------------------------------------------
class PostingsIndex:
    """Mutable inverted index of one shard; chunks are identified by int *slots*.

    Storage:
        * ``term -> {slot: tf}`` dicts (O(1) add/remove),
        * per term, a lazily built cache of numpy arrays ``(slots int64 sorted
          ascending, tf float64)``, dropped whenever that term's postings change, so
          deleted slots never appear in results (no tombstones; nothing to compact),
        * dense per-slot arrays ``doc_len float64[capacity]`` and ``live bool[capacity]``
          where ``capacity > max slot ever added`` (slots should therefore be small,
          densely allocated non-negative ints; memory is 9 bytes per slot of capacity).

    Scoring takes the *global* idf vector and avgdl (from :class:`CorpusStats`) so that
    scores from different shards are comparable and equal the single-index rank_bm25
    scores.  Not thread-safe: guard with a lock if mutated and queried concurrently.
    """

    #: ``score_all`` uses a dense accumulator when the number of postings visited is at
    #: least ``capacity / _DENSE_RATIO``, else a sort-based sparse one.
    _DENSE_RATIO = 16

    def __init__(self) -> None:
        self._postings: dict[str, dict[int, int]] = {}
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._doc_terms: dict[int, tuple[str, ...]] = {}
        self._doc_len = np.zeros(0, dtype=np.float64)
        self._live = np.zeros(0, dtype=bool)
        self._total_len = 0
        # pending delta since the last drain_delta()
        self._d_n = 0
        self._d_len = 0
        self._d_df: dict[str, int] = {}

    # -- mutation -------------------------------------------------------------------
    def _grow(self, slot: int) -> None:
        cap = len(self._live)
        if slot < cap:
            return
        new_cap = max(slot + 1, 2 * cap, 64)
        dl = np.zeros(new_cap, dtype=np.float64)
        dl[:cap] = self._doc_len
        lv = np.zeros(new_cap, dtype=bool)
        lv[:cap] = self._live
        self._doc_len = dl
        self._live = lv

    def add(self, slot: int, tokens: Sequence[str]) -> None:
        """Index chunk ``slot`` with analysed ``tokens`` (its length is ``len(tokens)``).

        An empty token list is allowed (a live chunk of length 0 that matches nothing,
        counted in ``N`` and avgdl like rank_bm25's empty documents).

        Raises:
            ValueError: ``slot < 0`` or ``slot`` already live (remove it first).
            TypeError: ``slot`` is not an int.
        """
        slot = _as_slot(slot)
        if slot < 0:
            raise ValueError(f"slot must be >= 0, got {slot}")
        if slot in self._doc_terms:
            raise ValueError(f"slot {slot} is already indexed; remove() it first")
        counts = Counter(tokens)
        n_tok = len(tokens)
        self._grow(slot)
        postings = self._postings
        arrays = self._arrays
        d_df = self._d_df
        for t, c in counts.items():
            p = postings.get(t)
            if p is None:
                postings[t] = {slot: c}
            else:
                p[slot] = c
                arrays.pop(t, None)
            d_df[t] = d_df.get(t, 0) + 1
        self._doc_terms[slot] = tuple(counts)
        self._doc_len[slot] = n_tok
        self._live[slot] = True
        self._total_len += n_tok
        self._d_n += 1
        self._d_len += n_tok

    def remove(self, slot: int) -> None:
        """Remove chunk ``slot``.

        Raises:
            KeyError: ``slot`` is not live (never added or already removed); use
                :meth:`discard` for a no-op instead.
        """
        slot = _as_slot(slot)
        terms = self._doc_terms.pop(slot)  # KeyError if absent
        postings = self._postings
        arrays = self._arrays
        d_df = self._d_df
        for t in terms:
            p = postings[t]
            del p[slot]
            if not p:
                del postings[t]
            arrays.pop(t, None)
            d_df[t] = d_df.get(t, 0) - 1
        n_tok = int(self._doc_len[slot])
        self._doc_len[slot] = 0.0
        self._live[slot] = False
        self._total_len -= n_tok
        self._d_n -= 1
        self._d_len -= n_tok

    def discard(self, slot: int) -> bool:
        """Remove ``slot`` if live; return whether it was removed (never raises KeyError)."""
        if _as_slot(slot) in self._doc_terms:
            self.remove(slot)
            return True
        return False

    # -- inspection -----------------------------------------------------------------
    def __len__(self) -> int:
        """Number of live chunks."""
        return len(self._doc_terms)

    def has_slot(self, slot: int) -> bool:
        """True if ``slot`` is live."""
        return slot in self._doc_terms

    @property
    def total_len(self) -> int:
        """Sum of live chunk lengths (tokens)."""
        return self._total_len

    def slots(self) -> np.ndarray:
        """Live slots, int64 ascending."""
        return np.flatnonzero(self._live).astype(np.int64, copy=False)

    def doc_len(self, slots: np.ndarray) -> np.ndarray:
        """Lengths (tokens) of live chunks, float64 with the shape of ``slots``.

        Raises:
            KeyError: some slot is not live.
        """
        s = self._check_slots(slots)
        return self._doc_len[s]

    def df(self, term: str) -> int:
        """Number of live chunks of this shard containing ``term``."""
        p = self._postings.get(term)
        return len(p) if p else 0

    def drain_delta(self) -> tuple[int, int, dict[str, int]]:
        """Changes since the previous call: ``(n_delta, total_len_delta, df_delta)``.

        ``df_delta`` omits terms whose net change is 0.  Feed it to
        :meth:`CorpusStats.apply_delta`.  Resets the pending delta.
        """
        out = (self._d_n, self._d_len, {t: d for t, d in self._d_df.items() if d})
        self._d_n = 0
        self._d_len = 0
        self._d_df = {}
        return out

    def full_stats(self) -> tuple[int, int, dict[str, int]]:
        """Current totals ``(n_docs, total_len, df)`` (does not touch the pending delta)."""
        return (
            len(self._doc_terms),
            self._total_len,
            {t: len(p) for t, p in self._postings.items()},
        )

    # -- scoring --------------------------------------------------------------------
    def _term_arrays(self, term: str) -> tuple[np.ndarray, np.ndarray] | None:
        a = self._arrays.get(term)
        if a is not None:
            return a
        p = self._postings.get(term)
        if not p:
            return None
        n = len(p)
        s = np.fromiter(p.keys(), dtype=np.int64, count=n)
        tf = np.fromiter(p.values(), dtype=np.float64, count=n)
        order = np.argsort(s, kind="stable")
        a = (s[order], tf[order])
        self._arrays[term] = a
        return a

    def _check_slots(self, slots: np.ndarray) -> np.ndarray:
        s = np.asarray(slots)
        if s.size == 0:
            return s.astype(np.int64, copy=False)
        if s.dtype.kind not in "iu":
            raise TypeError(f"slots must be an integer array, got dtype {s.dtype}")
        s = s.astype(np.int64, copy=False)
        cap = len(self._live)
        bad = (s < 0) | (s >= cap)
        if not bad.any():
            bad = ~self._live[s]
        if bad.any():
            raise KeyError(f"slot {int(s[np.argmax(bad)])} is not live")
        return s

    @staticmethod
    def _check_query(terms: Sequence[str], idf: np.ndarray) -> np.ndarray:
        idf = np.asarray(idf, dtype=np.float64)
        if idf.ndim != 1 or len(idf) != len(terms):
            raise ValueError(f"idf must have shape [{len(terms)}], got {idf.shape}")
        return idf

    def score(
        self,
        slots: np.ndarray,
        terms: Sequence[str],
        idf: np.ndarray,
        avgdl: float,
        k1: float = 1.5,
        b: float = 0.75,
    ) -> np.ndarray:
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
        s = self._check_slots(slots)
        idf = self._check_query(terms, idf)
        go = _check_avgdl(avgdl)
        out = np.zeros(s.shape, dtype=np.float64)
        if s.size == 0 or not go:
            return out
        dl = self._doc_len[s]
        for i, t in enumerate(terms):
            a = self._term_arrays(t)
            if a is None:
                continue  # tf == 0 everywhere: rank_bm25 adds exactly 0
            ps, ptf = a
            pos = np.searchsorted(ps, s)
            pos[pos == len(ps)] = 0
            hit = ps[pos] == s
            if not hit.any():
                continue
            tf = np.where(hit, ptf[pos], 0.0)
            out += idf[i] * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)))
        return out

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
        idf = self._check_query(terms, idf)
        if not _check_avgdl(avgdl):
            return _EMPTY_I64.copy(), _EMPTY_F64.copy()
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        total = 0
        for i, t in enumerate(terms):
            a = self._term_arrays(t)
            if a is None:
                continue
            ps, ptf = a
            contrib = idf[i] * (
                ptf * (k1 + 1) / (ptf + k1 * (1 - b + b * self._doc_len[ps] / avgdl))
            )
            parts.append((ps, contrib))
            total += len(ps)
        if not parts:
            return _EMPTY_I64.copy(), _EMPTY_F64.copy()
        if len(parts) == 1:
            return parts[0][0].copy(), parts[0][1]
        cap = len(self._live)
        if total * self._DENSE_RATIO >= cap:
            acc = np.zeros(cap, dtype=np.float64)
            touched = np.zeros(cap, dtype=bool)
            for ps, c in parts:  # slots unique within one term: fancy += is safe
                acc[ps] += c
                touched[ps] = True
            out_s = np.flatnonzero(touched).astype(np.int64, copy=False)
            return out_s, acc[out_s]
        all_s = np.concatenate([p[0] for p in parts])
        all_c = np.concatenate([p[1] for p in parts])
        uniq, inv = np.unique(all_s, return_inverse=True)
        # bincount adds weights in input order (query-term order) starting from 0.0,
        # i.e. the same summation order as rank_bm25.
        scores = np.bincount(inv.reshape(-1), weights=all_c, minlength=len(uniq))
        return uniq.astype(np.int64, copy=False), scores

    def __repr__(self) -> str:
        return f"PostingsIndex(chunks={len(self)}, terms={len(self._postings)})"


def _as_slot(slot: int) -> int:
    if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    return int(slot)
