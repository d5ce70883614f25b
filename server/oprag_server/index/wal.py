"""Append-only write-ahead logs with checksummed records.

Record framing: ``u32 length | u32 crc32(payload) | payload`` (little endian); the payload is a
pickled dict. :meth:`WriteAheadLog.append` returns only after ``fsync``. Reading stops at the
first torn or corrupt record. When no intact record follows it (a crash mid-append: a torn tail)
:meth:`WriteAheadLog.open` truncates the file there, with a WARNING, so a partial write never
corrupts what was durable before it. When intact records follow it, or it is the last record and
whole (:func:`whole_tail`), the bytes were damaged after they were written (a disk or an
operator): :meth:`~WriteAheadLog.open` then raises
:class:`LogDamaged` and leaves the file as it is, since cutting there would drop acknowledged
records (trial55b); :func:`salvage` is the operator's way past it. An append that fails
while the process lives (a full disk, an I/O error) cuts the file back to where it was before
raising: otherwise its torn bytes would sit in front of the records acknowledged after the disk
has room again, and the next :meth:`~WriteAheadLog.open` would drop those with it.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

_HEAD = struct.Struct("<II")
log = logging.getLogger("oprag")


class LogDamaged(RuntimeError):
    """(:meth:`WriteAheadLog.open`) intact records follow a damaged span of the log: the file is
    left as it is. Attributes: ``path``, ``start`` and ``end`` (the damaged bytes ``[start, end)``),
    ``after`` (the intact records after them)."""

    def __init__(self, path: Path, start: int, end: int, after: int) -> None:
        self.path, self.start, self.end, self.after = path, start, end, after
        what = (f"and {after} intact records follow them" if after else
                "and they are the last record, whole (its length reaches the end of the file and it ends as a record "
                "does)")
        super().__init__(
            f"{path}: bytes {start}-{end} of {path.stat().st_size} are damaged (a record whose CRC-32 or framing is "
            f"wrong) {what}, so this is not a torn tail from a crash; the log is left "
            f"as it is. Restore the file from a backup, or run `oprag salvage-log {path}` to keep every intact record "
            f"(the original is kept as {keep_name(path).name}; the records in the damaged bytes are lost, and a start that "
            "finds a committed write missing still refuses)")


def encode_record(record: dict[str, Any]) -> bytes:
    """One framed record: ``u32 length | u32 crc32(payload) | pickle payload``."""
    payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def frames(data: Any) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each intact frame's payload in ``data`` (bytes, a memoryview or a read-only
    mmap), from the start up to the first frame whose length runs past the end or whose CRC-32 does
    not match: :func:`encode_record`'s framing, not unpickled."""
    size, pos = len(data), 0
    with memoryview(data) as view:  # (released on return or close: an mmap can be closed after)
        while pos + _HEAD.size <= size:
            n, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + n
            if end > size or zlib.crc32(view[pos + _HEAD.size:end]) != crc:
                return
            yield pos + _HEAD.size, end
            pos = end


def parse_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The intact records framed in ``data`` (:func:`frames`, each one unpickled) and the byte offset
    where the intact prefix ends."""
    out: list[dict[str, Any]] = []
    pos = 0
    for start, end in frames(data):
        try:
            out.append(pickle.loads(data[start:end]))
        except Exception:  # noqa: BLE001 - a corrupt record ends the intact prefix
            break
        pos = end
    return out, pos


def next_intact(data: bytes, pos: int) -> int | None:
    """The offset of the first intact record starting after byte ``pos`` of ``data`` (its length
    fits, its payload opens as :func:`encode_record`'s pickles do -- PROTO 4 or 5 then a FRAME
    that fits -- and its CRC-32 matches), or None.

    Cost: a scan for 0x80 bytes; the CRC only of candidates whose header and pickle opening fit (a
    torn 32 MiB tail of random bytes: ~0.1 s)."""
    view, end = memoryview(data), len(data)
    at = pos + 1
    while True:
        at = data.find(b"\x80", at + _HEAD.size) - _HEAD.size  # a candidate's payload starts with PROTO (0x80)
        if at < 0 or at + _HEAD.size + 11 > end:
            return None
        n, crc = _HEAD.unpack_from(data, at)
        body = at + _HEAD.size
        if (data[body + 1] in (4, 5) and data[body + 2] == 0x95 and body + n <= end
                and int.from_bytes(data[body + 3: body + 11], "little") + 11 <= n
                and zlib.crc32(view[body: body + n]) == crc):
            return at
        at += 1


def whole_tail(data: bytes, pos: int) -> bool:
    """Whether the bad record at ``pos`` is the last one and whole: its length reaches the end of
    ``data`` exactly and its payload ends in the pickle's STOP (a record written to its end, then
    damaged: a crash cuts a record short, or leaves zeros where its data never reached the disk)."""
    if pos + _HEAD.size > len(data):
        return False
    n = _HEAD.unpack_from(data, pos)[0]
    return n >= 2 and pos + _HEAD.size + n == len(data) and data[-1:] == b"." and any(data[-16:-1])


def parse_spans(data: bytes) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """Every intact record of ``data``, skipping damaged spans, and those spans ``[start, end)``
    (a span at the end runs to ``len(data)``). For :func:`salvage` and :class:`LogDamaged`."""
    out: list[dict[str, Any]] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        recs, good = parse_records(data[pos:])
        out.extend(recs)
        pos += good
        if pos >= len(data):
            break
        nxt = next_intact(data, pos)
        spans.append((pos, len(data) if nxt is None else nxt))
        if nxt is None:
            break
        pos = nxt
    return out, spans


def keep_original(path: Path, data: bytes) -> Path:
    """Write ``data`` (a log's bytes before a salvage rewrites it) to ``<path>.damaged``, or ``.damaged.1``, ... when
    that exists (an earlier salvage's original is never overwritten); fsync'ed. :returns: its path."""
    keep = keep_name(path)
    fsync_write(keep, data)
    return keep


def keep_name(path: Path) -> Path:
    """``<path>.damaged``, or the first of ``.damaged.1``, ``.damaged.2``, ... that does not exist."""
    keep, k = path.with_name(path.name + ".damaged"), 1
    while keep.exists():
        keep, k = path.with_name(f"{path.name}.damaged.{k}"), k + 1
    return keep


def salvage(path: Path) -> tuple[int, list[tuple[int, int]], Path | None]:
    """Rewrite the log at ``path`` with every intact record, in order, skipping its damaged spans
    (the operator's step past :class:`LogDamaged`). The original file is kept as
    ``<path>.damaged`` first (fsync'ed; ``.damaged.1``, ... when that exists). :returns: ``(records kept, damaged spans, the kept
    copy or None when nothing was damaged)``. :raises OSError: reading or writing failed."""
    data = path.read_bytes()
    records, spans = parse_spans(data)
    if not spans:
        return len(records), [], None
    keep = keep_original(path, data)
    cuts = [0, *(x for span in spans for x in span), len(data)]  # the intact records' bytes, unchanged
    fsync_write(path, b"".join(data[a:b] for a, b in zip(cuts[::2], cuts[1::2])))
    return len(records), spans, keep


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
        self._ready = False  # opened (open() or reset() ran, and no failed append left bytes it could not cut)
        self._cut: int | None = None  # a torn tail's start: cut there before the first append
        self.torn = b""  # the torn tail open() found (its bytes, for a caller that can tell what it was)
        self.left = False  # the last failed append may have left its record in the file (its cut-back failed)
        self.warn: Callable[[str], None] | None = None  # where open() says what it dropped (default: the "oprag" logger)

    def open(self) -> list[dict[str, Any]]:
        """Open the log for appending (created when missing). A torn tail is dropped (WARNING) and cut
        only by the first append, so a start refused after this leaves its bytes (trial56 F4). :returns: the
        intact records.

        :raises LogDamaged: intact records follow a damaged span (the file is not changed)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        records, good = parse_records(data)
        self.close()
        self._cut, self.torn = None, data[good:]
        if len(data) != good:
            nxt = next_intact(data, good)
            if nxt is not None:
                raise LogDamaged(self.path, good, nxt, len(parse_spans(data)[0]) - len(records))
            if whole_tail(data, good):
                raise LogDamaged(self.path, good, len(data), 0)
            line = (f"{self.path}: a torn tail of {len(data) - good} bytes at byte {good} is dropped (a record cut "
                    "short by a crash while it was written: never acknowledged; cut at the first append)")
            log.warning("%s", line) if self.warn is None else self.warn(line)
            self._cut = good
        self._ready = True
        if self._cut is None:  # (an intact log is held open, a missing one created, at once: as before)
            self._file()
        return records

    @property
    def usable(self) -> bool:
        """Whether appends are taken (False after a failed append whose cut-back failed, until the log is
        opened or reset again)."""
        return self._ready

    def check(self) -> None:
        """:raises OSError: EIO while appends are refused (not :attr:`usable`)."""
        if not self._ready:
            raise OSError(errno.EIO, f"write-ahead log {self.path} refuses appends: an earlier failed append "
                                     "could not be undone (restart the server: its start drops the torn record)")

    def _file(self):
        """The file opened for appending (created, or its torn tail cut, at the first call).
        :raises OSError: EIO after a failed append that could not be undone (see :meth:`append_framed`)."""
        if self._f is None:
            self.check()
            f = open(self.path, "ab", buffering=0)  # (unbuffered: append_framed writes with os.write)
            try:
                if self._cut is not None:
                    os.ftruncate(f.fileno(), self._cut)
                    os.fsync(f.fileno())
                _fsync_dir(self.path.parent)
            except BaseException:
                f.close()
                raise
            self._f, self._cut = f, None
        return self._f

    def append(self, record: dict[str, Any]) -> None:
        """Append one record durably (written and fsync'ed before returning)."""
        self.append_framed(encode_record(record))

    def append_framed(self, data: bytes) -> None:
        """Append records already framed by :func:`encode_record` durably (written and fsync'ed).

        :raises OSError: the write or the fsync failed (ENOSPC, EIO, EFBIG, ...). The file is then
            cut back to its length before the call, so nothing of ``data`` stays in it; if even
            that fails, the log refuses every later append (EIO) until it is opened again, which
            drops a torn tail."""
        self.left = False
        fd = self._file().fileno()
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
                self._f, self._ready, self.left = None, False, True
            raise

    def reset(self, keep: list[dict[str, Any]] | None = None) -> None:
        """Atomically replace the log with ``keep`` (default: empty): temp file, fsync, rename."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for r in keep or []:
                f.write(encode_record(r))
            f.flush()
            os.fsync(f.fileno())
        self.close()
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._ready, self._cut = True, None
        self._file()

    def close(self) -> None:
        """Close the file; appends are refused (EIO) until :meth:`open` or :meth:`reset`, as before the lazy cut."""
        if self._f is not None:
            self._f.close()
            self._f = None
        self._ready = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(read_records(self.path)[0])
