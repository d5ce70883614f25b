"""The mutable part of a shard's BM25 postings (chunks added since the last merge) and the
per-chunk summation of term contributions shared by the segment and the delta.

See :mod:`oprag_server.index.bm25` for the reference computation.
"""

from __future__ import annotations

import numpy as np


class Delta:
    """Chunks added since the last merge: ``postings`` ``{term: {slot: tf}}`` and ``docs``
    ``{slot: {term: tf}}`` (O(1) add/remove), with a per-term cache of its numpy arrays that
    is dropped whenever the term's postings change. ``n`` counts its postings."""

    __slots__ = ("postings", "docs", "n", "_arrays")

    def __init__(self) -> None:
        self.postings: dict[str, dict[int, int]] = {}
        self.docs: dict[int, dict[str, int]] = {}
        self.n = 0
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, slot: int, counts: dict[str, int]) -> None:
        """Add chunk ``slot`` with its term frequencies (the caller checks it is new)."""
        postings, arrays = self.postings, self._arrays
        for t, c in counts.items():
            p = postings.get(t)
            if p is None:
                postings[t] = {slot: c}
            else:
                p[slot] = c
                arrays.pop(t, None)
        self.docs[slot] = counts
        self.n += len(counts)

    def remove(self, slot: int) -> dict[str, int] | None:
        """Remove chunk ``slot``. :returns: its term frequencies, None if it is not here."""
        counts = self.docs.pop(slot, None)
        if counts is None:
            return None
        postings, arrays = self.postings, self._arrays
        for t in counts:
            p = postings[t]
            del p[slot]
            if not p:
                del postings[t]
            arrays.pop(t, None)
        self.n -= len(counts)
        return counts

    def df(self, term: str) -> int:
        """Chunks of the delta containing ``term``."""
        return len(self.postings.get(term, ()))

    def arrays(self, term: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(slots int64 ascending, tf float64)`` of ``term``; None when no chunk has it."""
        a = self._arrays.get(term)
        if a is not None:
            return a
        p = self.postings.get(term)
        if not p:
            return None
        n = len(p)
        s = np.fromiter(p.keys(), dtype=np.int64, count=n)
        tf = np.fromiter(p.values(), dtype=np.float64, count=n)
        order = np.argsort(s, kind="stable")
        a = (s[order], tf[order])
        self._arrays[term] = a
        return a


def accumulate(parts: list[tuple[np.ndarray, np.ndarray]], cap: int, dense_ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum per-term contributions per chunk, in the order of ``parts`` (query-term order, so the
    sums equal rank_bm25's ``get_scores``, which adds term after term starting from 0.0).

    :param parts: per query term ``(slots int64 [n] unique, contribution float64 [n])``, at
        least two. :param cap: slots are below it. :param dense_ratio: a dense accumulator of
        ``cap`` floats when the postings number at least ``cap / dense_ratio``, else a
        sort-based sparse one.
    :returns: ``(slots int64 [K] ascending, sums float64 [K])``.
    """
    total = sum(len(p[0]) for p in parts)
    if total * dense_ratio >= cap:
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
    # bincount adds weights in input order (query-term order) starting from 0.0
    scores = np.bincount(inv.reshape(-1), weights=all_c, minlength=len(uniq))
    return uniq.astype(np.int64, copy=False), scores
