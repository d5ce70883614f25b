"""Corpus-global BM25 statistics (``N``, total length, document frequencies), kept on the
frontend and aggregated over shards.

See :mod:`oprag_server.index.bm25` for the reference computation.
"""

from __future__ import annotations

import math
from itertools import compress, repeat
from typing import Iterable, Sequence

import numpy as np

from .okapi import okapi_idf


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

    __slots__ = ("n_docs", "total_len", "df", "version", "_avg_cache", "_hist")

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
        self._hist = self._histogram()

    def _histogram(self) -> np.ndarray:
        """int64[max df + 1]: how many terms have each document frequency (:attr:`average_idf` sums over its
        distinct values; kept by :meth:`apply_delta` for the terms it changes)."""
        return np.bincount(np.fromiter(self.df.values(), dtype=np.int64, count=len(self.df)), minlength=1)

    def _moved(self, old: np.ndarray, new: np.ndarray) -> None:
        """The histogram after terms moved from document frequencies int64[T] ``old`` to ``new`` (0: absent)."""
        top = int(max(old.max(initial=0), new.max(initial=0))) + 1
        if top > self._hist.size:
            self._hist = np.concatenate([self._hist, np.zeros(top - self._hist.size, np.int64)])
        size = self._hist.size
        self._hist -= np.bincount(old[old > 0], minlength=size)
        self._hist += np.bincount(new[new > 0], minlength=size)

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
        self._hist = other._hist.copy()

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
        df, k = self.df, len(df_delta)
        # (C-level iteration: old and new counts as arrays; the histogram of counts follows them)
        old = np.fromiter(map(df.get, df_delta, repeat(0)), dtype=np.int64, count=k)
        new = old + np.fromiter(df_delta.values(), dtype=np.int64, count=k)
        if k and new.min() < 0:
            raise ValueError(f"delta makes df[{list(df_delta)[int(np.argmax(new < 0))]!r}] negative")
        keep = new > 0
        if keep.all():  # (only additions, a bulk load: nothing reaches 0)
            df.update(zip(df_delta, new.tolist()))
        else:
            for t in compress(df_delta, ~keep):
                df.pop(t, None)
            df.update(zip(compress(df_delta, keep), new[keep].tolist()))
        self._moved(old, new)
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
        vectorised (O(#terms)) only after a change. The sum runs over the distinct document
        frequencies (each idf times its term count, added exactly: ``math.fsum``), so equal
        statistics give the same bits whatever order the terms were added in (a term deleted
        and added again moved to the end of ``df`` and changed the last bit of a floored idf:
        trial31); within 1e-12 of rank_bm25's running sum (tests).
        """
        c = self._avg_cache
        if c is not None and c[0] == self.version:
            return c[1]
        if self.df:
            if int(self._hist.sum()) != len(self.df):  # (df changed elsewhere than apply_delta: counted again)
                self._hist = self._histogram()
            counts = self._hist
            f = np.flatnonzero(counts)
            avg = math.fsum((counts[f] * okapi_idf(self.n_docs, f.astype(np.float64))).tolist()) / len(self.df)
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
