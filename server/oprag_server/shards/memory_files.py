"""A snapshot's session memory: ``memory.json`` and ``memory_vectors.npy``, with their CRC-32s.

``memory.json`` holds the memory records and clear marks (:meth:`.memory.MemoryStore.dump`),
``memory_vectors.npy`` the records' vectors (float32, one row per record; a snapshot written
before it has them inside ``memory.json``). Both have no other copy once the write-ahead log is
reset, so a snapshot's ``meta.json`` keeps a CRC-32 (zlib) of each file's bytes under
``memory_crc``: an edit or a flipped byte that still parses (a changed digit of a timestamp, a
vector row) is refused at load with the file's name, where it used to be served (trial56b F5).
A snapshot without ``memory_crc`` (written before it) loads as before, unchecked.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from ..index.bm25.files import crc_of
from ..index.low_seeds_state import NPZ_ERRORS
from ..index.wal import fsync_write, fsync_write_with, keep_name
from .memory import MemoryStore
from .snapshot_current import current, read_meta, write_meta

JSON_NAME = "memory.json"
VECTORS_NAME = "memory_vectors.npy"


class _Crc:
    """A binary file object's ``write`` that also keeps the CRC-32 of what went through it."""

    def __init__(self, f) -> None:
        self.f, self.crc = f, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)


def write(snap: Path, memory: MemoryStore) -> dict[str, int]:
    """Write ``memory``'s files into snapshot directory ``snap`` (each fsync'ed, atomically).

    :returns: ``{file name: CRC-32 of its bytes}``, for ``meta.json``'s ``memory_crc``.
    :raises OSError: a write failed."""
    items, mv = memory.dump()
    data = json.dumps(items).encode()
    fsync_write(snap / JSON_NAME, data)
    crcs = {JSON_NAME: zlib.crc32(data)}
    if mv is not None:
        crcs[VECTORS_NAME] = save_npy(snap / VECTORS_NAME, mv)
    return crcs


def save_npy(path: Path, a: np.ndarray) -> int:
    """``np.save`` of ``a`` into ``path`` (fsync'ed, atomically), streamed through a CRC-32 (no copy of ``a`` in
    memory, no read-back). :returns: the file's CRC-32. :raises OSError: the write failed."""
    crc = [0]

    def save(f) -> None:
        w = _Crc(f)
        np.save(w, a, allow_pickle=False)
        crc[0] = w.crc
    fsync_write_with(path, save)
    return crc[0]


def load(snap: Path, meta: dict, memory: MemoryStore) -> None:
    """Load the session memory of snapshot directory ``snap`` into ``memory``, checking each file
    against ``meta["memory_crc"]`` when the snapshot has it.

    :raises RuntimeError: a file is missing, damaged (its CRC-32 differs) or cannot be parsed;
        the message names it (the memory has no other copy: restore the snapshot from a backup)."""
    crcs = meta.get("memory_crc") or {}
    mv = snap / VECTORS_NAME  # (absent in a snapshot written before it: vectors inside memory.json)
    try:
        data = (snap / JSON_NAME).read_bytes()
        for name, want in crcs.items():  # (memory.json's from the bytes read: the vectors' streamed from the file)
            if (got := zlib.crc32(data) if name == JSON_NAME else crc_of(snap / name)) != want:
                raise ValueError(f"{snap / name}: its CRC-32 {got:#010x} is not the {want:#010x} meta.json holds "
                                 "(the file is damaged or was edited)")
        items = json.loads(data)
        memory.load_json(items, np.load(mv, allow_pickle=False) if mv.exists() else None)
    except (*NPZ_ERRORS, TypeError, AttributeError, IndexError) as exc:
        raise RuntimeError(f"{snap / JSON_NAME} or {mv.name} beside it cannot be read ({type(exc).__name__}: "
                           f"{exc}): the session memory has no other copy; restore the snapshot from a backup, or run "
                           f"`oprag salvage-memory {snap.parent}` to start the shard without it (its documents are "
                           "kept; the session turns in the snapshot are lost)") from exc


def salvage(shard_dir: Path) -> str:
    """Give up the session memory of ``shard_dir``'s current snapshot when it cannot be loaded
    (:func:`load` raised): its files are kept as ``<name>.damaged`` (``.damaged.1``, ...), an
    empty ``memory.json`` takes their place, and ``meta.json`` gets its new CRC-32s. The turns
    the write-ahead log holds after the snapshot still replay on top. The caller holds the data
    directory's lock (:mod:`..salvage`).

    :returns: what was done, one line. :raises RuntimeError: no snapshot, or ``meta.json``
        cannot be read. :raises OSError: a file could not be written."""
    snap = current(shard_dir, None)
    if snap is None or not (snap / "meta.json").is_file():
        raise RuntimeError(f"{shard_dir}: no snapshot here (a shard directory holds CURRENT and snap-* directories)")
    meta = read_meta(snap)
    try:
        load(snap, meta, MemoryStore())
        return f"{snap}: the session memory loads ({JSON_NAME}); not changed"
    except RuntimeError as exc:
        why = str(exc.__cause__ or exc)
    kept = []
    for name in (JSON_NAME, VECTORS_NAME):
        if (snap / name).exists():
            keep = keep_name(snap / name)
            (snap / name).rename(keep)
            kept.append(keep.name)
    empty = b"[]"
    fsync_write(snap / JSON_NAME, empty)
    write_meta(snap, {**meta, "memory_crc": {JSON_NAME: zlib.crc32(empty)}})
    return (f"{snap}: the session memory could not be read ({why}); the shard now starts without it (an empty "
            f"{JSON_NAME}; the turns its write-ahead log holds after this snapshot still replay); kept as "
            f"{', '.join(kept) or 'nothing (no file was there)'}")
