"""The BM25 postings layout OpRAG used before issue 13 (``dict[term] -> dict[slot, tf]``),
kept verbatim (server commit b717d18, ``server/oprag_server/index/bm25/postings.py``) as the
"before" reference of ``bench/postings.py``. Same API as the server's ``PostingsIndex``.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np



def check_avgdl(avgdl: float) -> bool:
    """(``oprag_server.index.bm25.okapi.check_avgdl``) False when avgdl == 0."""
    avgdl = float(avgdl)
    if avgdl == 0.0:
        return False
    if not avgdl > 0:
        raise ValueError(f"avgdl must be finite and >= 0, got {avgdl}")
    return True

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_F64 = np.zeros(0, dtype=np.float64)


class DictPostingsIndex:
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
            KeyError: ``slot`` is not live (never added or already removed); check
                :meth:`has_slot` first for a no-op instead.
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
        go = check_avgdl(avgdl)
        out = np.zeros(s.shape, dtype=np.float64)
        if s.size == 0 or not go:
            return out
        # the length part of the denominator, element-wise the same floats rank_bm25 computes
        norm = k1 * (1 - b + b * self._doc_len[s] / avgdl)
        for i, t in enumerate(terms):
            a = self._term_arrays(t)
            if a is None:
                continue  # tf == 0 everywhere: rank_bm25 adds exactly 0
            ps, ptf = a
            pos = ps.searchsorted(s)
            np.minimum(pos, len(ps) - 1, out=pos)
            hit = np.flatnonzero(ps[pos] == s)
            if not hit.size:
                continue
            # a chunk without the term gets idf * 0 there, which leaves its sum unchanged
            tf = ptf[pos[hit]]
            out[hit] += idf[i] * (tf * (k1 + 1) / (tf + norm[hit]))
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
        if not check_avgdl(avgdl):
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
