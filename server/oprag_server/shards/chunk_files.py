"""A snapshot's stored fields in one or more Arrow files, the earlier ones linked from the previous snapshot.

A snapshot wrote every chunk's fields again (``chunks.arrow``: 860 MB a 500K-chunk shard, 0.8-2 s) after any write,
while that shard held every write. Rows added since the last snapshot come after the rows it wrote (new chunks get
new, higher slots), so the snapshot now links the previous one's files while the stored fields still begin with
exactly their rows (nothing removed since: :attr:`.fields.StoredFields.prefix`) and writes only the rows after them,
as a new file:

* ``chunks.arrow``: the live rows ``[0, r0)`` in slot order; ``chunks.<start>.arrow``: rows ``[start, start + r)``;
* ``meta.json``'s ``chunk_files``: ``[[name, rows, crc32], ...]`` in order (absent before format 5: ``chunks.arrow``
  alone); a start checks each file's rows and CRC-32, and that the rows add up to the snapshot's ``chunks``.

As for the HNSW vectors' parts (:mod:`..index.ann_vectors`), a file is kept only while it holds at least twice the
rows after it (from the first that does not, the rows are written anew), so a shard has at most log2(n) + 1 files.
Any removal (a delete or a replacement) makes the next snapshot write every row in one ``chunks.arrow``, renumbered
as before, and so does a shard of at most :data:`.chunks.BATCH_ROWS` chunks (one record batch: one file keeps the
single-batch columns that :meth:`.fields.StoredFields.hit_utf8`'s compiled gather reads). A file is never written in
place: a link or a new file under a new snapshot directory.
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

from .. import records
from ..index.bm25.files import crc_of, kept
from ..index.wal import fsync_write_with
from . import chunks as chunkstore

FIRST = "chunks.arrow"


def name(start: int) -> str:
    """The file of the rows from ``start`` on."""
    return FIRST if start == 0 else f"chunks.{start:012d}.arrow"


def listed(snap: Path, meta: dict) -> list[tuple]:
    """``[(path, rows, crc32)]``: a snapshot's chunk files in order (``meta``: its ``meta.json``; None where it
    does not say).

    :raises RuntimeError: the files' rows do not add up to the snapshot's ``chunks`` (trial54b #1: a listing cut
        short served a shard without its last file's chunks)."""
    files = meta.get("chunk_files") or [[FIRST, meta.get("chunks")]]
    out = [(snap / f[0], None if f[1] is None else int(f[1]), int(f[2]) if len(f) > 2 else None) for f in files]
    if meta.get("chunks") is not None and None not in (r for _, r, _ in out) \
            and sum(r for _, r, _ in out) != int(meta["chunks"]):
        raise RuntimeError(f"{snap / 'meta.json'}: chunk_files hold {sum(r for _, r, _ in out)} rows, not the "
                           f"snapshot's {meta['chunks']} chunks; restore the snapshot directory from a backup")
    return out


def map_chunks(path: Path):
    """A snapshot's chunk file memory-mapped: ``(table, mmap)``, the table's buffers zero-copy views of the file
    (pages resident only while read; the caller may drop them from its RSS with ``madvise(MADV_DONTNEED)``, they
    come back from the page cache when read)."""
    import pyarrow as pa  # noqa: PLC0415

    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return pa.ipc.open_stream(pa.py_buffer(mapped)).read_all(), mapped


def map_all(files: list[tuple], verify: bool = False):
    """``(table, mmaps, files)``: every chunk file mapped (:func:`map_chunks`), their tables one after the other
    (zero-copy), and ``files`` with each file's row count as read. ``verify`` (a start): each file's CRC-32 checked
    against the one listed (:func:`crc_of`: ~0.25 s for 860 MB in the page cache here, no pages mapped).

    :raises ValueError: a file cannot be read (named), its row count or CRC-32 differs from the one listed."""
    import pyarrow as pa  # noqa: PLC0415

    tables, maps, out = [], [], []
    for path, rows, crc in files:
        try:
            t, m = map_chunks(path)
        except (OSError, ValueError) as exc:  # (missing; cut short: "Expected to be able to read ... bytes")
            raise ValueError(f"{path}: cannot be read ({exc})") from None
        if rows is not None and t.num_rows != rows:
            raise ValueError(f"{path}: {t.num_rows} rows, {rows} listed in meta.json")
        # (read, not through the map: its pages would count in the RSS, ~0.86 GB a 1M shard's at its start)
        if verify and crc is not None and (got := crc_of(path)) != crc:  # (trial54b #3: a changed byte was served)
            raise ValueError(f"{path}: its CRC-32 is {got}, not the {crc} meta.json records: the file was damaged "
                             "after it was written (the stored chunks have no other copy: restore the snapshot "
                             "directory from a backup)")
        tables.append(t)
        maps.append(m)
        out.append((path, t.num_rows, crc))
    return (tables[0] if len(tables) == 1 else pa.concat_tables(tables)), maps, out


def link(src: Path, dst: Path) -> bool:
    """``dst`` a hard link to ``src`` (else a copy, fsynced: a file system without hard links); False when neither
    works (nothing left at ``dst``)."""
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copyfile(src, dst)
            with open(dst, "rb") as fh:
                os.fsync(fh.fileno())
        except OSError:
            dst.unlink(missing_ok=True)
            return False
    return True


def write(snap: Path, store, vectors: bool) -> list[list]:
    """The stored fields of ``store`` (a :class:`.chunks.ChunkStore`) as chunk files under ``snap`` (fsynced):
    the previous snapshot's files linked while the fields begin with their rows, the rows after them in a new
    file. ``vectors``: with the ``vector`` column (not with HNSW). :returns: ``meta.json``'s ``chunk_files``."""
    n, keep, at, prefix = len(store.fields), [], 0, store.fields.prefix or []
    if n <= chunkstore.BATCH_ROWS and [f[1] for f in prefix] != [n]:  # (up to one record batch of rows: one file,
        prefix = []                                                  # whose single batch the compiled gather reads)
    for path, rows, crc in prefix:
        if at + rows > n or crc is None:
            break
        keep.append((path, at, rows, crc))
        at += rows
    keep = keep[:kept([k[2] for k in keep], n)]  # (each at least twice the rows after it)
    at = sum(k[2] for k in keep)
    out = []
    for path, start, rows, crc in keep:
        if not link(path, snap / name(start)):
            at = start
            break
        out.append([name(start), rows, crc])
    if at < n or not out:
        got = []
        fsync_write_with(snap / name(at), lambda f: got.append(records.write_ipc(f, store.batches(vectors, start=at))))
        out.append([name(at), got[0], crc_of(snap / name(at))])  # (read back from the page cache: ~0.25 s a GB)
    return out
