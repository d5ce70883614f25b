"""An HNSW structure's stored vectors saved beside its graph, in parts that later snapshots link (trial52 #2).

With HNSW the FAISS structure holds the only copy of a shard's vectors (``IndexHNSWFlat``'s storage, float32[A, D]:
768 MB of a 902 MB file at 500K vectors). Any insert changes the graph, so every snapshot after a write wrote the
whole file again: 1.5-2.5 s of a 1M-chunk shard's 4-6 s snapshot, while that shard holds every write (bench/RESULTS.md,
session 54). The vectors themselves only grow at the end between renumberings and compactions, so they are now saved
apart from the graph:

* ``<name>``: the graph, written by FAISS without its storage (``IO_FLAG_SKIP_STORAGE``: ~140 MB at 500K vectors);
* ``<name>.v<start>.npy``: rows ``[start, start + rows)`` of the storage (``np.save``, float32), contiguous from 0;
* ``<name>.vectors.json``: ``{"rows", "dim", "parts": [{"name", "start", "rows", "crc32"}], "graph_crc32"}``,
  written last (``graph_crc32``: the graph file's bytes, checked before FAISS reads it; absent in older files).

A snapshot links a part of the previous one (:func:`.bm25.files.link_same`: the same device and inode) when the
storage still holds exactly those rows: same position, same row count and the same CRC-32 (``zlib.crc32`` of the
rows' bytes, ~0.2 s for 768 MB here), so a renumbering or a compaction, which move rows, writes them anew, and
nothing else needs to tell this module what changed. The rows after the linked parts go to one new part. A part is
kept only while it holds at least twice the rows that follow it (from the first that does not, the parts are
rewritten with the new rows), so a structure has at most log2(A) + 1 parts. No file is written in place: a name
is unlinked before it is written or linked.

A structure from a file written the old way (storage inside the graph file) loads as before.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from .bm25 import crc_files
from .bm25.files import Source, file_ids, kept, link_same

#: rows read into FAISS's storage at a time on load (:func:`_read_rows`)
LOAD_BLOCK = 65536


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def sidecar(path: Path) -> Path:
    """The parts list of the graph file ``path``."""
    return path.with_name(path.name + ".vectors.json")


def crc(rows: np.ndarray) -> int:
    """CRC-32 of a C-contiguous float32 block's bytes."""
    return zlib.crc32(memoryview(np.ascontiguousarray(rows)).cast("B"))


def write(index, path: Path, storage: np.ndarray, saved: tuple[list[dict], Source] | None,
          graph: tuple[Source, str] | None = None) -> bool:
    """Write HNSW ``index``'s graph to ``path`` and its ``storage`` (float32[A, D], the index's stored vectors) to
    parts beside it, linking the parts of ``saved`` (the parts list and files of the last write or load) that still
    hold the same rows. ``graph``: the file the graph was last written to or loaded from, when the structure is
    unchanged since (:meth:`.ann_persist.AnnPersist.write`): the graph is then linked, and so are the parts, whose
    rows are not checked again. Not fsynced (:func:`files` lists what to sync).

    :returns: True when every file is a link (nothing written but the parts list)."""
    faiss = _faiss()
    path = Path(path)
    remove(path)
    path.unlink(missing_ok=True)
    linked = graph is not None and link_same(graph[0], graph[1], path)
    if not linked:
        faiss.write_index(index, str(path), faiss.IO_FLAG_SKIP_STORAGE)
    n = int(storage.shape[0])
    keep, at = [], 0
    for p in (saved[0] if saved is not None else []):
        r = int(p["rows"])
        if int(p["start"]) != at or at + r > n or (not linked and crc(storage[at:at + r]) != int(p["crc32"])):
            break
        keep.append(p)
        at += r
    keep = keep[:kept([int(p["rows"]) for p in keep], n)]  # (each at least twice the rows after it)
    at = sum(int(p["rows"]) for p in keep)
    parts = []
    for p in keep:
        dst = _part(path, int(p["start"]))
        if not link_same(saved[1], p["name"], dst):  # (gone or replaced: written from here on)
            at = int(p["start"])
            break
        parts.append({**p, "name": dst.name})
    if at < n:
        dst = _part(path, at)
        with open(dst, "wb") as f:
            np.save(f, storage[at:n], allow_pickle=False)
        parts.append({"name": dst.name, "start": at, "rows": n - at, "crc32": crc(storage[at:n])})
        linked = False
    sidecar(path).write_text(json.dumps({"rows": n, "dim": int(storage.shape[1]), "parts": parts,
                                         "graph_crc32": crc_files.crc_of(path)}))  # (a linked graph: remembered)
    return linked


def _part(path: Path, start: int) -> Path:
    return path.with_name(f"{path.name}.v{start:012d}.npy")


def note(path: Path) -> tuple[list[dict], Source] | None:
    """The parts list of graph file ``path`` with its files' ids (for the next :func:`write`), or None when it has
    none or a file cannot be read."""
    try:
        parts = json.loads(sidecar(Path(path)).read_text())["parts"]
    except (OSError, ValueError, KeyError):
        return None
    src = file_ids(Path(path).parent, [p["name"] for p in parts])
    return None if src is None else (parts, src)


def read(path) -> object:
    """The FAISS structure in file ``path``; an HNSW graph written without its storage (:func:`write`) gets its
    vectors back from its parts, copied into FAISS's memory block by block, each part's CRC-32 checked (~0.2 s for
    768 MB here).

    :raises ValueError: a part cannot be read, its rows' CRC-32 differs from the one recorded, or the parts are
        missing rows, overlap or do not match the graph's vector count or width (the message names the file).
    :raises OSError: the graph's file cannot be read."""
    faiss = _faiss()
    side = sidecar(Path(path))
    try:  # (read once: the graph's CRC-32 first, then the parts; an error is reported once FAISS read the graph)
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        meta = exc
    want = meta.get("graph_crc32") if isinstance(meta, dict) else None
    # (a graph FAISS still reads but whose bytes changed would be searched, or crash the shard at each start)
    if want is not None and (got := crc_files.crc_of(Path(path))) != int(want):
        raise ValueError(f"{path}: its CRC-32 is {got}, not the {want} {side.name} records: the HNSW graph file was "
                         "damaged after it was written")
    index = faiss.read_index(str(path))
    if not hasattr(index, "hnsw") or index.storage is not None:
        return index
    try:  # (missing, cut short, not this layout)
        if isinstance(meta, Exception):
            raise meta
        rows_all, dim, parts = int(meta["rows"]), int(meta["dim"]), list(meta["parts"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{side}: cannot be read ({exc!r})") from None
    n, d = int(index.ntotal), int(index.d)
    if rows_all != n or dim != d:
        raise ValueError(f"{side}: {meta['rows']} x {meta['dim']} vectors for a graph of {n} x {d}")
    flat = faiss.IndexFlat(d, index.metric_type)
    flat.codes.resize(n * d * 4)
    flat.ntotal = n
    dst = faiss.rev_swig_ptr(flat.get_xb(), n * d).reshape(n, d) if n else np.zeros((0, d), np.float32)
    at = 0
    for p in parts:
        part, r = Path(path).with_name(p["name"]), int(p["rows"])
        if int(p["start"]) != at or at + r > n:
            raise ValueError(f"{side}: part {p['name']} does not hold rows [{at}, {at + r}) of {n}")
        _read_rows(part, dst[at:at + r])
        if (got := crc(dst[at:at + r])) != int(p["crc32"]):  # (a damaged file of the same size: trial54 #1)
            raise ValueError(f"{part}: its rows' CRC-32 is {got}, not the {p['crc32']} {side.name} records: "
                             "the file was damaged after it was written")
        at += r
    if at != n:
        raise ValueError(f"{side}: the parts hold {at} of the graph's {n} vectors")
    index.storage = flat
    index.own_fields = True
    flat.this.disown()
    return index


def _read_rows(part: Path, out: np.ndarray) -> None:
    """Read the ``.npy`` file ``part`` into ``out`` (float32[r, D], C-contiguous) with ``readinto``, ``LOAD_BLOCK``
    rows at a time: no map of the file, whose touched pages would count in the RSS until it is unmapped (768 MB a
    500K-vector part, next to the same rows in FAISS's memory, at a start).

    :raises ValueError: the file cannot be read, is cut short, or holds another shape or dtype (named)."""
    fmt = np.lib.format
    try:
        with open(part, "rb") as fh:
            major, _ = fmt.read_magic(fh)
            shape, fortran, dtype = (fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0)(fh)
            if shape != out.shape or fortran or dtype != np.dtype("<f4"):
                raise ValueError(f"it does not hold rows of {out.shape} float32: {shape} {dtype}"
                                 + (" (Fortran order)" if fortran else ""))
            view, step = memoryview(out.reshape(-1)).cast("B"), LOAD_BLOCK * out.shape[1] * 4
            for i in range(0, len(view), step):
                if fh.readinto(view[i:i + step]) != len(view[i:i + step]):
                    raise ValueError(f"cut short before byte {i + step} of its rows")
    except (OSError, ValueError) as exc:  # (missing, truncated, not an .npy file)
        raise ValueError(f"{part}: cannot be read ({exc})") from None


def files(path: Path) -> list[Path]:
    """The files of a structure written to ``path``: the graph, and its parts and parts list when it has them."""
    path = Path(path)
    side = sidecar(path)
    if not side.exists():
        return [path]
    return [path, *(path.with_name(p["name"]) for p in json.loads(side.read_text())["parts"]), side]


def remove(path: Path) -> None:
    """Unlink the parts list and parts named after ``path`` (before anything is written there: no file is written
    in place, and a structure of another kind leaves none behind)."""
    path = Path(path)
    for p in path.parent.glob(f"{path.name}.v*.npy"):
        p.unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)
