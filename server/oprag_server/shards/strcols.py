"""Reading rows of stored-field parts' string columns straight from their Arrow buffers
(:class:`StrColumn`), and rows spread over several parts (:func:`groups`, :func:`in_order`):
a snapshot file of several record batches is served as one part per batch (:mod:`.fields`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


class StrColumn:
    """Rows of an Arrow ``string`` / ``large_string`` column decoded from its buffers (offsets
    and UTF-8 bytes, nulls as None): the values ``take(...).to_pydict()`` gives. A column of
    several chunks (a snapshot file of several record batches, memory-mapped) keeps its chunks'
    offsets back to back (``off``: n + chunks entries, a copy of 4 or 8 bytes per row), and a
    row ``r`` of chunk ``k`` (``starts``: each chunk's first row) reads ``off[r + k]``,
    ``off[r + k + 1]`` of that chunk's bytes."""

    __slots__ = ("off", "data", "valid", "starts", "datas", "_u8")

    def __init__(self, off: np.ndarray, data: memoryview, valid: list | None, starts: np.ndarray | None = None,
                 datas: list | None = None) -> None:
        self.off, self.data, self.valid, self.starts, self.datas = off, data, valid, starts, datas
        self._u8: np.ndarray | None = None

    def plain(self) -> bool:
        """One Arrow array (one chunk) without nulls: :meth:`u8` and :attr:`off` index every value."""
        return self.starts is None and self.valid is None

    def u8(self) -> np.ndarray:
        """The UTF-8 bytes of a :meth:`plain` column as uint8[B] (a read-only view, kept)."""
        if self._u8 is None:
            self._u8 = np.frombuffer(self.data, np.uint8)
        return self._u8

    @classmethod
    def of(cls, col: pa.ChunkedArray) -> "StrColumn | None":
        if not col.num_chunks or col.type not in (pa.string(), pa.large_string()):
            return None
        dt = np.int32 if col.type == pa.string() else np.int64
        offs, datas = [], []
        for arr in col.chunks:
            _, o, data = arr.buffers()
            if o is None:
                return None
            offs.append(np.frombuffer(o, dtype=dt)[arr.offset: arr.offset + len(arr) + 1])
            datas.append(memoryview(data) if data is not None else memoryview(b""))
        valid = col.is_valid().to_numpy(zero_copy_only=False).tolist() if col.null_count else None
        if len(offs) == 1:
            return cls(offs[0], datas[0], valid)
        starts = np.cumsum([0] + [len(a) for a in col.chunks[:-1]]).astype(np.int64)
        return cls(np.concatenate(offs), datas[0], valid, starts, datas)

    def _spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, "memoryview | list"]:
        """``(start, end, data)`` of rows int64[M]: byte offsets, and the bytes they index (one
        chunk), or per row its chunk's bytes."""
        if self.starts is None:
            return self.off[rows], self.off[rows + 1], self.data
        k = np.searchsorted(self.starts, rows, side="right") - 1
        at = rows + k
        datas = self.datas
        return self.off[at], self.off[at + 1], [datas[i] for i in k.tolist()]

    def __call__(self, rows: np.ndarray) -> list:
        """The values of rows int64[M]."""
        valid = self.valid
        a, b, data = self._spans(rows)
        if isinstance(data, list):
            out = [str(d[i:j], "utf-8") for d, i, j in zip(data, a.tolist(), b.tolist())]
        else:
            out = [str(data[i:j], "utf-8") for i, j in zip(a.tolist(), b.tolist())]
        if valid is not None:
            out = [v if valid[r] else None for v, r in zip(out, rows.tolist())]
        return out

    def utf8(self, rows: np.ndarray, none: bytes, pieces: list, lens: list) -> None:
        """Append the UTF-8 bytes of rows int64[M] to ``pieces`` and their lengths to ``lens``; a
        null, or an empty value when ``none`` is not empty, reads as ``none``."""
        a, b, data = self._spans(rows)
        valid = self.valid
        if valid is None and (none == b"" or bool((b > a).all())):
            if isinstance(data, list):
                pieces += [d[i:j] for d, i, j in zip(data, a.tolist(), b.tolist())]
            else:
                pieces += [data[i:j] for i, j in zip(a.tolist(), b.tolist())]
            lens += (b - a).tolist()
            return
        data = data if isinstance(data, list) else [data] * rows.size
        for d, i, j, r in zip(data, a.tolist(), b.tolist(), rows.tolist()):
            x = d[i:j] if (valid is None or valid[r]) and j > i else none
            pieces.append(x)
            lens.append(len(x))

def groups(parts: np.ndarray) -> list[tuple[np.ndarray | None, int]]:
    """``[(positions, part)]`` of rows in parts ``parts`` int32[M]: ``[(None, p)]`` for one part."""
    p = int(parts[0])
    if parts[-1] == p and (parts == p).all():
        return [(None, p)]
    return [(np.flatnonzero(parts == q), q) for q in np.unique(parts).tolist()]


def in_order(values: list, groups: list) -> list:
    """``values`` read part by part in ``groups``' order (:func:`groups`), back in row order."""
    if len(groups) == 1:
        return values
    order = np.concatenate([pos for pos, _ in groups])
    inv = np.empty(order.size, np.int64)
    inv[order] = np.arange(order.size)
    return [values[i] for i in inv.tolist()]
