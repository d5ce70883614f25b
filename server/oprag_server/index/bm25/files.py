"""Hard links to the files a memory-mapped segment serves (:meth:`.segment.Segment.save`).

A segment whose arrays map files (a snapshot's load, a merge's spill) writes the next snapshot
by linking those files, when each path still names the file that was mapped (same device and
inode), instead of writing the same bytes again. The snapshot code never writes a file in place
(:meth:`~.segment.Segment.save` unlinks a destination first), so a file shared by two
directories is never truncated under the other one. :func:`kept` is the rule by which a snapshot
stored in parts (the HNSW vectors', the stored fields') keeps the earlier ones linked.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

#: ``(directory, {file name: (st_dev, st_ino)})``
Source = tuple[Path, dict[str, tuple[int, int]]]


def file_ids(d: Path, names: list[str]) -> Source | None:
    """The device and inode of each file ``names`` under ``d``, or None when one cannot be
    read (``OSError``)."""
    try:
        return Path(d), {n: _file_id(Path(d) / n) for n in names}
    except OSError:
        return None


def link_same(src: Source, name: str, dst: Path) -> bool:
    """Hard-link ``dst`` (absent) to file ``name`` of ``src`` if that path still names the
    file noted in ``src``. :returns: False, nothing made, when it does not (removed, replaced)
    or on any ``OSError`` (another file system, no hard links, ``dst`` exists)."""
    d, ids = src
    try:
        if _file_id(d / name) != ids.get(name):
            return False
        os.link(d / name, dst)
    except OSError:
        return False
    return True


def kept(rows: list[int], n: int) -> int:
    """How many of a snapshot's leading parts (``rows`` each, in order, the first rows of ``n``) the next one keeps
    linked: each kept part holds at least twice the rows after it, up to ``n`` (the rows from the first that does not
    are written anew with the new ones), so there are at most log2(n) + 1 parts and a row is written O(log n) times
    (:mod:`..ann_vectors`, :mod:`...shards.chunk_files`)."""
    at = 0
    for j, r in enumerate(rows):
        if r < 2 * (n - at - r):
            return j
        at += r
    return len(rows)


def crc_of(p: Path) -> int:
    """CRC-32 (zlib) of file ``p``'s bytes, read 8 MB at a time into one buffer (through the page cache, not a map
    whose pages would count in the RSS). :raises OSError:"""
    c, buf = 0, bytearray(8 << 20)
    view = memoryview(buf)
    with open(p, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            c = zlib.crc32(view[:n], c)
    return c


def _file_id(p: Path) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_dev, st.st_ino
