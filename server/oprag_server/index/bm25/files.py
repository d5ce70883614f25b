"""Hard links to the files a memory-mapped segment serves (:meth:`.segment.Segment.save`).

A segment whose arrays map files (a snapshot's load, a merge's spill) writes the next snapshot
by linking those files, when each path still names the file that was mapped (same device and
inode), instead of writing the same bytes again. The snapshot code never writes a file in place
(:meth:`~.segment.Segment.save` unlinks a destination first), so a file shared by two
directories is never truncated under the other one.
"""

from __future__ import annotations

import os
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


def _file_id(p: Path) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_dev, st.st_ino
