"""The compact pickled form of the query path's per-candidate payloads (:mod:`.protocol`'s
``Candidates`` and ``FetchReply``): a shard's hybrid reply carries ~320 chunk ids and ~20 hit
texts per query, and pickling them one Python object each (plus numpy's per-array reduce) was
most of the frontend's reply unpickling.

``Candidates`` pickles as its numeric columns in one ``bytearray`` (slots int64, dense,
lexical float64, back to back) and its chunk ids as one string joined by NUL;
``FetchReply`` as its four string columns in one UTF-8 ``bytes`` with their lengths. The other side
gets numpy views of the buffer (writable, no copy), :class:`PackedStrs` for the ids (a
read-only sequence that splits the joined string as far as an element read needs: the frontend
reads the ids of a top-k and of score ties only) and :class:`FieldColumn` for the fields (a
string decoded when read: most texts a reply carries are not hits). Ids with a NUL in one of
them, fields with a lone surrogate, or arrays of another dtype or shape, pickle as before (the
same values come back either way). Imports numpy only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

SEP = "\x00"


class PackedStrs(Sequence):
    """``n`` strings joined by NUL (``blob``), read like a list (indexing, slices, iteration,
    ``len``, equality with a list); pickles as the joined string. Reading string i splits the
    first ``max(2 i + 2, 16)`` strings only (kept; a merge reads a top-k, which sits near the
    start of a ranked list)."""

    __slots__ = ("blob", "n", "_items", "_head")

    def __init__(self, blob: str, n: int) -> None:
        self.blob, self.n, self._items, self._head = blob, n, None, ()

    def tolist(self) -> list[str]:
        """The strings as a list (split once, then kept)."""
        items = self._items
        if items is None:
            items = self._items = self.blob.split(SEP) if self.n else []
        return items

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        items = self._items
        if items is not None:
            return items[i]
        if type(i) is int and 0 <= i < self.n:
            head = self._head
            if i >= len(head):  # split up to past i; the last piece is the unsplit rest
                cut = max(2 * i + 2, 16)
                if cut >= self.n - 1:
                    return self.tolist()[i]
                head = self._head = self.blob.split(SEP, cut)[:-1]
            return head[i]
        return self.tolist()[i]

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedStrs):
            return self.n == other.n and self.blob == other.blob
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (a sequence that compares equal to a list)

    def __repr__(self) -> str:
        return f"PackedStrs({self.tolist()!r})"

    def __reduce__(self):
        return PackedStrs, (self.blob, self.n)


def pack_strs(items) -> tuple[str, int] | None:
    """``(joined, n)`` of a sequence of str, or None when one of them holds a NUL (or is not a
    str): the caller pickles the list itself."""
    if isinstance(items, PackedStrs):
        return items.blob, items.n
    n = len(items)
    try:
        blob = SEP.join(items)
    except TypeError:
        return None
    return (blob, n) if blob.count(SEP) == max(n - 1, 0) else None


def _col(a, dtype, n: int) -> np.ndarray | None:
    """``a`` when it is a 1-D ndarray of ``dtype`` and length ``n`` (else None: not packed)."""
    return a if isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1 and a.shape[0] == n else None


_I8, _F8 = np.dtype(np.int64), np.dtype(np.float64)


def reduce_candidates(c):
    """``Candidates.__reduce__``: the compact form, or the plain ``(cls, fields)`` one."""
    ids = pack_strs(c.chunk_ids)
    n = len(c.chunk_ids)
    cols = (_col(c.slots, _I8, n), _col(c.dense, _F8, n), _col(c.lexical, _F8, n))
    if ids is None or any(x is None for x in cols):
        return type(c), (c.slots, c.chunk_ids, c.dense, c.lexical)
    # (one join of the three columns' buffers: a third of the time of three slice copies into a view)
    buf = bytearray(b"".join([np.ascontiguousarray(a).data for a in cols]))
    return candidates, (buf, ids[0], n)


def candidates(buf: bytearray, blob: str, n: int):
    """The ``Candidates`` of :func:`reduce_candidates`'s compact form (views of ``buf``)."""
    a = np.frombuffer(buf, np.float64).reshape(3, n)  # (views: one buffer export)
    return Candidates(a[0].view(np.int64), PackedStrs(blob, n), a[1], a[2])


def reduce_fetch(f):
    """``FetchReply.__reduce__``: its four string columns as one UTF-8 blob and the byte length
    of each string (when every column has one string per slot)."""
    n = len(f.found)
    cols = (f.doc_ids, f.titles, f.texts, f.metadata)
    try:
        enc = [x.encode() for x in itertools.chain(*cols)] if all(len(c) == n for c in cols) else None
    except (AttributeError, UnicodeEncodeError):  # not str, or a lone surrogate: as before
        enc = None
    if enc is None:
        return type(f), (f.found, f.doc_ids, f.titles, f.texts, f.metadata, f.slots)
    return fetch_reply, (f.found, n, b"".join(enc), list(map(len, enc)), f.slots)


class _Utf8Rows:
    """``4 n`` UTF-8 strings back to back (a FetchReply's columns) and their byte lengths."""

    __slots__ = ("blob", "n", "lens", "_at")

    def __init__(self, blob: bytes, n: int, lens: list[int]) -> None:
        self.blob, self.n, self.lens, self._at = blob, n, lens, None

    def get(self, k: int) -> str:
        """String ``k`` (column-major: column c, row i is ``c n + i``), decoded."""
        at = self._at
        if at is None:
            at = self._at = list(itertools.accumulate(self.lens, initial=0))
        return self.blob[at[k]:at[k + 1]].decode()


class FieldColumn(Sequence):
    """Column ``c`` of a :class:`_Utf8Rows`, read like a list of str: a string is decoded when
    read (a reply's merge reads a top-k's few of the ~20 texts carried)."""

    __slots__ = ("rows", "c")

    def __init__(self, rows: _Utf8Rows, c: int) -> None:
        self.rows, self.c = rows, c

    def __len__(self) -> int:
        return self.rows.n

    def __getitem__(self, i):
        n = self.rows.n
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(n))]
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.rows.get(self.c * n + i)

    def tolist(self) -> list[str]:
        return [self[i] for i in range(self.rows.n)]

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, Sequence)) and not isinstance(other, (str, bytes)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FieldColumn({self.tolist()!r})"


def row_fields(f, k: int) -> tuple[str, str, str, str]:
    """``(doc_id, title, text, metadata)`` of row ``k`` of a ``FetchReply`` (0 <= k < its
    length): decoded straight from the blob of a compact one, indexed from the lists of a plain one."""
    col = f.doc_ids
    if type(col) is FieldColumn:
        rows = col.rows
        if f.titles.rows is rows and f.texts.rows is rows and f.metadata.rows is rows:
            at, blob, n = rows._at, rows.blob, rows.n
            if at is None:
                at = rows._at = list(itertools.accumulate(rows.lens, initial=0))
            return tuple(blob[at[i]:at[i + 1]].decode() for i in (k, n + k, 2 * n + k, 3 * n + k))
    return f.doc_ids[k], f.titles[k], f.texts[k], f.metadata[k]


def fetch_reply(found, n: int, blob: bytes, lens: list[int], slots):
    """The ``FetchReply`` of :func:`reduce_fetch`'s compact form."""
    rows = _Utf8Rows(blob, n, lens)
    return FetchReply(found, FieldColumn(rows, 0), FieldColumn(rows, 1), FieldColumn(rows, 2), FieldColumn(rows, 3),
                      slots)


_F4 = np.dtype(np.float32)


def reduce_batch(b):
    """``QueryBatch.__reduce__``: the idf arrays and the query matrix in one ``bytearray``
    (idf first: every array stays aligned), when ``q`` is a C-contiguous float32[B, D] and every
    idf a float64[T_i]; else the plain form. (Numpy's reduce of each array was most of a query
    request's pickling on the frontend and its unpickling on each shard.)"""
    q, idf = b.q, b.idf
    if not (isinstance(q, np.ndarray) and q.dtype == _F4 and q.ndim == 2 and q.flags.c_contiguous
            and type(idf) is list and all(isinstance(x, np.ndarray) and _col(x, _F8, x.shape[0] if x.ndim == 1 else -1)
                                          is not None for x in idf)):
        return type(b), (b.q, b.terms, b.idf, b.avgdl, b.k1, b.b, b.filters)
    lens = [x.shape[0] for x in idf]
    buf = bytearray(b"".join([*(np.ascontiguousarray(x).data for x in idf), q.data]))
    return query_batch, (buf, q.shape[0], q.shape[1], lens, b.terms, b.avgdl, b.k1, b.b, b.filters)


def query_batch(buf: bytearray, n: int, dim: int, lens: list[int], terms, avgdl, k1, b, filters):
    """The ``QueryBatch`` of :func:`reduce_batch`'s compact form (writable views of ``buf``)."""
    idf, at = [], 0
    for t in lens:
        idf.append(np.frombuffer(buf, np.float64, t, at) if t else np.zeros(0, np.float64))
        at += 8 * t
    q = np.frombuffer(buf, np.float32, n * dim, at).reshape(n, dim) if n * dim else np.zeros((n, dim), np.float32)
    return QueryBatch(q, terms, idf, avgdl, k1, b, filters)


# (protocol imports this module after defining its types: they exist by now)
from .protocol import Candidates, FetchReply, QueryBatch  # noqa: E402

Candidates.__reduce__, FetchReply.__reduce__, QueryBatch.__reduce__ = reduce_candidates, reduce_fetch, reduce_batch
