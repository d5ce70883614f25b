"""Vectors on the wire: a numpy array without a numpy scalar per value; numbers only."""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Mapping
from typing import Any

from oprag.v1 import oprag_pb2

F32_OVERFLOW = 3.4028235677973366e38  # (2 - 2**-24) * 2**127: a float at least this large becomes float32 infinity


def floats(v, field: str = "query_vector", *,
           empty_fix: str = "pass the embedding (D floats), or None to let the server embed the text") -> list[float]:
    """A vector as a list protobuf takes (``[]`` for None): a 1-D float numpy array through
    ``tolist`` (the same values as ``float(x)`` of each element, ~2.5x faster for 384 values); a
    list as it is (tuple: as a list); any other iterable as ``float(x)`` of each element. Real
    numbers only, as protobuf: a string such as ``"0.1"`` is refused, not parsed; so is a boolean
    anywhere (``True``, numpy's ``bool_``, a bool array: protobuf would send True as 1.0). A list
    or tuple is checked by the set of its element types (one C pass, ~2 us for 384 values): only
    ``float`` needs nothing more; anything else also gets protobuf's own check (its ``float(x)``
    of each real number). A numpy float array needs no check per element.

    :param field: how messages name the vector (e.g. ``document 'd1' vector``).
    :param empty_fix: what the empty-vector message tells the caller to do instead (an empty vector is refused:
        on the wire it reads as "no vector", so ``query_vector=[]`` would silently embed the question).
    :raises ValueError: an array that is not one-dimensional (a matrix, a 0-d scalar), an empty
        vector, an element that is not a number or is a boolean (the
        message names the first such element)."""
    if v is None:
        return []
    if getattr(v, "ndim", 1) != 1:
        raise ValueError(f"{field} must be one vector (shape (D,)), got shape {getattr(v, 'shape', None)}: "
                         "pass one row, e.g. vectors[i]")
    if isinstance(v, (str, bytes)):
        raise ValueError(f"{field} is a {type(v).__name__}: pass a sequence of floats, e.g. [0.12, -0.03, ...]")
    if isinstance(v, (Mapping, set, frozenset)):  # (iterating a dict gives its keys: trial50)
        raise ValueError(f"{field} is a {type(v).__name__}, not a sequence of numbers: pass the vector's values in "
                         "order, e.g. [0.12, -0.03, ...] or a 1-D float array")
    dt = getattr(v, "dtype", None)
    kind = getattr(dt, "kind", "")
    if dt is not None and kind not in "iufO":  # numpy parses a '<U3' array of "0.1" strings: refuse it (and bools)
        raise ValueError(f"{field} has dtype {dt}, not numbers: pass a float array or a sequence of floats")
    if kind == "f" and getattr(v, "ndim", 0) == 1:
        out = v.tolist()
    elif type(v) is list or type(v) is tuple:
        kinds = set(map(type, v))
        if not kinds <= _FLOAT:  # (a float needs no check: protobuf takes every one)
            try:
                if _booleans(kinds):  # protobuf takes True as 1.0
                    raise TypeError
                oprag_pb2.ChunkVector(vector=v)  # ~7 us for 384 values; the list is then sent as it is
            except (TypeError, ValueError, OverflowError):
                raise ValueError(_bad_element(v, field)) from None
        out = v if type(v) is list else list(v)
    else:
        if not hasattr(v, "__len__"):
            v = list(v)
        try:  # array('d'): float(x) of each real number in one C loop; a string is refused, not parsed
            if kind not in ("i", "u") and _booleans(set(map(type, v))):  # (array('d') takes True as 1.0)
                raise TypeError
            out = array("d", v).tolist()
        except (TypeError, ValueError, OverflowError):
            raise ValueError(_bad_element(v, field)) from None
    if not out:
        raise ValueError(f"{field} is empty: {empty_fix}")
    return out


_FLOAT = frozenset({float})
#: what to do instead of an empty document vector / chunk vector (Doc.to_pb, pack)
_DOC_FIX = "pass its embedding (D floats), or leave vector None to have the server embed the text"
_CHUNK_FIX = ("a precomputed chunk needs its embedding (D floats); to have the server chunk and embed a text, "
              "pass text= and leave chunks None")


def _booleans(kinds: set[type]) -> bool:
    """Whether the element types ``kinds`` hold a boolean type (``bool``, numpy's ``bool_``)."""
    np = sys.modules.get("numpy")  # numpy's booleans imply numpy is loaded
    return any(issubclass(t, bool) or (np is not None and issubclass(t, np.bool_)) for t in kinds)


def _bad_element(v, field: str) -> str:
    for i, x in enumerate(v):
        try:
            if isinstance(x, bool) or getattr(getattr(x, "dtype", None), "kind", "") == "b":
                raise TypeError
            array("d", [x])
        except (TypeError, ValueError, OverflowError):
            return (f"{field}[{i}] is {x!r} ({type(x).__name__}), not a number: pass floats, e.g. [0.12, -0.03, ...]"
                    + (" (convert strings with float() first)" if isinstance(x, str) else ""))
    return f"{field} holds a value that is not a number: pass floats"


def check_json_vector(v: list, field: str = "vector") -> None:
    """A vector read from JSON (a list): every element a finite number that float32 can hold.

    :raises ValueError: naming ``field``, the index and the value (never the whole vector): a
        boolean (``true`` would be sent as 1.0), a string, null, a list or object, NaN or infinity,
        or a finite number beyond float32's range (about 3.4e38 in magnitude: it would arrive as
        infinity and be refused as such)."""
    if set(map(type, v)) <= {float, int} and all(-F32_OVERFLOW < x < F32_OVERFLOW for x in v):  # NaN: False
        return
    for i, x in enumerate(v):
        if isinstance(x, bool) or x is None:
            raise ValueError(f"{field}[{i}] is {json.dumps(x)}, not a number: vector elements must be numbers")
        if isinstance(x, str):
            raise ValueError(f"{field}[{i}] is the string {json.dumps(x)[:40]}, not a number: write numbers without quotes")
        if not isinstance(x, (int, float)):
            raise ValueError(f"{field}[{i}] is a JSON {'object' if isinstance(x, dict) else 'array'}, not a number: "
                             "a vector is a flat list of numbers")
        if x != x or x in (float("inf"), float("-inf")):
            raise ValueError(f"{field}[{i}] is {json.dumps(x)}: vector elements must be finite numbers")
        if not -F32_OVERFLOW < x < F32_OVERFLOW:
            big = isinstance(x, int) and abs(x).bit_length() > 1000  # (no float can show it)
            shown = f"an integer of ~{int(abs(x).bit_length() * 0.30103)} digits" if big else f"{float(x):g}"
            raise ValueError(f"{field}[{i}] is {shown}, which overflows float32 (the largest magnitude is about "
                             "3.4e38): scale the vector (the server L2-normalises it anyway)")


def check_json_chunks(chunks: Any) -> None:
    """The ``chunks`` field of a JSON line: a non-empty list of ``{"text": str, "vector": [numbers]}``.

    :raises ValueError: naming the chunk and what is wrong (an empty list, a missing or mistyped
        ``text`` or ``vector``, an empty vector, a bad element as :func:`check_json_vector`); what was
        sent is shown cut to 80 characters and never as a whole vector."""
    want = '{"text": "...", "vector": [numbers]}'
    if not isinstance(chunks, list):
        raise ValueError(f'chunks must be a list of {{"text", "vector"}} objects, got {json.dumps(chunks)[:80]}')
    if not chunks:
        raise ValueError(f'chunks is empty: give at least one {want} object, or leave "chunks" out to have '
                         'the "text" chunked and embedded by the server')
    for i, c in enumerate(chunks):
        if not isinstance(c, dict):
            raise ValueError(f"chunks[{i}] must be an object {want}, got {json.dumps(c)[:80]}")
        for key, typ, name in (("text", str, "a string"), ("vector", list, "a list of numbers")):
            if key not in c:
                raise ValueError(f'chunks[{i}] has no "{key}" (its keys: {", ".join(map(json.dumps, c))[:80]}): '
                                 f"each chunk is an object {want}")
            if not isinstance(c[key], typ):
                raise ValueError(f"chunks[{i}] {key} must be {name}, got {json.dumps(c[key])[:80]}")
        if not c["vector"]:  # (was refused at send time as "document 'a': chunks[0] vector is empty", no line)
            raise ValueError(f"chunks[{i}] vector is empty: give its numbers (a precomputed chunk needs its vector)")
        check_json_vector(c["vector"], f"chunks[{i}] vector")


def pack(doc: Any) -> tuple[bytes, int] | None:
    """``(little-endian float32 rows, width)`` when the document's vectors are numpy arrays (the
    packed ``Document.vectors_f32`` form: one buffer instead of a float per value), else None.

    :raises ValueError: a vector that is not 1-D or not numeric, or chunk vectors of different widths.
    """
    np = sys.modules.get("numpy")  # numpy vectors imply numpy is loaded; the client needs none
    if np is None:
        return None
    if doc.chunks:
        rows = [v for _, v in doc.chunks]
        if doc.vector is not None or not all(isinstance(v, np.ndarray) for v in rows):
            return None
    elif isinstance(doc.vector, np.ndarray):
        rows = [doc.vector]
    else:
        return None
    if any(v.ndim != 1 for v in rows) or len({v.shape[0] for v in rows}) != 1:
        raise ValueError(f"document {doc.id!r}: vectors must be 1-D arrays of one width")
    if not rows[0].shape[0]:  # (on the wire width 0 reads as "no vector": the server would embed the text)
        raise ValueError(f"document {doc.id!r}: {'chunk vectors are' if doc.chunks else 'vector is'} empty: "
                         + (_CHUNK_FIX if doc.chunks else _DOC_FIX))
    bad = next((v.dtype for v in rows if v.dtype.kind not in "iuf"), None)
    if bad is not None:  # a '<U3' array of "0.1" strings would be parsed by astype: refuse it as floats() does
        raise ValueError(f"document {doc.id!r}: {'chunk vectors' if doc.chunks else 'vector'} has dtype {bad}, not "
                         "numbers: pass a float array")
    m = np.ascontiguousarray(np.stack(rows) if len(rows) > 1 else rows[0][None, :], dtype="<f4")
    return m.tobytes(), int(m.shape[1])


def column_matrix(col, np, pa, pc, row0: int = 0):
    """``(float32[R, D] rows, bool[R] valid)`` of a list column of one width (null rows: zeros).
    :raises ValueError: naming the row (``row0`` + index) of a null element (it read as NaN), of a
        NaN, infinite or beyond-float32 element (the server named only the wire field), or of an
        empty vector (it read as "no vector": embedded by the server, silently)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    valid = ~col.is_null().to_numpy(zero_copy_only=False)
    values = pc.list_flatten(col)

    def row_of(i: int) -> tuple[int, int, int]:  # (row, its first and end positions) of flattened element i
        ends = np.cumsum(pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False))
        r = int(np.searchsorted(ends, i, side="right"))
        return r, int(ends[r - 1]) if r else 0, int(ends[r])

    if values.null_count:
        r, _, _ = row_of(int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]))
        raise ValueError(f"row {row0 + r}: the vector holds a null: "
                         "every element must be a number (a null vector, not a null element, means 'embed this one')")
    raw = values.to_numpy(zero_copy_only=False)
    if raw.dtype.kind == "f":  # NaN, infinity or a float64 outside float32's range (it would cast to infinity)
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~(np.abs(raw) < np.float64(F32_OVERFLOW)))  # (a float64 bound: no cast to float32)
        if bad.size:  # the row's vector through the JSON lines check: the same messages as a JSONL file's
            r, start, end = row_of(int(bad[0]))
            try:
                check_json_vector(raw[start:end].tolist())
            except ValueError as exc:
                raise ValueError(f"row {row0 + r}: {exc}") from None
    flat = raw.astype(np.float32)
    n = int(valid.sum())
    d = flat.size // n if n else 0
    if n and not d:
        raise ValueError(f"row {row0 + int(np.flatnonzero(valid)[0])}: the vector is empty: give its numbers, "
                         "or a null vector to have the server embed the text")
    out = np.zeros((len(col), d), np.float32)
    out[valid] = flat.reshape(n, d)
    return out, valid


def check_widths(batches, column: str, chunk_rows: bool, np, pc) -> int | None:
    """Check a list column of vectors, read as ``batches`` (record batches of that one column),
    before any row is sent (``column`` names it in messages): one width for the whole file, no empty vector, and in chunk rows
    (``chunk_rows``) no null vector.

    :raises ValueError: naming the first offending rows (0-based, counted across batches) and
        what to change: an empty vector (on the wire it reads as "no vector", so the server would
        embed that row's text; it was reported as "2 widths (0, 384)"), a null vector in chunk
        rows, or vectors of more than one width (each width with the first row that has it).
    :returns: the file's one width (None: no vector in it)."""
    first: dict[int, int] = {}  # width -> first row of that width
    empty: list[int] = []
    n_empty = row = 0
    for b in batches:
        col = b.column(0)
        lens = pc.list_value_length(col).fill_null(-1).to_numpy(zero_copy_only=False)
        if chunk_rows and col.null_count:
            raise ValueError(f"row {row + int(np.flatnonzero(lens < 0)[0])}: chunk rows need a vector: give this "
                             "row its chunk's vector (a file without a doc_id column is read one document per "
                             "row, and a null vector there has the server embed the text)")
        zero = np.flatnonzero(lens == 0)
        n_empty += len(zero)
        empty += (row + zero[: 5 - len(empty)]).tolist()
        for w in np.unique(lens[lens > 0]).tolist():
            first.setdefault(w, row + int(np.flatnonzero(lens == w)[0]))
        row += b.num_rows
    if empty:
        more = f" and {n_empty - len(empty)} more" if n_empty > len(empty) else ""
        it = "their" if n_empty > 1 else "its"
        fix = (f"give {it} numbers (chunk rows need a vector)" if chunk_rows else
               f"give {it} numbers, or a null vector to have the server embed the text")
        raise ValueError(f"row{'s' if n_empty > 1 else ''} {', '.join(map(str, empty))}{more}: the vector is empty: {fix}")
    if len(first) > 1:
        ws = sorted(first.items(), key=lambda x: x[1])
        raise ValueError(f"column {column!r} holds vectors of {len(first)} widths ("
                         + ", ".join(f"{w} from row {r}" for w, r in ws[:5]) + "): one width per file")
    return next(iter(first), None)
