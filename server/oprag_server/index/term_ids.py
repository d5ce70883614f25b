"""BM25 term ids straight from an Arrow batch's ``title`` / ``text`` columns (issue 13, ingest).

:class:`TermTable` gives every distinct analysed token a shard-wide integer id (*gid*), never
reused, and :meth:`TermTable.rows` turns a batch of chunks into ``(gids int64[T], lens int64[R])``:
the gids of each row's tokens in text order, row after row, and each row's token count (its
BM25 length). The tokens are exactly :meth:`.analyzer.Analyzer.tokens` of ``f"{title}\\n{text}"``
(``text`` alone when the title is empty or null), so the postings built from the ids are the
ones built from the strings.

Rows are tokenised by one compiled pass over the columns' bytes (numba). ASCII text: the maximal
runs of ``[A-Za-z0-9]``, lower-cased, which is what the analyser's ASCII path gives (its
``translate`` maps every other ASCII character to a space before ``str.split``); each token is
hashed (FNV-1a, 64 bit) and looked up in an open-addressing table of the terms' bytes, so no
Python string is made per token. A row with non-ASCII bytes goes word by word (a word: a maximal
run of bytes other than ASCII whitespace): its ASCII words as above, its words holding a byte >=
0x80 through the analyser (the analyser's steps do not reach across ASCII whitespace, see
:meth:`TermTable._words`), kept by their bytes so a recurring word is analysed once. With
``stem=True`` every row goes through the analyser. The analyser's tokens, joined by spaces (a
token never holds one), are looked up by their UTF-8 bytes in the same table by one compiled
pass, so one term has one gid whichever path met it.

The table only grows (a term that no live chunk holds any more keeps its gid): a few tens of
bytes per distinct term ever seen by the shard.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import kernels  # noqa: F401 - sets numba's cache directory as the kernels do
from .analyzer import Analyzer
from .warm_inputs import read_only
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
def _words(cls, data, start, end, col, out, n_out, ent, off, pool, n_terms, low, seg, n_seg):
    """Tokens of ``data[start:end]`` (UTF-8) appended to ``out`` from ``n_out``, word by word (a
    word: a maximal run of bytes other than ASCII whitespace, 9-13 and 32): a word without a byte
    >= 0x80 is tokenised here (:func:`_scan`), a word with one is left to the analyser: ``out``
    gets ``-1 - j`` and ``seg[j] = (col, a, b)``. :returns: (n_out, n_terms, n_seg)."""
    i = start
    while i < end:
        b = data[i]
        if b == 32 or (b >= 9 and b <= 13):
            i += 1
            continue
        a = i
        high = False
        while i < end:
            b = data[i]
            if b == 32 or (b >= 9 and b <= 13):
                break
            if b >= 128:
                high = True
            i += 1
        if high:
            seg[n_seg, 0] = col
            seg[n_seg, 1] = a
            seg[n_seg, 2] = i
            out[n_out] = -1 - n_seg
            n_out += 1
            n_seg += 1
        else:
            n_out, n_terms = _scan(cls, data, a, i, out, n_out, ent, off, pool, n_terms, low)
    return n_out, n_terms, n_seg


@njit(**_JIT)
def _rows(cls, t_off, t_data, x_off, x_data, r0, out, lens, ent, off, pool, n_terms, low, max_terms, seg):
    """The tokens of rows ``r0..`` (title then text) into ``out``, ``lens[r]`` the entries of row
    ``r``. A row with a byte >= 0x80 goes word by word (:func:`_words`): its non-ASCII words are
    entries ``-1 - j`` of ``seg`` for the analyser. Stops before a row that could take the table
    past ``max_terms`` terms or ``out`` past its end (a row of ``n`` bytes has at most
    ``n // 2 + 2`` tokens and words). :returns: (entries written, terms after, next row, words in
    ``seg``)."""
    n_out = 0
    n_seg = 0
    for r in range(r0, lens.size):
        most = (t_off[r + 1] - t_off[r] + x_off[r + 1] - x_off[r]) // 2 + 2
        if n_terms + most > max_terms or n_out + most > out.size:
            return n_out, n_terms, r, n_seg
        high = np.uint8(0)  # a byte >= 0x80 anywhere: word by word
        for j in range(t_off[r], t_off[r + 1]):
            high |= t_data[j]
        for j in range(x_off[r], x_off[r + 1]):
            high |= x_data[j]
        k0 = n_out
        if high >= 128:
            k, n_terms, n_seg = _words(cls, t_data, t_off[r], t_off[r + 1], 0, out, n_out, ent, off, pool, n_terms,
                                       low, seg, n_seg)
            k, n_terms, n_seg = _words(cls, x_data, x_off[r], x_off[r + 1], 1, out, k, ent, off, pool, n_terms,
                                       low, seg, n_seg)
        else:
            k, n_terms = _scan(cls, t_data, t_off[r], t_off[r + 1], out, n_out, ent, off, pool, n_terms, low)
            k, n_terms = _scan(cls, x_data, x_off[r], x_off[r + 1], out, k, ent, off, pool, n_terms, low)
        lens[r] = k - k0
        n_out = k
    return n_out, n_terms, lens.size, n_seg


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
    #: non-ASCII words whose gids are kept (the cache is cleared when it would grow past this)
    WORD_CACHE = 1 << 17

    def __init__(self, stem: bool = False) -> None:
        self.analyzer = Analyzer(stem=stem)
        self.n = 0
        self._ent = np.zeros((1 << 15, 4), np.uint64)  # open addressing, at most half full
        self._off = np.zeros((1 << 14) + 1, np.int64)  # gid -> offset of its bytes in _pool
        self._pool = np.zeros(1 << 20, np.uint8)
        self._low = np.zeros(64, np.uint8)
        self._strs: list[str | None] = []  # gid -> its term as a str, once asked for
        self._word_gids, self._word_bytes = {}, 0  # a non-ASCII word's UTF-8 -> its tokens' gids; ~bytes

    def __len__(self) -> int:
        return self.n

    def nbytes(self) -> int:
        return int(self._ent.nbytes + self._off.nbytes + self._pool.nbytes + self._low.nbytes + self._word_bytes)

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
        parts, segs = [], []
        cols = None
        if R and not self.analyzer.stem:
            t_off, t_data = _column(table, "title")
            x_off, x_data = _column(table, "text")
            t_data, x_data = read_only(t_data), read_only(x_data)  # (one specialisation of _rows whatever their source)
            cols = (t_data, x_data)
            size = np.diff(t_off) + np.diff(x_off)
            self._room(0, int(size.sum()), int(size.max()))  # the pool: every byte could be a new term's
            r = 0
            while r < R:  # a pass stops when the table or its buffer is full: room is made, it goes on
                most = int(size[r]) // 2 + 2
                self._room(max(most, 1 << 14), 0, 0)
                out = np.empty(max(self.BLOCK, most), np.int64)
                seg = np.empty((out.size, 3), np.int64)
                k, self.n, r, n_seg = _rows(_CLASS, t_off, t_data, x_off, x_data, r, out, lens, self._ent, self._off,
                                            self._pool, self.n, self._low,
                                            min(self._ent.shape[0] // 2, self._off.size - 1), seg)
                out = out[:k]
                if n_seg:
                    base = sum(s.shape[0] for s in segs)
                    if base:
                        out[out < 0] -= base
                    segs.append(seg[:n_seg])
                parts.append(out)
        flat = parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts else np.zeros(0, np.int64))
        if segs:
            flat, lens = self._words(flat, lens, np.concatenate(segs), cols)
        bad = np.flatnonzero(lens < 0)
        if not bad.size:
            return flat, lens
        # stem=True: the analyser's tokens of every row, joined by spaces (no token holds one), one pass
        titles, texts = table.column("title").take(bad).to_pylist(), table.column("text").take(bad).to_pylist()
        tokens = self.analyzer.tokens
        joined = []
        for r, title, text in zip(bad.tolist(), titles, texts):
            toks = tokens(f"{title}\n{text}" if title else text)
            lens[r] = len(toks)
            joined.append(" ".join(toks))
        return self._split(" ".join(joined)), lens

    def _words(self, flat: np.ndarray, lens: np.ndarray, seg: np.ndarray, cols) -> tuple[np.ndarray, np.ndarray]:
        """Replace each entry ``-1 - j`` of ``flat`` by the gids of the analyser's tokens of word
        ``seg[j]`` (column, start, end); ``lens`` become token counts.

        The analyser's steps do not reach across ASCII whitespace (default-ignorable removal and
        case folding are per character; NFKC neither composes nor reorders across a space, tab or
        line break, which are starters that nothing composes with; tokens and CJK runs never hold
        whitespace), so a row's tokens are its words' tokens in order (tested against the whole
        row's analysis). A word's gids are kept by its bytes (gids are never reused)."""
        cache = self._word_gids
        keys = [cols[c][a:b].tobytes() for c, a, b in seg.tolist()]
        miss = list({k: None for k in keys if k not in cache})
        if miss:
            if len(cache) + len(miss) > self.WORD_CACHE:  # cleared: this batch's words anew
                cache.clear()
                miss, self._word_bytes = list(dict.fromkeys(keys)), 0
            toks = [self.analyzer.tokens(k.decode("utf-8")) for k in miss]
            ids = self._split(" ".join(" ".join(t) for t in toks if t))
            at = np.cumsum([0] + [len(t) for t in toks]).tolist()
            cache.update((k, ids[a:b]) for k, a, b in zip(miss, at, at[1:]))
            self._word_bytes += sum(len(k) + 8 * len(t) + 180 for k, t in zip(miss, toks))  # (key, view, entry)
        got = [cache[k] for k in keys]
        neg = flat < 0
        cnt = np.ones(flat.size, np.int64)
        cnt[neg] = np.fromiter((g.size for g in got), np.int64, len(got))[-1 - flat[neg]]
        row = np.repeat(np.arange(lens.size), lens)
        lens = np.bincount(row, weights=cnt, minlength=lens.size).astype(np.int64)
        start = np.cumsum(cnt) - cnt
        res = np.empty(int(cnt.sum()), np.int64)
        res[start[~neg]] = flat[~neg]
        sub = [got[j] for j in (-1 - flat[neg]).tolist()]  # the words in entry order
        if sub:
            n = cnt[neg]
            pos = np.repeat(start[neg], n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
            res[pos] = np.concatenate(sub)
        return res, lens


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
