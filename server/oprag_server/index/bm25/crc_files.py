"""CRC-32s of a snapshot's BM25 postings files (``postings/crc32.json``), checked when a start loads them.

A flipped byte in ``doc_len.npy``, ``tf.npy``, ``offsets.npy`` or ``terms.json`` was served: every score moved, and a
query for a term that 8 chunks hold returned 100 hits, silently; the next snapshots linked the damaged files forward
(trial55 #2). Now each file's CRC-32 (zlib) is listed beside them; :func:`check` reads every listed file back and
raises ``ValueError`` naming the first that differs, and the caller (:func:`...shards.snapshot._load_postings`) logs it
and analyses the stored texts again: the postings are derived data, the stored texts have CRCs of their own
(:mod:`...shards.chunk_files`). ``delta.npz`` carries its own CRC (:mod:`.delta_files`).

Files linked from an earlier snapshot are not read again to write the list: a CRC is remembered per file identity
(device, inode, size, modification time; files are never written in place), from the check of a load or from the
write that computed it. A segment a merge wrote (its spill files) is read once, by the snapshot that links it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .files import crc_of as _read_crc

NAME = "crc32.json"
#: (st_dev, st_ino, st_size, st_mtime_ns) -> CRC-32 of that file's bytes
_KNOWN: dict[tuple[int, int, int, int], int] = {}


def _key(p: Path) -> tuple[int, int, int, int]:
    st = os.stat(p)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def crc_of(p: Path) -> int:
    """CRC-32 of file ``p`` (remembered per file identity; else read, :func:`.files.crc_of`). :raises OSError:"""
    k = _key(p)
    c = _KNOWN.get(k)
    if c is None:
        c = _read_crc(p)
        if len(_KNOWN) > 4096:  # (a long-running shard: only the files of its last snapshots matter)
            _KNOWN.clear()
        _KNOWN[k] = c
    return c


def write(d: Path, files: list[Path]) -> list[Path]:
    """List the CRC-32 of each of ``files`` (all under ``d``) in ``d / crc32.json``. :returns: ``files`` and the
    list (the caller fsyncs them). :raises OSError:"""
    out = Path(d) / NAME
    out.unlink(missing_ok=True)  # (never written in place)
    out.write_text(json.dumps({Path(f).name: crc_of(Path(f)) for f in files}))
    return [*files, out]


def check(d: Path) -> None:
    """Check every file ``d / crc32.json`` lists (nothing when there is no list: a snapshot from before it).
    :raises ValueError: the list cannot be read, or a file's CRC-32 differs (named). :raises OSError: a listed file
    is missing."""
    p = Path(d) / NAME
    if not p.exists():
        return
    try:
        listed = json.loads(p.read_text())
        items = [(str(n), int(c)) for n, c in listed.items()]
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{p} cannot be read: {exc}") from exc
    for name, want in items:
        f = Path(d) / name
        k = _key(f)
        _KNOWN.pop(k, None)  # (read it: a load is the check)
        if crc_of(f) != want:
            _KNOWN.pop(k, None)
            raise ValueError(f"{f} does not match its CRC-32 in {NAME} (the file is damaged)")
