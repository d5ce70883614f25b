"""Which failures are a data directory that cannot be written (a full disk, an exhausted quota, a
read-only file system, an I/O error), whether raised here (an ``OSError``) or reported by a shard
process (its error text ends in ``OSError: [Errno N] ...``, see :mod:`..shards.worker`)."""

from __future__ import annotations

import errno
import re

#: errno -> what it means for the data directory
DISK_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
               errno.EFBIG: "a file reached the size limit", errno.EROFS: "the file system is read-only",
               errno.EIO: "an I/O error"}
_ERRNO_RE = re.compile(r"\bOSError: \[Errno (\d+)\]")


def disk_error(exc: BaseException) -> str | None:
    """What ``exc`` says about the data directory (a :data:`DISK_ERRNOS` value), or None when it
    is not a failed write to it."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return DISK_ERRNOS[exc.errno]
    m = _ERRNO_RE.search(str(exc))
    return DISK_ERRNOS.get(int(m.group(1))) if m else None
