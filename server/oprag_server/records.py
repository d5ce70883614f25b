"""Arrow schemas of the data plane and the helpers that move record batches between processes.

Chunks travel from the ingest pipeline to shard processes as Arrow IPC streams (one record
batch per coalesced bulk commit). The FAISS boundary takes the ``vector`` column as a
contiguous float32[B, D] buffer without per-row Python objects.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

import numpy as np
import pyarrow as pa


def chunk_schema(dim: int) -> pa.Schema:
    """Schema of chunks sent to a shard for upsert.

    Columns: ``chunk_id`` (``"{doc_id}#{ordinal}"``), ``doc_id``, ``title``, ``text``,
    ``metadata`` (JSON object of typed values: string, integer, float, boolean;
    :mod:`.metadata`; batches written before typed metadata hold strings only), ``ordinal`` int32 (position in the
    document), ``generation`` uint64 (write sequence of the document version), ``content_hash``
    (64 characters: a prefix saying whose vector it is, the embedder's ``"e<8 hex>:"`` or the
    client's ``"u:"``, then hex sha256 of the chunk text cut to fit; a bare 64-hex sha256 in chunks
    stored before session 24: :func:`.engine.documents.content_hash`), ``vector`` fixed_size_list<float32>[dim] (L2-normalised).
    """
    return pa.schema(
        [
            ("chunk_id", pa.string()),
            ("doc_id", pa.string()),
            ("title", pa.string()),
            ("text", pa.string()),
            ("metadata", pa.string()),
            ("ordinal", pa.int32()),
            ("generation", pa.uint64()),
            ("content_hash", pa.string()),
            ("vector", pa.list_(pa.float32(), dim)),
        ]
    )


def make_chunk_batch(
    *,
    chunk_ids: list[str],
    doc_ids: list[str],
    titles: list[str],
    texts: list[str],
    metadata: list[dict],
    ordinals: list[int],
    generations: list[int],
    content_hashes: list[str],
    vectors: np.ndarray,
) -> pa.RecordBatch:
    """Build one chunk record batch.

    :param vectors: float32[B, D] (any float dtype or layout is copied to contiguous float32).
    :raises ValueError: column lengths differ.
    """
    vec = np.ascontiguousarray(vectors, dtype=np.float32)
    n = len(chunk_ids)
    if vec.ndim != 2 or vec.shape[0] != n:
        raise ValueError(f"vectors must be float32[{n}, D], got shape {vec.shape}")
    dim = vec.shape[1]
    flat = pa.array(vec.reshape(-1), type=pa.float32())
    vcol = pa.FixedSizeListArray.from_arrays(flat, dim)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(chunk_ids, pa.string()),
            pa.array(doc_ids, pa.string()),
            pa.array(titles, pa.string()),
            pa.array(texts, pa.string()),
            pa.array([json.dumps(m, sort_keys=True, ensure_ascii=False) if m else "{}" for m in metadata], pa.string()),
            pa.array(ordinals, pa.int32()),
            pa.array(generations, pa.uint64()),
            pa.array(content_hashes, pa.string()),
            vcol,
        ],
        schema=chunk_schema(dim),
    )


def vectors_of(batch: pa.RecordBatch | pa.Table, column: str = "vector") -> np.ndarray:
    """The fixed-size-list vector column as float32[B, D] (zero-copy when possible)."""
    col = batch.column(column)
    if isinstance(col, pa.ChunkedArray):  # one chunk (a snapshot's, memory-mapped): not copied
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    dim = col.type.list_size
    # the child values directly when the list array is unsliced and has no nulls (``flatten``
    # imports pyarrow.compute, about a second in a fresh shard process)
    flat = (col.values if col.offset == 0 and col.null_count == 0 else col.flatten()).to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat.reshape(-1, dim), dtype=np.float32)


def to_ipc(batch: pa.RecordBatch) -> bytes:
    """Serialise one record batch as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def write_ipc(sink, batches: Iterable[pa.RecordBatch]) -> int:
    """Write record batches of one schema (the first's) as an Arrow IPC stream to ``sink`` (a
    binary file object) as they come: no serialised copy in memory. :returns: rows written."""
    it = iter(batches)
    first = next(it)
    n = 0
    with pa.ipc.new_stream(sink, first.schema) as writer:
        for b in itertools.chain([first], it):
            writer.write_batch(b)
            n += b.num_rows
    return n


def from_ipc(data: bytes) -> pa.Table:
    """Read an Arrow IPC stream written by :func:`to_ipc`."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def as_query_matrix(x, dim: int | None = None) -> np.ndarray:
    """Normalise a query-vector input to a C-contiguous float32[B, D] matrix.

    Accepts numpy arrays of any float dtype or stride (1-D means one query), nested lists,
    and Arrow list / fixed-size-list arrays (one list per query).

    :raises ValueError: ragged rows, non-finite values, or a width different from ``dim``.
    """
    if isinstance(x, (pa.Array, pa.ChunkedArray)):
        if isinstance(x, pa.ChunkedArray):
            x = x.combine_chunks()
        rows = x.to_pylist()
        arr = np.asarray(rows, dtype=np.float32)
    else:
        arr = np.asarray(x)
        if arr.dtype == object:
            raise ValueError("query vectors must be numeric (ragged rows?)")
        arr = arr.astype(np.float32, copy=False)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"query vectors must be 1-D or 2-D, got {arr.ndim}-D")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"query vectors must have width {dim}, got {arr.shape[1]}")
    if not np.isfinite(arr).all():
        raise ValueError("query vectors contain NaN or infinity")
    return np.ascontiguousarray(arr, dtype=np.float32)


F32_HINT = " (float32 holds at most about 3.4e38 in magnitude: a larger value arrives as infinity)"


def unit_rows(rows, dim: int, what: str = "vector") -> np.ndarray:
    """Client-given embeddings as unit-norm float32[M, dim] (one row per input sequence).

    Each row is scaled by its max |value| before the L2 norm, so float overflow and underflow
    cannot occur (the same rule as a client-given query vector).

    :param rows: M float sequences. :param what: the name used in error messages.
    :raises ValueError: a row with another width than ``dim``, NaN or infinity, or all zeros.
    """
    rows = list(rows)
    for r in rows:
        if len(r) != dim:
            raise ValueError(f"{what} has {len(r)} values; the index holds vectors of width {dim}")
    return unit_matrix(np.asarray(rows, dtype=np.float64).reshape(len(rows), dim), what)


def unit_matrix(v: np.ndarray, what: str = "vector") -> np.ndarray:
    """:func:`unit_rows` of a float matrix ``[M, D]`` (any float dtype; not modified).

    :raises ValueError: NaN or infinity, or an all-zero row.
    """
    v = np.array(v, dtype=np.float64)  # (a copy, divided in place below: the same floats, fewer temporaries)
    scale = np.abs(v).max(axis=1, initial=0.0)  # NaN and infinity propagate into the row max
    for bad in (~np.isfinite(scale), scale == 0.0):  # NaN / infinity first, then all zeros
        if bad.any():  # (with several rows, the first such one: trial37 #5, a chunk's NaN was not placed)
            what = f"{what} of chunk {int(np.argmax(bad))}" if v.shape[0] > 1 else what
            break
    if not np.isfinite(scale).all():
        raise ValueError(f"{what} contains NaN or infinity{F32_HINT}")
    if (scale == 0.0).any():
        raise ValueError(f"{what} is all zeros (it has no direction to compare by inner product; float32 rounds "
                         "magnitudes below about 1.4e-45 to 0, scale tiny values up): send the chunk's "
                         "embedding, or leave the vector out to have the server embed the text")
    v /= scale[:, None]
    # the sum of squares as np.linalg.norm(v, axis=1) computes it (same floats), without its overhead
    v /= np.sqrt(np.add.reduce(v * v, axis=1))[:, None]
    return v.astype(np.float32)


def packed_rows(data: bytes, rows: int, dim: int, index_dim: int, what: str = "vectors_f32") -> np.ndarray:
    """Unit-norm float32 ``[rows, dim]`` from ``rows * dim`` little-endian float32 values
    packed in ``data`` (one ``np.frombuffer``, no per-value work), as :func:`unit_rows`.

    :param index_dim: the index's width D; ``dim`` must equal it.
    :raises ValueError: ``dim != index_dim`` (or 0), ``len(data) != rows * dim * 4``, NaN or
        infinity, an all-zero row.
    """
    if dim == 0 and data:  # (trial48 #6: the packed bytes came without their width)
        raise ValueError(f"{what} holds {len(data)} bytes but vector_dim is 0: set vector_dim to the vectors' width "
                         f"({index_dim} for this index)")
    if dim != index_dim:  # (worded as unit_rows': a Parquet / Arrow user never wrote the wire field)
        raise ValueError(f"a vector has {dim} values ({what} with vector_dim {dim}); the index holds vectors of "
                         f"width {index_dim}")
    if len(data) != rows * dim * 4:
        raise ValueError(f"{what} is {len(data)} bytes; {rows} row(s) of {dim} float32 values take {rows * dim * 4}")
    return unit_matrix(np.frombuffer(data, dtype="<f4").reshape(rows, dim), f"a vector ({what})")
