"""Reading rows of stored-field parts' string columns straight from their Arrow buffers
(:class:`StrColumn`), and rows spread over several parts (:func:`groups`, :func:`in_order`):
a snapshot file of several record batches is served as one part per batch (:mod:`.fields`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


class StrColumn:
    """Rows of a one-chunk Arrow ``string`` / ``large_string`` column decoded from its buffers
    (offsets and UTF-8 bytes, nulls as None): the values ``take(...).to_pydict()`` gives."""

    __slots__ = ("off", "data", "valid")

    def __init__(self, off: np.ndarray, data: memoryview, valid: list | None) -> None:
        self.off, self.data, self.valid = off, data, valid

    @classmethod
    def of(cls, col: pa.ChunkedArray) -> "StrColumn | None":
        if col.num_chunks != 1 or col.type not in (pa.string(), pa.large_string()):
            return None
        arr = col.chunk(0)
        _, offs, data = arr.buffers()
        if offs is None:
            return None
        dt = np.int32 if col.type == pa.string() else np.int64
        off = np.frombuffer(offs, dtype=dt)[arr.offset: arr.offset + len(arr) + 1]
        valid = arr.is_valid().to_numpy(zero_copy_only=False).tolist() if arr.null_count else None
        return cls(off, memoryview(data) if data is not None else memoryview(b""), valid)

    def __call__(self, rows: np.ndarray) -> list:
        """The values of rows int64[M]."""
        data, valid = self.data, self.valid
        a, b = self.off[rows].tolist(), self.off[rows + 1].tolist()
        out = [str(data[i:j], "utf-8") for i, j in zip(a, b)]
        if valid is not None:
            out = [v if valid[r] else None for v, r in zip(out, rows.tolist())]
        return out

    def utf8(self, rows: np.ndarray, none: bytes, pieces: list, lens: list) -> None:
        """Append the UTF-8 bytes of rows int64[M] to ``pieces`` and their lengths to ``lens``; a
        null, or an empty value when ``none`` is not empty, reads as ``none``."""
        a, b = self.off[rows], self.off[rows + 1]
        data, valid = self.data, self.valid
        if valid is None and (none == b"" or bool((b > a).all())):
            pieces += [data[i:j] for i, j in zip(a.tolist(), b.tolist())]
            lens += (b - a).tolist()
            return
        for i, j, r in zip(a.tolist(), b.tolist(), rows.tolist()):
            x = data[i:j] if (valid is None or valid[r]) and j > i else none
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
