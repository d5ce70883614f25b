"""Compiled passes of the BM25 delta's batch add (:meth:`.bm25.delta.Delta.add_ids`; issue 13,
ingest): the batch's new terms in order of first occurrence, and a batch's postings built row by
row (distinct terms by a last-row mark) with a counting sort by term id instead of sorting every token of the
batch twice (three linear passes), and two sorted runs merged in one linear pass. The results are exactly those of the numpy path they replace (unit-tested)."""

from __future__ import annotations

import numpy as np
from numba import njit

from . import kernels  # noqa: F401 - sets numba's cache directory as the kernels do

_JIT = dict(cache=True, nogil=True)


@njit(**_JIT)
def first_missing(g2d, gids):
    """The distinct ``g`` of ``gids`` with ``g2d[g] < 0``, in order of first occurrence (int64;
    ``g2d`` is marked while scanning and restored)."""
    out = np.empty(gids.size, np.int64)
    k = 0
    for g in gids:
        if g2d[g] == -1:
            g2d[g] = -2
            out[k] = g
            k += 1
    for j in range(k):
        g2d[out[j]] = -1
    return out[:k]


@njit(**_JIT)
def batch_postings(flat, lens, slots, n_terms):
    """Postings of a batch: ``flat`` int64 term ids row after row, ``lens`` [B] tokens per row,
    ``slots`` [B] strictly ascending, every id < ``n_terms``.

    :returns: ``(row_off [B+1], row_tid, key, tf, df)``: row ``r``'s distinct term ids ascending
        are ``row_tid[row_off[r]:row_off[r+1]]``; ``key`` (``tid << 32 | slot``, ascending) and
        int32 ``tf`` the batch's postings; ``df`` [n_terms] the rows holding each term."""
    B = lens.size
    row_off = np.empty(B + 1, np.int64)
    row_off[0] = 0
    row_tid = np.empty(flat.size, np.int64)  # first the rows' distinct ids in order of occurrence
    row_tf = np.empty(flat.size, np.int32)
    start = np.zeros(n_terms + 1, np.int64)
    last = np.full(n_terms, -1, np.int64)  # the last row that held a term, and where
    at = np.empty(n_terms, np.int64)
    a = 0
    u = 0
    for r in range(B):  # each row's distinct terms and their tf: one pass, no sort
        for i in range(a, a + lens[r]):
            t = flat[i]
            if last[t] == r:
                row_tf[at[t]] += 1
            else:
                last[t] = r
                at[t] = u
                row_tid[u] = t
                row_tf[u] = 1
                start[t + 1] += 1
                u += 1
        a += lens[r]
        row_off[r + 1] = u
    df = start[1:].copy()
    for t in range(n_terms):
        start[t + 1] += start[t]
    key = np.empty(u, np.int64)
    tf = np.empty(u, np.int32)
    krow = np.empty(u, np.int64)
    for r in range(B):  # counting sort by term id; rows in slot order: slot-ascending per term
        s = slots[r]
        for i in range(row_off[r], row_off[r + 1]):
            t = row_tid[i]
            p = start[t]
            start[t] = p + 1
            key[p] = (t << 32) | s
            tf[p] = row_tf[i]
            krow[p] = r
    fill = row_off[:-1].copy()
    for p in range(u):  # back to rows, now each row's ids ascending
        r = krow[p]
        row_tid[fill[r]] = key[p] >> 32
        fill[r] += 1
    return row_off, row_tid[:u], key, tf, df


@njit(**_JIT)
def merge_runs(k1, t1, k2, t2):
    """Two runs (keys ascending) as one, keys ascending, ``k1``'s first among equal keys: what a
    stable argsort of the concatenation gives, in one linear pass."""
    n1, n2 = k1.size, k2.size
    k = np.empty(n1 + n2, np.int64)
    t = np.empty(n1 + n2, t1.dtype)
    i = j = 0
    for p in range(n1 + n2):
        if j >= n2 or (i < n1 and k1[i] <= k2[j]):
            k[p] = k1[i]
            t[p] = t1[i]
            i += 1
        else:
            k[p] = k2[j]
            t[p] = t2[j]
            j += 1
    return k, t


def warm() -> None:
    """Compile (or load from numba's cache) both passes once per process."""
    first_missing(np.full(4, -1, np.int64), np.array([1, 0, 1], np.int64))
    batch_postings(np.array([1, 0, 1], np.int64), np.array([2, 1], np.int64), np.array([3, 5], np.int64), 2)
    merge_runs(np.array([1, 4], np.int64), np.array([1, 2], np.int32), np.array([2], np.int64), np.array([3], np.int32))
