"""The mutable part of a shard's BM25 postings (chunks added since the last merge) and the
per-chunk summation of term contributions shared by the segment and the delta.

The delta holds its postings as sorted numpy *runs* (one per added batch, merged pairwise
like a binary counter so there are O(log n) of them), with its own append-only term
dictionary: a term gets its delta term id when a batch is added, not during the merge.

See :mod:`oprag_server.index.bm25` for the reference computation.
"""

from __future__ import annotations

import itertools
import sys
from typing import Sequence

import numpy as np

from ..kernels_delta import batch_postings, first_missing, merge_runs

_SHIFT = np.int64(32)
_LOW = np.int64(0xFFFFFFFF)


def intern(vocab: dict[str, int], terms: list[str], t: str) -> int:
    """The id of term ``t`` in ``vocab`` (term -> id, ids ``0..len(terms)-1`` with ``terms`` their
    strings), added as the next id when new."""
    tid = vocab.get(t)
    if tid is None:
        tid = vocab[t] = len(terms)
        terms.append(t)
    return tid


class Delta:
    """Chunks added since the last merge.

    * ``vocab`` ``{term: tid}`` / ``terms`` ``[tid] -> term``: the delta's own term ids;
    * ``runs``: list of ``(key int64 [n] ascending, tf int32 [n])`` (12 bytes a posting) with
      ``key = tid << 32 | slot`` (postings of removed chunks stay until runs merge; the
      caller filters them with its per-slot location array);
    * ``docs`` ``{slot: tids int64 [k]}``: the live chunks and their distinct term ids;
    * ``df_arr`` int64 ``[>= len(terms)]``: live chunks per term id; ``n``: live postings.

    Runs are immutable once built, so a frozen delta can be read by a merge thread while the
    owner keeps removing chunks (``docs``, ``df_arr``, ``n`` change; ``runs`` do not).
    """

    __slots__ = ("vocab", "terms", "runs", "docs", "df_arr", "n", "dead", "_cache", "_terms_bytes", "_docs_bytes",
                 "_g2d")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.terms: list[str] = []
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.docs: dict[int, np.ndarray] = {}
        self.df_arr = np.zeros(64, np.int64)
        self.n = 0
        self.dead: set[int] = set()  # removed slots whose postings are still in a run
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._terms_bytes = (0, 0)  # (terms counted, sys.getsizeof of them): terms only grow
        self._docs_bytes = 0  # sum of docs' array bytes + 100 per entry, kept as they change
        self._g2d = np.zeros(0, np.int64)  # shard-wide term id (..term_ids.TermTable) -> delta tid, -1 unknown

    def add_batch(self, slots: Sequence[int], token_lists: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """Add chunks (the caller checks they are new and their slots < 2**31).

        :param slots: ``[B]`` slots. :param token_lists: ``[B]`` analysed tokens per chunk.
        :returns: ``(tids int64 [U], df int64 [U])``: the batch's distinct term ids and how
            many of its chunks hold each (for the caller's corpus statistics).
        """
        vocab = self.vocab
        sd = vocab.setdefault
        flat = [sd(t, len(vocab)) for toks in token_lists for t in toks]
        if len(vocab) > len(self.terms):  # the new terms are the dict's last keys: O(new), not O(vocabulary)
            self.terms.extend(list(itertools.islice(reversed(vocab), len(vocab) - len(self.terms)))[::-1])
        lens = np.fromiter(map(len, token_lists), np.int64, count=len(token_lists))
        return self._add_tids(slots, np.asarray(flat, np.int64), lens)

    def add_ids(self, slots: Sequence[int], gids: np.ndarray, lens: np.ndarray, table) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`add_batch` with the tokens as shard-wide term ids: ``gids`` int64 ``[sum(lens)]``
        of :class:`..term_ids.TermTable` ``table``, row after row, ``lens`` int64 ``[B]``. The delta
        term ids are the ones :meth:`add_batch` gives the same tokens (new terms numbered in the
        order of their first occurrence), so both build the same delta."""
        g2d = self._g2d
        if g2d.size < len(table):
            g2d = self._g2d = np.concatenate([g2d, np.full(max(len(table), 2 * g2d.size) - g2d.size, -1, np.int64)])
        tids = g2d[gids]
        if (tids < 0).any():
            vocab, terms = self.vocab, self.terms
            for g in first_missing(g2d, gids).tolist():  # in order of first occurrence
                g2d[g] = intern(vocab, terms, table.term(g))
            tids = g2d[gids]
        return self._add_tids(slots, tids, np.asarray(lens, np.int64))

    def _add_tids(self, slots: Sequence[int], flat: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.dead and not self.dead.isdisjoint(slots):
            self._purge(self.dead.intersection(slots))
        s = np.asarray(slots, np.int64)
        if s.size and bool(np.all(s[1:] > s[:-1])) and (flat.size == 0 or int(flat.max()) < len(self.terms)):
            return self._add_rows(s, flat, lens)  # (compiled: the same runs, docs and df)
        return self._add_np(s, flat, lens)

    def _add_np(self, s: np.ndarray, flat: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = (flat << _SHIFT) | np.repeat(s, lens)
        ukey, tf = np.unique(key, return_counts=True)  # sorted by (tid, slot)
        self._push(ukey, tf.astype(np.int32))
        utid = ukey >> _SHIFT
        uslot = ukey & _LOW
        # per chunk: its distinct term ids (chunk order = slot order of a stable sort)
        order = np.argsort(uslot, kind="stable")
        by_slot = uslot[order]
        cut = np.flatnonzero(np.diff(by_slot)) + 1
        starts = np.concatenate([[0], cut]) if by_slot.size else np.zeros(0, np.int64)
        held = by_slot[starts].tolist()
        docs = self.docs
        for sl, part in zip(held, np.split(utid[order], cut) if by_slot.size else ()):
            docs[sl] = part
        empty = np.zeros(0, np.int64)
        for sl in s.tolist():
            if sl not in docs:
                docs[sl] = empty
        u, c = np.unique(utid, return_counts=True)
        return self._counted(u, c, int(ukey.size), int(s.size))

    def _add_rows(self, s: np.ndarray, flat: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_add_tids` for strictly ascending slots, by :func:`..kernels_delta.batch_postings`."""
        T = len(self.terms)
        row_off, row_tid, key, tf, df = batch_postings(flat, lens, s, T)
        self._push(key, tf)
        docs = self.docs
        for sl, a, b in zip(s.tolist(), row_off[:-1].tolist(), row_off[1:].tolist()):
            docs[sl] = row_tid[a:b]
        u = np.flatnonzero(df)
        return self._counted(u, df[u], int(key.size), int(s.size))

    def _counted(self, u: np.ndarray, c: np.ndarray, postings: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
        """A batch's bookkeeping, shared by both add paths: document frequencies (delta term ids
        ``u`` held by ``c`` more chunks), posting count, bytes, and the per-term lists' cache
        dropped. :returns: ``(u, c)``."""
        T = len(self.terms)
        if self.df_arr.size < T:
            grown = np.zeros(max(T, 2 * self.df_arr.size), np.int64)
            grown[: self.df_arr.size] = self.df_arr
            self.df_arr = grown
        self.df_arr[u] += c
        self.n += postings
        self._docs_bytes += 8 * postings + 100 * slots  # (the slots are new here)
        self._cache.clear()
        return u, c

    def _push(self, key: np.ndarray, tf: np.ndarray) -> None:
        runs = self.runs
        runs.append((key, tf))
        while len(runs) >= 2 and runs[-1][0].size * 2 >= runs[-2][0].size:
            (k2, t2), (k1, t1) = runs.pop(), runs.pop()
            runs.append(_merge_runs(k1, t1, k2, t2))

    def _purge(self, slots: set[int]) -> None:
        """Drop the stale postings of ``slots`` from every run (a slot re-added in this delta)."""
        sl = np.fromiter(slots, np.int64, count=len(slots))
        self.runs = [(k[m], t[m]) for k, t in self.runs for m in [~np.isin(k & _LOW, sl)]]
        self.dead -= slots

    def remove(self, slot: int) -> np.ndarray | None:
        """Remove chunk ``slot``. :returns: its distinct term ids, None if it is not here."""
        tids = self.docs.pop(slot, None)
        if tids is None:
            return None
        self.df_arr[tids] -= 1
        self.n -= int(tids.size)
        self._docs_bytes -= tids.nbytes + 100
        self.dead.add(slot)
        self._cache.clear()
        return tids

    def nbytes(self) -> int:
        """Bytes of the runs, the per-term df and the per-chunk term ids (arrays only, plus
        ~100 bytes per chunk entry; the entries' sum is kept as they change: summing them per
        Stats, i.e. after every commit, cost ~1% of a shard's bulk load, issue 13)."""
        return sum(k.nbytes + t.nbytes for k, t in self.runs) + self.df_arr.nbytes + self._docs_bytes

    def terms_nbytes(self) -> int:
        """``sys.getsizeof`` of the vocabulary dict, the term list and every term string;
        counted incrementally (Stats after every commit summed every term anew: 5% of a shard's
        ingest time at 60K chunks, issue 13)."""
        done, total = self._terms_bytes
        if done < len(self.terms):
            total += sum(map(sys.getsizeof, itertools.islice(self.terms, done, None)))
            self._terms_bytes = done, total = len(self.terms), total
        return sys.getsizeof(self.vocab) + sys.getsizeof(self.terms) + total

    def df(self, term: str) -> int:
        """Live chunks of the delta containing ``term``."""
        tid = self.vocab.get(term)
        return 0 if tid is None else int(self.df_arr[tid])

    def df_items(self):
        """``(term, df)`` for every term with live postings here."""
        nz = np.flatnonzero(self.df_arr[: len(self.terms)])
        terms = self.terms
        return [(terms[i], c) for i, c in zip(nz.tolist(), self.df_arr[nz].tolist())]

    def consolidated(self) -> tuple[np.ndarray, np.ndarray]:
        """All postings of every run (dead ones included) as one ``(key, tf)`` sorted by key."""
        if not self.runs:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        k, t = self.runs[0]
        for k2, t2 in self.runs[1:]:
            k, t = _merge_runs(k, t, k2, t2)
        return k, t

    def arrays(self, term: str, where: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(slots int64 ascending, tf float64)`` of ``term``'s live postings (those whose
        slot has ``where[slot] == layer``); None when no live chunk has it."""
        a = self._cache.get(term)
        if a is not None:
            return a if a[0].size else None
        tid = self.vocab.get(term)
        if tid is None or not self.df_arr[tid]:
            return None
        lo_k, hi_k = np.int64(tid) << _SHIFT, np.int64(tid + 1) << _SHIFT
        ss, ts = [], []
        for k, t in self.runs:
            lo, hi = k.searchsorted(lo_k), k.searchsorted(hi_k)
            if hi > lo:
                ss.append(k[lo:hi] & _LOW)
                ts.append(t[lo:hi])
        s = np.concatenate(ss) if len(ss) > 1 else ss[0]
        tf = np.concatenate(ts) if len(ts) > 1 else ts[0]
        m = where[s] == layer
        s, tf = s[m], tf[m].astype(np.float64)
        if len(ss) > 1:
            order = np.argsort(s, kind="stable")
            s, tf = s[order], tf[order]
        self._cache[term] = (s, tf)
        return (s, tf) if s.size else None


def _merge_runs(k1, t1, k2, t2):
    """One run of two (:func:`..kernels_delta.merge_runs`: a stable argsort's order, linear)."""
    dt = np.result_type(t1, t2)  # (the concatenation's type)
    return merge_runs(np.asarray(k1, np.int64), t1.astype(dt, copy=False), np.asarray(k2, np.int64),
                      t2.astype(dt, copy=False))


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
