"""Objects on storage every node reads, through ``pyarrow.fs``: an object store (S3, GCS) or a
local/shared path, chosen by URI (``s3://bucket/prefix``, ``gs://bucket/prefix``,
``file:///abs/path``; :func:`pyarrow.fs.FileSystem.from_uri`).

:class:`ObjectStore` is a key -> bytes map under one prefix (a ``SubTreeFileSystem``). A
:meth:`~ObjectStore.put` is durable when it returns: an object store acknowledges a PUT once it
stored the whole object; on a local filesystem the file and its directory are fsync'ed.
:meth:`~ObjectStore.put_atomic` replaces an object so that readers see the old or the new
bytes, never a part: an object store's PUT already is; locally it is a temporary file, fsync
and rename. :class:`MirroredLog` is a :class:`~.wal.WriteAheadLog` whose every record is also
put as one object (``<pos:020d>.rec``, framed and checksummed as in the log file) before
:meth:`~MirroredLog.append` returns.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from .log_extra import LocalNewer, local_extra, record_seqs  # noqa: F401 - re-exported (shards.storage)
from .wal import WriteAheadLog, encode_record, parse_records, read_records
from .wal import _fsync_dir as _fsync  # (any path: file or directory)

#: URI forms the message of a bad ``--storage-uri`` suggests
URI_FORMS = "s3://bucket/prefix, gs://bucket/prefix, file:///absolute/path or /absolute/path"


class StorageWriteError(OSError):
    """An object could not be written (the store refused it, or a log object already exists at
    that position: another server writes to the same storage). Nothing was stored."""

    def __init__(self, what: str) -> None:
        super().__init__(f"object storage write failed: {what}; nothing was stored")


class LogGapError(RuntimeError):
    """Log objects are missing between the snapshot's first position and the last one present."""


class ObjectStore:
    """Objects under ``root`` of a ``pyarrow.fs`` filesystem ``fs``; keys are ``/``-separated
    paths relative to ``root``. Thread-compatible (one owner at a time)."""

    def __init__(self, fs: Any, root: str, uri: str) -> None:
        import pyarrow.fs as pafs

        self.uri = uri
        self.root = root.rstrip("/")
        self.base = fs
        self.local = isinstance(fs, pafs.LocalFileSystem)
        self.fs = pafs.SubTreeFileSystem(self.root, fs) if self.root else fs

    @classmethod
    def from_uri(cls, uri: str) -> "ObjectStore":
        """:raises ValueError: the URI names no filesystem pyarrow can open (the message says
        why and which forms work)."""
        import pyarrow.fs as pafs

        try:
            fs, root = pafs.FileSystem.from_uri(uri)
        except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError (e.g. an unknown bucket region)
            hint = " (percent-encode spaces and other special characters: a space is %20)" if " " in uri else ""
            raise ValueError(f"{uri!r} is not a storage URI pyarrow can open ({type(exc).__name__}: {exc}){hint}; "
                             f"use {URI_FORMS}") from exc
        if isinstance(fs, pafs.LocalFileSystem) and not root.startswith("/"):
            raise ValueError(f"{uri!r}: a local storage path must be absolute (file:///absolute/path)")
        if isinstance(fs, pafs.LocalFileSystem) and not root.strip("/"):
            raise ValueError(f"{uri!r} names the filesystem root: use a directory of its own, e.g. file:///srv/oprag")
        return cls(fs, root, uri)

    def sub(self, prefix: str) -> "ObjectStore":
        """The objects under ``prefix`` (a store of its own; same filesystem)."""
        prefix = prefix.strip("/")
        return ObjectStore(self.base, f"{self.root}/{prefix}" if self.root else prefix,
                           f"{self.uri.rstrip('/')}/{prefix}")

    def _local_path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _mkparent(self, key: str) -> None:
        if self.local:  # (an object store has no directories)
            self.base.create_dir(os.path.dirname(self._local_path(key)), recursive=True)

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` durably (see the module docstring)."""
        self._mkparent(key)
        with self.fs.open_output_stream(key) as out:
            out.write(data)
        if self.local:
            path = self._local_path(key)
            _fsync(path)
            _fsync(os.path.dirname(path))

    def put_new(self, key: str, data: bytes) -> None:
        """:meth:`put` only if there is no object ``key`` yet (write-if-absent: locally an
        ``O_EXCL`` create; on an object store a metadata check just before the PUT, which a
        concurrent writer can still race -- the owner lease, :mod:`.lease`, excludes those).

        :raises StorageWriteError: the object exists, or the store refused the write."""
        import pyarrow.fs as pafs

        try:
            if self.local:
                self._mkparent(key)
                path = self._local_path(key)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    view = memoryview(data)
                    while view:  # (a full disk can take part of a write without an error: a short write)
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except BaseException:  # (our own object, never acknowledged: its position is free again;
                    os.unlink(path)    # left there, every later write found it "already exists": trial57)
                    raise
                finally:
                    os.close(fd)
                _fsync(os.path.dirname(path))
                return
            if self.fs.get_file_info(key).type != pafs.FileType.NotFound:
                raise FileExistsError(key)
            self.put(key, data)
        except FileExistsError as exc:
            raise StorageWriteError(f"{self.uri}/{key} already exists (is another server writing to this "
                                    "storage?)") from exc
        except OSError as exc:
            raise StorageWriteError(f"{self.uri}/{key}: {exc}") from exc

    def put_atomic(self, key: str, data: bytes) -> None:
        """Replace ``key`` by ``data``; a reader sees the old or the new object whole."""
        if not self.local:
            self.put(key, data)  # an object store's PUT replaces the object atomically
            return
        tmp = f"{key}.tmp-{uuid.uuid4().hex}"
        self.put(tmp, data)
        self.fs.move(tmp, key)  # rename(2) on a local filesystem
        _fsync(os.path.dirname(self._local_path(key)))

    def get(self, key: str) -> bytes | None:
        """The object's bytes; None when there is no such object."""
        try:
            with self.fs.open_input_stream(key) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get_many(self, keys: list[str], threads: int = 16) -> list[bytes | None]:
        """:meth:`get` of each key, ``threads`` at a time (an object store's GETs are round trips)."""
        if len(keys) < 2:
            return [self.get(k) for k in keys]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(keys))) as ex:
            return list(ex.map(self.get, keys))

    def list(self, prefix: str = "") -> list[str]:
        """Keys of every object under ``prefix`` (recursive), sorted; ``[]`` when none."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(prefix.strip("/"), recursive=True, allow_not_found=True)
        try:
            infos = self.fs.get_file_info(sel)
        except FileNotFoundError:
            return []
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and ".tmp-" not in i.path.rsplit("/", 1)[-1])

    def delete(self, keys: list[str]) -> None:
        """Delete objects (missing ones are ignored); on a local filesystem also the directories
        that leaves empty below this store's root (an object store has none: trial57 #12, a deleted
        snapshot's empty ``snap/<name>/postings/`` directories piled up)."""
        for k in keys:
            try:
                self.fs.delete_file(k)
            except FileNotFoundError:
                pass
        if self.local:  # (never this store's root or its top folders, wal/ snap/ commits/: listed again)
            for rel in sorted({os.path.dirname(k) for k in keys}, key=len, reverse=True):
                while rel.count("/") >= 1:
                    try:
                        os.rmdir(self._local_path(rel))  # (only when empty)
                    except OSError:
                        break
                    rel = os.path.dirname(rel)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``."""
        self.delete(self.list(prefix))

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (server side on an object store)."""
        self._mkparent(dst)
        self.fs.copy_file(src, dst)

    def copy_in(self, src: "ObjectStore", key: str) -> None:
        """Copy object ``key`` of ``src`` (a store on the same filesystem) to the same key here."""
        self._mkparent(key)
        self.base.copy_file(f"{src.root}/{key}", f"{self.root}/{key}")

    def probe(self) -> None:
        """Check that objects can be written, listed, read and deleted here (a start-up check).

        :raises OSError: any of them failed (the filesystem's own error)."""
        key = f"probe-{uuid.uuid4().hex}"
        self.put(key, b"oprag")
        try:
            if self.get(key) != b"oprag" or key not in self.list():
                raise OSError(f"{self.uri}: an object written could not be read back")
        finally:
            self.delete([key])


def record_key(pos: int) -> str:
    """Object key of log position ``pos`` (zero-padded: key order = position order)."""
    return f"{pos:020d}.rec"


def record_pos(key: str) -> int | None:
    """Log position of a record key (None: not a record)."""
    name = key.rsplit("/", 1)[-1]
    stem = name[:-4] if name.endswith(".rec") else ""
    return int(stem) if stem.isdigit() else None


def read_log_objects(store: ObjectStore, first: int | None = 0) -> tuple[list[dict], int]:
    """The intact records of the log objects at positions >= ``first``, in position order, and
    the next free position (after every record object present, intact or not). A torn object
    (a local crash mid-put: never acknowledged) is skipped.

    :raises LogGapError: a position between ``first`` and the last one present has no object
        (records were lost: serving without them would silently drop acknowledged writes).
        ``first`` None: from the lowest position present (a log with no snapshot pointer)."""
    listed = store.list()
    if first is None:
        first = min((p for k in listed if (p := record_pos(k)) is not None), default=0)
    keys, nxt = [], first
    for key in listed:
        pos = record_pos(key)
        if pos is None:
            continue
        nxt = max(nxt, pos + 1)
        if pos >= first:
            keys.append(key)
    if len(keys) != nxt - first:
        have = {record_pos(k) for k in keys}
        gone = [p for p in range(first, nxt) if p not in have]
        raise LogGapError(f"{store.uri}: log objects {_ranges(gone)} are missing (the log must be contiguous "
                          f"from position {first}, where the current snapshot ends, to {nxt - 1}); records there "
                          "were lost, so the shard is not served")
    out = []
    for key, data in zip(keys, store.get_many(keys)):  # (in key order = position order)
        recs = parse_records(data)[0][:1] if data is not None else []
        if data and not recs and written_whole(data):  # (a torn one is skipped: a crash cut its put short)
            raise LogGapError(f"{store.uri}/{key}: this log object is damaged (its CRC-32 or length does not match, "
                              "and it was written whole: not a put a crash cut short), so the record in it is lost "
                              "and the shard is not served without it; restore the object from a backup")
        out.extend(recs)
    return out, nxt


def written_whole(data: bytes) -> bool:
    """Whether a log object that does not parse holds a whole record (damaged after it was written: trial57 #2, #3):
    its payload opens as :func:`.wal.encode_record`'s pickles do (PROTO 4 or 5, then a FRAME) with a frame that ends
    exactly at the object's end, in the pickle's STOP; a put a crash cut short holds a prefix of that."""
    body = data[8:]
    if len(body) < 12 or body[0] != 0x80 or body[1] not in (4, 5) or body[2] != 0x95:
        return False
    return 11 + int.from_bytes(body[3:11], "little") == len(body) and body[-1:] == b"."


def _ranges(ps: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (at most 5 ranges shown)."""
    out: list[list[int]] = []
    for p in ps:
        if out and out[-1][1] == p - 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    txt = [f"{a}-{b}" if a != b else f"{a}" for a, b in out[:5]]
    return ", ".join(txt) + (f" and {len(out) - 5} more ranges" if len(out) > 5 else "")


#: the object a log's seeding from a local file (:func:`open_mirrored`) puts first and deletes last
SEEDING = "SEEDING"


def open_mirrored(path: Any, store: ObjectStore) -> "MirroredLog":
    """A :class:`MirroredLog` over ``store`` whose local file ``path`` is first rewritten from
    the record objects there, in position order; a store holding none is seeded from the local
    file (moving an existing log onto storage), between a :data:`SEEDING` object put first and
    deleted last: a start that finds it (a seeding cut short) seeds the store again from the local
    file, not the file from the store's part, and refuses when the file holds nothing (another data
    directory's seeding). For a log whose records stay valid until the owner deletes them all at
    once (the frontend's commit log): no snapshot pointer. :raises RuntimeError: (that refusal)"""
    if store.get(SEEDING) is not None:  # (a seeding start cut short: trial59b F2)
        if not (os.path.exists(path) and read_records(path)[0]):
            raise RuntimeError(f"{store.uri} holds a commit log whose seeding from another data directory was cut "
                               f"short ({SEEDING} is still there), and {path} holds none: start once with the data "
                               "directory it was seeded from (it is seeded again), or move the storage's prefix aside")
        left = [k for k in store.list() if k != SEEDING]
        logging.getLogger("oprag").warning("%s: a seeding of the commit log from %s was cut short (%d objects): they "
                                           "are deleted and it is seeded again", store.uri, path, len(left))
        store.delete(left)
        nxt = 0
    else:
        recs, nxt = read_log_objects(store, None)
        if nxt and (said := local_extra(path, recs, store.uri)) is not None:
            logging.getLogger("oprag").log(*said)
    if nxt == 0:  # (seeded: the marker first, the records, then the marker deleted)
        if recs := read_records(path)[0]:
            store.put(SEEDING, b"")
            for pos, rec in enumerate(recs):
                store.put(record_key(pos), encode_record(rec))
            store.delete([SEEDING])
        nxt = len(recs)
    local = WriteAheadLog(path)
    local.reset(recs)
    local.close()
    return MirroredLog(path, store, nxt)


class MirroredLog(WriteAheadLog):
    """A write-ahead log file (the working copy) whose every appended record is also one
    object in ``store`` at the next log position, put before :meth:`append` returns.

    :param next_pos: the first free log position in ``store``.
    Attribute ``first``: the position of the oldest record a reader of the store still needs
    (moved by :meth:`reset`).
    """

    def __init__(self, path: Any, store: ObjectStore, next_pos: int, first: int = 0) -> None:
        super().__init__(path)
        self.store, self.pos, self.first = store, next_pos, first
        self.puts = 0  # objects put (for tests and benches)

    def _put(self, record: dict | bytes) -> None:
        data = record if isinstance(record, bytes) else encode_record(record)
        self.store.put_new(record_key(self.pos), data)  # never over a record already there
        self.pos += 1
        self.puts += 1

    def append(self, record: dict[str, Any]) -> None:
        """Append locally (fsync), then put the record as one object (durable when this returns).

        :raises StorageWriteError: the object was not stored (the caller must not acknowledge)."""
        data = encode_record(record)  # pickled once for both copies
        self.append_framed(data)
        self.left = True  # (the local file holds it from here: a failed put leaves it there)
        self._put(data)
        self.left = False

    def reset(self, keep: list[dict[str, Any]] | None = None) -> None:
        """Replace the local log with ``keep`` and put ``keep`` again at new positions, which
        become :attr:`first` (the caller switches the snapshot pointer to it, then deletes what
        is older: :meth:`older_keys`)."""
        first = self.pos
        for r in keep or []:
            self._put(r)
        self.first = first
        super().reset(keep)

    def older_keys(self) -> list[str]:
        """Keys of the record objects before :attr:`first` (garbage once the snapshot that
        covers them is current)."""
        return [k for k in self.store.list() if (p := record_pos(k)) is not None and p < self.first]
