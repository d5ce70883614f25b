"""Which failures are a data directory that cannot be written (a full disk, an exhausted quota, a
read-only file system, an I/O error), whether raised here (an ``OSError``) or reported by a shard
process (its error text ends in ``OSError: [Errno N] ...``, see :mod:`..shards.worker`)."""

from __future__ import annotations

import errno
import re
import time
import traceback

from .objstore import StorageWriteError

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


#: seconds before a shard prints the traceback of a disk error of the same kind again
DISK_TRACEBACK_EVERY_S = 600.0
_printed: dict[str, float] = {}  # (per process) disk error kind -> time.monotonic() of its last traceback


def print_failure(exc: BaseException) -> None:
    """Print the traceback of ``exc``, the exception being handled (a shard operation that
    failed; its caller gets the message only), to the service log, except what the frontend
    already logs once per change: a :class:`~.objstore.StorageWriteError`, and a disk error
    (:func:`disk_error`) of a kind printed in the last :data:`DISK_TRACEBACK_EVERY_S` seconds (a
    full disk fails every write and every periodic snapshot, one every 30 s)."""
    if isinstance(exc, StorageWriteError):
        return
    kind = disk_error(exc)
    if kind is not None:
        now = time.monotonic()
        if now - _printed.get(kind, -DISK_TRACEBACK_EVERY_S) < DISK_TRACEBACK_EVERY_S:
            return
        _printed[kind] = now
    traceback.print_exc()
