"""The UTF-8 bytes of a search reply's carried fields in two compiled calls (issue 13 hot path,
shard side): :meth:`..shards.fields.StoredFields.hit_utf8` for rows of one stored part whose
four string columns (doc_id, title, text, metadata) are single Arrow arrays without nulls. The
same bytes and lengths as the per-row memoryview slices it replaces (:meth:`..shards.strcols.
StrColumn.utf8`, tested against it): each value's bytes as stored, column after column, an empty
metadata value read as ``{}``."""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from numba import njit  # noqa: E402

from .warm_inputs import read_only  # noqa: E402 - (fields.py passes its columns through it)

#: what an empty metadata value reads as (``StoredFields.hit_fields``: missing metadata is ``"{}"``)
META_NONE = np.frombuffer(b"{}", np.uint8)


@njit(cache=True, nogil=True)
def one_part(slots, part, row):
    """``(p, rows int64[M])`` for slots int64[M] all stored in part ``p`` (``part`` int32[S]: slot
    -> part, -1 when absent; ``row``: slot -> row in its part); ``p`` -1 when they are not all in
    one part (rows then empty), -2 when a slot is out of range or not stored."""
    m = slots.size
    rows = np.empty(m, np.int64)
    p = -1
    for i in range(m):
        s = slots[i]
        if s < 0 or s >= part.size or part[s] < 0:
            return -2, rows[:0]
        if i == 0:
            p = part[s]
        elif part[s] != p:
            p = -3
        rows[i] = row[s]
    return (p, rows) if p >= 0 else (-1, rows[:0])


@njit(cache=True, nogil=True)
def _lens(rows, off, nn, lens, base):
    t = 0
    for p in range(rows.size):
        n = off[rows[p] + 1] - off[rows[p]]
        n = n if n > 0 else nn
        lens[base + p] = n
        t += n
    return t


@njit(cache=True, nogil=True)
def _copy(rows, off, data, none, out, pos):
    for p in range(rows.size):
        i, j = off[rows[p]], off[rows[p] + 1]
        if j > i:
            out[pos: pos + (j - i)] = data[i:j]
            pos += j - i
        else:
            out[pos: pos + none.size] = none
            pos += none.size
    return pos


@njit(cache=True, nogil=True)
def gather4(rows, o0, d0, o1, d1, o2, d2, o3, d3, none3):
    """``(bytes uint8[T], lengths int64[4 M])``: for rows int64[M] of four string columns
    (value offsets ``oK`` int32 / int64[N + 1] into UTF-8 bytes ``dK`` uint8), every value of
    column 0, then of 1, 2 and 3, back to back; an empty value of column 3 reads as ``none3``."""
    m = rows.size
    lens = np.empty(4 * m, np.int64)
    empty = none3[:0]
    t = (_lens(rows, o0, 0, lens, 0) + _lens(rows, o1, 0, lens, m) + _lens(rows, o2, 0, lens, 2 * m)
         + _lens(rows, o3, none3.size, lens, 3 * m))
    out = np.empty(t, np.uint8)
    pos = _copy(rows, o0, d0, empty, out, 0)
    pos = _copy(rows, o1, d1, empty, out, pos)
    pos = _copy(rows, o2, d2, empty, out, pos)
    _copy(rows, o3, d3, none3, out, pos)
    return out, lens


def warm() -> None:
    """Compile (or load from the cache) :func:`one_part` and :func:`gather4` for the types a shard
    passes (int32 and int64 offsets, read-only bytes)."""
    d = np.frombuffer(b"ab{}", np.uint8)
    rows = np.zeros(1, np.int64)
    one_part(rows, np.zeros(1, np.int32), np.zeros(1, np.int32))
    for dt in (np.int32, np.int64):
        o = read_only(np.array([0, 2], dt))
        gather4(rows, o, d, o, d, o, d, o, d, META_NONE)
