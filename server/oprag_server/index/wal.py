"""Append-only write-ahead logs with checksummed records.

Record framing: ``u32 length | u32 crc32(payload) | payload`` (little endian); the payload is a
pickled dict. :meth:`WriteAheadLog.append` returns only after ``fsync``. Reading stops at the
first torn or corrupt record (a crash mid-append) and :meth:`WriteAheadLog.open` truncates the
file there, so a partial write never corrupts what was durable before it. An append that fails
while the process lives (a full disk, an I/O error) cuts the file back to where it was before
raising: otherwise its torn bytes would sit in front of the records acknowledged after the disk
has room again, and the next :meth:`~WriteAheadLog.open` would drop those with it.
"""

from __future__ import annotations

import errno
import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

_HEAD = struct.Struct("<II")


def encode_record(record: dict[str, Any]) -> bytes:
    """One framed record: ``u32 length | u32 crc32(payload) | pickle payload``."""
    payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def parse_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The intact records framed in ``data`` and the byte offset where the intact prefix ends."""
    out: list[dict[str, Any]] = []
    pos = 0
    while pos + _HEAD.size <= len(data):
        n, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + n
        if end > len(data):
            break
        payload = data[pos + _HEAD.size : end]
        if zlib.crc32(payload) != crc:
            break
        try:
            out.append(pickle.loads(payload))
        except Exception:  # noqa: BLE001 - a corrupt record ends the intact prefix
            break
        pos = end
    return out, pos


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """All intact records of a log and the byte offset where the intact prefix ends."""
    if not path.exists():
        return [], 0
    return parse_records(path.read_bytes())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temporary file, fsync, rename, fsync dir; creates
    the parent directory. :raises OSError: the write, rename or fsync failed."""
    fsync_write_with(path, lambda f: f.write(data))


def fsync_write_with(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """As :func:`fsync_write`, the contents written by ``write(file)`` (a binary file object):
    a large file is streamed to disk without a copy of it in memory. :raises OSError: as
    :func:`fsync_write`, or what ``write`` raises (the temporary file is then removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class WriteAheadLog:
    """One append-only log file. Not thread-safe (each owner appends from one thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = None

    def open(self) -> list[dict[str, Any]]:
        """Open for appending; drop a torn tail. :returns: the intact records."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records, good = read_records(self.path)
        if self.path.exists() and self.path.stat().st_size != good:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        self._f = open(self.path, "ab", buffering=0)  # (unbuffered: append_framed writes with os.write)
        _fsync_dir(self.path.parent)
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Append one record durably (written and fsync'ed before returning)."""
        self.append_framed(encode_record(record))

    def append_framed(self, data: bytes) -> None:
        """Append records already framed by :func:`encode_record` durably (written and fsync'ed).

        :raises OSError: the write or the fsync failed (ENOSPC, EIO, EFBIG, ...). The file is then
            cut back to its length before the call, so nothing of ``data`` stays in it; if even
            that fails, the log refuses every later append (EIO) until it is opened again, which
            drops a torn tail."""
        if self._f is None:
            raise OSError(errno.EIO, f"write-ahead log {self.path} refuses appends: an earlier failed append could "
                                     "not be undone (restart the server: its start drops the torn record)")
        fd = self._f.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError:
                self._f.close()
                self._f = None
            raise

    def reset(self, keep: list[dict[str, Any]] | None = None) -> None:
        """Atomically replace the log with ``keep`` (default: empty): temp file, fsync, rename."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for r in keep or []:
                f.write(encode_record(r))
            f.flush()
            os.fsync(f.fileno())
        if self._f is not None:
            self._f.close()
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._f = open(self.path, "ab", buffering=0)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(read_records(self.path)[0])
