"""BM25 term ids straight from an Arrow batch's ``title`` / ``text`` columns (issue 13, ingest).

:class:`TermTable` gives every distinct analysed token a shard-wide integer id (*gid*), never
reused, and :meth:`TermTable.rows` turns a batch of chunks into ``(gids int64[T], lens int64[R])``:
the gids of each row's tokens in text order, row after row, and each row's token count (its
BM25 length). The tokens are exactly :meth:`.analyzer.Analyzer.tokens` of ``f"{title}\\n{text}"``
(``text`` alone when the title is empty or null), so the postings built from the ids are the
ones built from the strings.

Rows whose title and text are pure ASCII are tokenised by one compiled pass over the column's
bytes (numba): the maximal runs of ``[A-Za-z0-9]``, lower-cased, which is what the analyser's
ASCII path gives (its ``translate`` maps every other ASCII character to a space before
``str.split``); each token is hashed (FNV-1a, 64 bit) and looked up in an open-addressing table
of the terms' bytes, so no Python string is made per token. Other rows (non-ASCII, or every row
with ``stem=True``) go through the analyser; their tokens, joined by spaces (a token never holds
one), are looked up by their UTF-8 bytes in the same table by one compiled pass, so one term has
one gid whichever path met it.

The table only grows (a term that no live chunk holds any more keeps its gid): a few tens of
bytes per distinct term ever seen by the shard.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import kernels  # noqa: F401 - sets numba's cache directory as the kernels do
from .analyzer import Analyzer
from numba import njit

_JIT = dict(cache=True, nogil=True)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
#: byte -> lower-cased byte for [A-Za-z0-9], 0 for every other ASCII byte, 255 for bytes >= 0x80
_CLASS = np.zeros(256, np.uint8)
for _c in range(128):
    _ch = chr(_c)
    if "a" <= _ch <= "z" or "0" <= _ch <= "9":
        _CLASS[_c] = _c
    elif "A" <= _ch <= "Z":
        _CLASS[_c] = ord(_ch.lower())
_CLASS[128:] = 255


@njit(**_JIT)
def _intern(ent, off, pool, n_terms, h, buf, a, b):
    """The gid of the term ``buf[a:b]`` (hash ``h``), added as gid ``n_terms`` when new (the
    caller made room). ``ent`` uint64 ``[size, 4]``: per table entry the hash, gid + 1 (0: empty),
    the term's offset in ``pool`` and its length, so a probe reads one entry and, on a hash
    match, the term's bytes. :returns: (gid, terms after)."""
    mask = ent.shape[0] - 1
    i = np.int64(h & np.uint64(mask))
    n = b - a
    while True:
        g1 = np.int64(ent[i, 1])
        if g1 == 0:
            break
        if ent[i, 0] == h and np.int64(ent[i, 3]) == n:
            o = np.int64(ent[i, 2])
            same = True
            for k in range(n):
                if pool[o + k] != buf[a + k]:
                    same = False
                    break
            if same:
                return g1 - 1, n_terms
        i = (i + 1) & mask
    o = off[n_terms]
    for k in range(n):
        pool[o + k] = buf[a + k]
    off[n_terms + 1] = o + n
    ent[i, 0] = h
    ent[i, 1] = n_terms + 1
    ent[i, 2] = o
    ent[i, 3] = n
    return n_terms, n_terms + 1


@njit(**_JIT)
def _scan(cls, data, start, end, out, n_out, ent, off, pool, n_terms, low):
    """Tokens of ``data[start:end]`` (ASCII) appended to ``out`` from ``n_out``; ``low`` is a
    scratch buffer for the lower-cased token. :returns: (n_out, n_terms), or (-1, n_terms) when
    a byte >= 0x80 is met (the caller drops this row's tokens)."""
    i = start
    while i < end:
        c = cls[data[i]]
        if c == 0:
            i += 1
            continue
        if c == 255:
            return -1, n_terms
        h = _FNV_OFFSET
        n = 0
        while i < end:
            c = cls[data[i]]
            if c == 0:
                break
            if c == 255:
                return -1, n_terms
            low[n] = c
            n += 1
            h = (h ^ np.uint64(c)) * _FNV_PRIME
            i += 1
        g, n_terms = _intern(ent, off, pool, n_terms, h, low, 0, n)
        out[n_out] = g
        n_out += 1
    return n_out, n_terms


@njit(**_JIT)
def _rows(cls, t_off, t_data, x_off, x_data, r0, out, lens, ent, off, pool, n_terms, low, max_terms):
    """The tokens of rows ``r0..`` (title then text) into ``out``; ``lens[r] = -1`` for a row with
    a non-ASCII byte (no tokens emitted for it). Stops before a row that could take the table
    past ``max_terms`` terms or ``out`` past its end (a row of ``n`` bytes has at most
    ``n // 2 + 2`` tokens). :returns: (tokens written, terms after, next row)."""
    n_out = 0
    for r in range(r0, lens.size):
        most = (t_off[r + 1] - t_off[r] + x_off[r + 1] - x_off[r]) // 2 + 2
        if n_terms + most > max_terms or n_out + most > out.size:
            return n_out, n_terms, r
        high = np.uint8(0)  # a byte >= 0x80 anywhere: the analyser's row (no wasted interning)
        for j in range(t_off[r], t_off[r + 1]):
            high |= t_data[j]
        for j in range(x_off[r], x_off[r + 1]):
            high |= x_data[j]
        if high >= 128:
            lens[r] = -1
            continue
        k0 = n_out
        k, n_terms = _scan(cls, t_data, t_off[r], t_off[r + 1], out, n_out, ent, off, pool, n_terms, low)
        if k >= 0:
            k, n_terms = _scan(cls, x_data, x_off[r], x_off[r + 1], out, k, ent, off, pool, n_terms, low)
        if k < 0:
            lens[r] = -1
            n_out = k0
        else:
            lens[r] = k - k0
            n_out = k
    return n_out, n_terms, lens.size


@njit(**_JIT)
def _rehash(old, ent):
    mask = ent.shape[0] - 1
    for j in range(old.shape[0]):
        if old[j, 1]:
            i = np.int64(old[j, 0] & np.uint64(mask))
            while ent[i, 1]:
                i = (i + 1) & mask
            ent[i, :] = old[j, :]


@njit(**_JIT)
def _split(buf, out, ent, off, pool, n_terms):
    """The gids of the space-separated terms of ``buf`` (UTF-8) into ``out``.
    :returns: (gids written, terms after)."""
    n_out = 0
    i = 0
    end = buf.size
    while i < end:
        if buf[i] == 32:
            i += 1
            continue
        a = i
        h = _FNV_OFFSET
        while i < end and buf[i] != 32:
            h = (h ^ np.uint64(buf[i])) * _FNV_PRIME
            i += 1
        g, n_terms = _intern(ent, off, pool, n_terms, h, buf, a, i)
        out[n_out] = g
        n_out += 1
    return n_out, n_terms


def _column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets int64[R+1], bytes uint8)`` of a string column (nulls as empty strings)."""
    col = table.column(name)
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if arr.type != pa.string():
        arr = arr.cast(pa.string())
    if arr.null_count:
        arr = pc.fill_null(arr, "")
    _, ob, db = arr.buffers()
    offs = np.frombuffer(ob, np.int32, count=len(arr) + 1, offset=4 * arr.offset).astype(np.int64)
    data = np.frombuffer(db, np.uint8) if db is not None and db.size else np.zeros(1, np.uint8)
    return offs, data


class TermTable:
    """Shard-wide term ids (see the module docstring). ``stem``: the analyser's stemming (every
    row then goes through the analyser)."""

    #: tokens per compiled pass at most (its output buffer: 8 bytes each)
    BLOCK = 1 << 18

    def __init__(self, stem: bool = False) -> None:
        self.analyzer = Analyzer(stem=stem)
        self.n = 0
        self._ent = np.zeros((1 << 15, 4), np.uint64)  # open addressing, at most half full
        self._off = np.zeros((1 << 14) + 1, np.int64)  # gid -> offset of its bytes in _pool
        self._pool = np.zeros(1 << 20, np.uint8)
        self._low = np.zeros(64, np.uint8)
        self._strs: list[str | None] = []  # gid -> its term as a str, once asked for

    def __len__(self) -> int:
        return self.n

    def nbytes(self) -> int:
        return int(self._ent.nbytes + self._off.nbytes + self._pool.nbytes + self._low.nbytes)

    def _room(self, terms: int, nbytes: int, longest: int) -> None:
        """Make room for ``terms`` more terms of ``nbytes`` more bytes, tokens of ``longest`` bytes."""
        need = self.n + terms
        if need + 1 > self._off.size:
            self._off = np.concatenate([self._off, np.zeros(max(need + 1, 2 * self._off.size) - self._off.size,
                                                            np.int64)])
        if 2 * need > self._ent.shape[0]:
            size = self._ent.shape[0]
            while 2 * need > size:
                size *= 2
            old, self._ent = self._ent, np.zeros((size, 4), np.uint64)
            _rehash(old, self._ent)
        used = int(self._off[self.n])
        if used + nbytes > self._pool.size:
            grown = np.zeros(max(used + nbytes, 2 * self._pool.size), np.uint8)
            grown[:used] = self._pool[:used]
            self._pool = grown
        if longest > self._low.size:
            self._low = np.zeros(max(longest, 2 * self._low.size), np.uint8)

    def term(self, gid: int) -> str:
        """The term of ``gid`` (UTF-8; decoded once, then kept: a delta asks again after each merge)."""
        strs = self._strs
        if gid >= len(strs):
            strs.extend([None] * (self.n - len(strs)))
        t = strs[gid]
        if t is None:
            t = strs[gid] = self._pool[self._off[gid]: self._off[gid + 1]].tobytes().decode("utf-8")
        return t

    def ids_of(self, tokens: list[str]) -> np.ndarray:
        """gids of analysed tokens (int64[len(tokens)]; no token holds a space), new terms added."""
        return self._split(" ".join(tokens))

    def _split(self, joined: str) -> np.ndarray:
        buf = np.frombuffer(joined.encode("utf-8"), np.uint8)
        most = buf.size // 2 + 1
        self._room(most, buf.size, 0)
        out = np.empty(most, np.int64)
        k, self.n = _split(buf, out, self._ent, self._off, self._pool, self.n)
        return out[:k]

    def rows(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """``(gids int64[T], lens int64[R])`` of every row of ``table`` (columns ``title`` and
        ``text``), in row order: row ``r``'s tokens are ``gids[sum(lens[:r]):][:lens[r]]``."""
        R = table.num_rows
        lens = np.full(R, -1, np.int64)
        parts = []
        if R and not self.analyzer.stem:
            t_off, t_data = _column(table, "title")
            x_off, x_data = _column(table, "text")
            size = np.diff(t_off) + np.diff(x_off)
            self._room(0, int(size.sum()), int(size.max()))  # the pool: every byte could be a new term's
            r = 0
            while r < R:  # a pass stops when the table or its buffer is full: room is made, it goes on
                most = int(size[r]) // 2 + 2
                self._room(max(most, 1 << 14), 0, 0)
                out = np.empty(max(self.BLOCK, most), np.int64)
                k, self.n, r = _rows(_CLASS, t_off, t_data, x_off, x_data, r, out, lens, self._ent, self._off,
                                     self._pool, self.n, self._low, min(self._ent.shape[0] // 2, self._off.size - 1))
                parts.append(out[:k])
        flat = parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts else np.zeros(0, np.int64))
        bad = np.flatnonzero(lens < 0)
        if not bad.size:
            return flat, lens
        # the analyser's tokens of those rows, joined by spaces (no token holds one), one pass
        titles, texts = table.column("title").take(bad).to_pylist(), table.column("text").take(bad).to_pylist()
        tokens = self.analyzer.tokens
        joined = []
        for r, title, text in zip(bad.tolist(), titles, texts):
            toks = tokens(f"{title}\n{text}" if title else text)
            lens[r] = len(toks)
            joined.append(" ".join(toks))
        slow = self._split(" ".join(joined))
        if slow.size == 0 or bad.size == R:
            return (slow if bad.size == R else flat), lens
        mine = np.zeros(R, bool)
        mine[bad] = True
        at = np.repeat(mine, lens)
        out = np.empty(at.size, np.int64)
        out[at] = slow
        out[~at] = flat
        return out, lens


def take_rows(gids: np.ndarray, lens: np.ndarray, rows) -> tuple[np.ndarray, np.ndarray]:
    """The ``(gids, lens)`` of the rows ``rows`` (ascending indices) of ``(gids, lens)``."""
    rows = np.asarray(rows, np.int64)
    if rows.size == lens.size:
        return gids, lens
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])[rows]
    sub = lens[rows]
    idx = np.repeat(starts - np.concatenate([[0], np.cumsum(sub)[:-1]]), sub) + np.arange(int(sub.sum()))
    return gids[idx], sub


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) every pass above once per process, so that the
    first staged batch does not pay for it."""
    global _warm
    if not _warm:
        TermTable().rows(pa.table({"title": pa.array(["A b", None], pa.string()), "text": ["x é", "c d"]}))
        _warm = True
