"""A shard's snapshot and write-ahead log on storage every node reads (``--storage-uri``: S3,
GCS or a shared path, through ``pyarrow.fs``; :mod:`oprag_server.index.objstore`).

The shard keeps working in its local directory exactly as without a URI (``snap-*/``,
``CURRENT``, ``wal.log``, :mod:`.snapshot`); the storage holds what a shard starting on a node
with an empty directory needs. Layout under ``<uri>/[replica-r/]shard-<i>/``:

* ``wal/<pos:020d>.rec``: every log record (prepared transaction, memory record) as one object,
  put before the shard answers the request that wrote it. A transaction is acknowledged only
  after every shard prepared it, so every acknowledged write is in storage: one PUT per shard
  per transaction (and per memory record).
* ``snap/<name>/...``: each snapshot's files, uploaded after it was written locally;
* ``CURRENT``: ``{"snapshot": name | null, "wal_from": pos}``, replaced atomically *after* the
  snapshot's files are all uploaded (a reader never sees a half-written snapshot: a crash
  before the switch leaves the previous snapshot current, and its log objects are still there).
  Then log objects before ``wal_from`` and other snapshots are deleted.

Starting (:meth:`ShardStorage.open_log`), storage is the authority: the current snapshot is
downloaded unless the local directory already holds it, and the local log is rewritten from the
log objects from ``wal_from`` on; then the shard loads as from a local directory. A storage
prefix holding nothing while the local directory holds a shard is seeded from it once its
snapshot has loaded (moving an existing data directory onto storage; a damaged snapshot is never
uploaded). Replicas catching up copy a sibling's current snapshot inside the storage
(:func:`copy_current`). The frontend's commit log is mirrored beside them
(``<uri>/commits/``, :meth:`oprag_server.engine.commit.CommitProtocol.open_log`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..index.objstore import (LogGapError, MirroredLog, ObjectStore, local_extra, read_log_objects, record_key,
                               record_pos, record_seqs)
from ..index.wal import WriteAheadLog, encode_record, fsync_write
from .snapshot_current import warn

logger = logging.getLogger("oprag")


class LocalCopyDamaged(RuntimeError):
    """(:func:`.snapshot.load`) the local copy of the storage's current snapshot ``snap`` could not
    be loaded (``__cause__``: the file, and what is wrong with it); the storage holds the same
    snapshot, so :meth:`ShardStorage.load_again` can download it again."""

    def __init__(self, snap: Path, exc: BaseException) -> None:
        self.snap = snap
        super().__init__(str(exc))


@contextmanager
def local_copy(storage: "ShardStorage | None", snap: Path) -> Iterator[None]:
    """Around the reads of the local snapshot ``snap``: with ``storage`` holding the same snapshot (not just
    downloaded), a file that cannot be read raises :class:`LocalCopyDamaged` in place of its own error."""
    try:
        yield
    except (ValueError, RuntimeError, OSError) as exc:
        if storage is not None and storage.downloaded:  # (trial59b F8: it named the local file, "no other copy")
            raise RuntimeError(f"the storage's copy of snapshot {snap.name}, just downloaded from {storage.store.uri}/"
                               f"snap/{snap.name}/, cannot be loaded: {exc}. The storage's objects are damaged: "
                               "restore them from a backup, or start once with the data directory that holds this "
                               "snapshot whole (its next snapshot replaces the storage's copy)") from exc
        if storage is None or storage.seeded:  # (seeded: the store holds no copy yet)
            raise
        raise LocalCopyDamaged(snap, exc) from exc


class LocalAhead(RuntimeError):
    """(:meth:`ShardStorage.open_log`) the local directory holds writes the storage lacks: not replaced by its copy."""


def _snap_seq(name: str | None) -> int:
    """The applied sequence number a snapshot's name carries (``snap-<seq:012d>-<ns>``); 0 for None or another name."""
    part = name.split("-") if name else []
    return int(part[1]) if len(part) >= 2 and part[0] == "snap" and part[1].isdigit() else 0


def _record_seqs(path: Path) -> list[int]:
    """The sequence numbers of the write-ahead log ``path``'s records (none when it cannot be read)."""
    try:
        return record_seqs(WriteAheadLog(path))
    except Exception:  # noqa: BLE001 - a log that cannot be read here is read (and reported) by the replay
        return []


def _whole_snapshot(d: Path) -> str | None:
    """The snapshot the local shard directory ``d``'s ``CURRENT`` names, when it is whole (its ``meta.json``)."""
    cur = d / "CURRENT"
    name = cur.read_text().strip() if cur.exists() else ""
    return name if name and (d / name / "meta.json").exists() else None


def _holds_shard(d: Path) -> bool:
    """Whether the local shard directory ``d`` holds anything to seed a prefix from: a whole current snapshot or
    log records."""
    wal = d / "wal.log"
    return _whole_snapshot(d) is not None or (wal.exists() and wal.stat().st_size > 0)


def replica_uri(uri: str | None, r: int) -> str | None:
    """Storage URI of replica ``r`` (replica 0: ``uri`` itself; the local layout's ``replica-r``)."""
    if uri is None or r == 0:
        return uri
    return f"{uri.rstrip('/')}/replica-{r}"


class ShardStorage:
    """Shard ``shard_id``'s objects under ``uri`` (``<uri>/shard-<i>/``).

    :raises ValueError: ``uri`` is not a storage URI (:meth:`ObjectStore.from_uri`).
    """

    def __init__(self, uri: str, shard_id: int) -> None:
        self.root = ObjectStore.from_uri(uri)
        self.store = self.root.sub(f"shard-{shard_id}")
        self.wal = self.store.sub("wal")
        self.downloaded = False  # the last open_log fetched the snapshot (for tests and logs)
        self.seeded = False  # the last open_log found an empty prefix: the local directory seeds it (seed())
        self._seed_with: tuple | None = None  # (snapshot | None, log records, say)

    def current(self) -> dict | None:
        """The ``CURRENT`` pointer, or None when there is none yet."""
        data = self.store.get("CURRENT")
        return None if data is None else json.loads(data)

    # ------------------------------------------------------------------ start
    def open_log(self, d: Path, say: Callable[[str], None] | None = None) -> MirroredLog:
        """Make the local directory ``d`` hold the storage's current snapshot and log, then
        return the shard's log (its appends go to storage too). ``say`` (a line for the service
        log, :meth:`.state.ShardState.say`) is told when a snapshot download starts (source,
        objects) and ends (bytes, seconds)."""
        cur = self.current()
        self.seeded, self._seed_with, self.downloaded = False, None, False
        if cur is None:  # (no CURRENT: nothing here is a shard yet; seed() uploads once the local snapshot loaded)
            left = self.store.list()
            if not left or _holds_shard(d) and self._seed_copy(d, left):
                if left:  # (trial59 F1: taken as the store's, they made the start delete the only full copy)
                    line = (f"{self.store.uri} holds {len(left)} objects but no CURRENT (a seeding start cut short): "
                            f"they are deleted and the prefix is seeded again from {d}")
                    warn(say, line) if say is not None else logger.warning("%s", line)
                    self.store.delete(left)
                return self._to_seed(d, say)
            if not _holds_shard(d):  # (trial59b F4: replayed as a log-only shard, refused later naming another cause)
                raise RuntimeError(f"{self.store.uri} holds {len(left)} objects but no CURRENT: a start that seeded it "
                                   f"from another data directory was cut short (or its CURRENT was lost), and {d} holds "
                                   "nothing. Start once with the data directory that seeded it (it seeds the prefix "
                                   "again), or move the storage's prefix aside")
            cur = {"snapshot": None, "wal_from": 0}
        name, first = cur["snapshot"], int(cur["wal_from"])
        local = d / "CURRENT"
        have = local.read_text().strip() if local.exists() else None
        try:  # (before anything local changes: a refused start kept no local snapshot, its only copy: trial57 #4)
            records, nxt = read_log_objects(self.wal, first)
        except LogGapError as exc:
            if have is not None and (d / have / "meta.json").exists() and have != name:
                raise LogGapError(f"{exc}. The local {d} still holds snapshot {have}, left as it is: if the store "
                                  "lost what it held, move the store's prefix aside and start again, and an empty "
                                  "prefix is seeded from the local directory") from None
            raise
        if name is None or have != name or not (d / name / "meta.json").exists():
            if have != name:
                self._check_not_ahead(d, have, name, records)
            if have is not None and have != name:
                line = (f"shard directory {d} holds snapshot {have}, the storage {self.store.uri} holds "
                        f"{name or 'no snapshot (log only)'}: replacing the local copy with the storage's")
                warn(say, line) if say is not None else logger.warning("%s", line)  # (trial59b F7: was a bare line)
            if name is not None:
                if (d / name).exists():  # (a cut-off copy of the store's own snapshot: no meta.json)
                    shutil.rmtree(d / name)
                self._download(name, d, say)  # (into a .part directory, renamed when whole)
            for old in d.glob("snap-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
            local.unlink(missing_ok=True)
            if name is not None:
                fsync_write(local, name.encode())
                self.downloaded = True
        if have == name and (said := local_extra(d / "wal.log", records, self.wal.uri)) is not None:
            level, line = said  # (the local log goes with the same snapshot: more records there than in the store)
            if say is None:
                logger.log(level, "%s", line)
            else:  # (a shard process's lines go through the shard's own log: trial57b A)
                warn(say, line) if level >= logging.WARNING else say(line)
        log = WriteAheadLog(d / "wal.log")
        log.reset(records)
        log.close()
        return MirroredLog(d / "wal.log", self.wal, nxt, first)

    def load_again(self, exc: LocalCopyDamaged, load: Callable[[], int], say: Callable[[str], None] | None) -> int:
        """The start's answer to :class:`LocalCopyDamaged`: the local copy is set aside (``damaged-<name>`` beside
        it), ``load`` (a fresh shard's :func:`.snapshot.load`) downloads the storage's copy and loads it, and the local
        copy is removed once that loaded. When it does not (the storage's copy cannot be read either, or the download
        failed), the local copy is put back as it was and the error raised names both.
        :returns: what ``load`` returns."""
        snap = exc.snap
        aside = snap.with_name(f"damaged-{snap.name}")
        warn(say, f"the local copy of snapshot {snap.name} cannot be loaded, and the storage {self.store.uri} holds it "
                  f"too: downloading it again (the local copy is kept as {aside.name} until that loads). What was "
                  f"wrong: {exc}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(snap, aside)
        try:
            n = load()
        except Exception as again:
            shutil.rmtree(snap, ignore_errors=True)  # (the downloaded copy, if any)
            os.replace(aside, snap)
            raise RuntimeError(f"the local copy of snapshot {snap.name} cannot be loaded ({exc}), and starting from the "
                               f"storage's copy ({self.store.uri}/snap/{snap.name}/, downloaded into {snap}) failed too: "
                               f"{again}. The local copy is left as it was; free space under {snap.parent} if the "
                               "download ran out of it, or restore the snapshot from a backup") from again
        shutil.rmtree(aside, ignore_errors=True)
        if say is not None:
            say(f"snapshot {snap.name} loaded from the storage's copy; the damaged local copy was removed")
        return n

    def _download(self, name: str, d: Path, say: Callable[[str], None] | None = None) -> None:
        part = d / f"{name}.part"
        shutil.rmtree(part, ignore_errors=True)
        pre, t, nbytes = f"snap/{name}/", time.perf_counter(), 0
        keys = self.store.list(pre)
        if f"{pre}meta.json" not in keys:
            raise RuntimeError(f"{self.store.uri}/CURRENT names snapshot {name}, which is not in the store (no "
                               f"{pre}meta.json at {self.store.uri}): the shard cannot be loaded; restore the "
                               "snapshot's objects or point CURRENT at one that exists")
        scheme = self.store.uri.partition("://")[0] if "://" in self.store.uri else ""  # (the path: no query string's
        src = f"{scheme}://{self.store.root}/{pre}" if scheme else f"{self.store.root}/{pre}"  # keys or user in a log)
        if say is not None:
            say(f"downloading snapshot {name} from {src}: {len(keys)} objects")
        try:
            for key, data in zip(keys, self.store.get_many(keys)):
                if data is None:
                    raise RuntimeError(f"{self.store.uri}/{key} vanished while the snapshot was read")
                fsync_write(part / key[len(pre):], data)
                nbytes += len(data)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)  # (a full disk left an empty .part: trial58b #4)
            raise
        os.replace(part, d / name)
        if say is not None:
            say(f"downloaded snapshot {name} from {src}: {nbytes} bytes in {time.perf_counter() - t:.1f} s")

    def _seed_copy(self, d: Path, left: list[str]) -> bool:
        """Whether the objects ``left`` of a prefix without ``CURRENT`` can only be what a seeding start from ``d``
        put before it was cut short: snapshot files, and log objects equal to ``d``'s own records at their positions.
        Other log objects may hold writes ``d`` lacks (a prefix that lost its CURRENT: trial57 #4), so the start
        reads them as the store's and refuses, leaving both as they are."""
        wal = [k for k in left if k.startswith("wal/")]
        if not wal:
            return True
        local = [encode_record(r) for r in WriteAheadLog(d / "wal.log")]
        for key in wal:
            pos = record_pos(key[len("wal/"):])
            got = self.store.get(key) if pos is not None and pos < len(local) else None
            if got is None or not local[pos].startswith(got):  # (a put cut short leaves a prefix: trial59b F1)
                return False
        return True

    def _check_not_ahead(self, d: Path, have: str | None, name: str | None, records: list) -> None:
        """Refuse, before anything local changes, to replace the local snapshot ``have`` by the storage's ``name``
        (None: none) when the local directory holds writes the storage lacks: a sequence number (its snapshot's, or a
        record's in its log) above every one the storage holds (``name``'s and its log ``records``'). A storage that
        took every acknowledged write is never behind its shard's directory; one is after a seeding start cut short,
        an empty directory seeded since in its place, or a directory served without ``--storage-uri`` meanwhile
        (trial59b F1, F3: each deleted the only full copy). :raises LocalAhead:"""
        whole = have is not None and _whole_snapshot(d) == have  # (a log alone counts too)
        mine = max([_snap_seq(have) if whole else 0] + _record_seqs(d / "wal.log"))
        theirs = max([_snap_seq(name)] + record_seqs(records))
        if mine > theirs:
            raise LocalAhead(f"shard directory {d} holds snapshot {have or '(none)'} and writes up to sequence {mine}, "
                             f"newer than anything the storage {self.store.uri} holds (up to {theirs}, snapshot "
                             f"{name or '(none)'}): the local copy is not replaced, and nothing was changed. If the "
                             f"local directory is the one to serve (a start that seeded the storage from it was cut "
                             f"short, or it was served without --storage-uri since), move the storage's prefix aside and "
                             f"start again: an empty prefix is seeded from it. If the storage is, move "
                             f"{d / have if whole else d / 'wal.log'} away")

    def _commits_seq(self) -> int:
        """The highest sequence number in the storage's commit log (``commits/``, which the frontend opened before
        the shards: its base record's after a reset too); 1 when it cannot be read (taken as holding writes)."""
        try:
            recs = read_log_objects(self.root.sub("commits"), None)[0]
        except Exception:  # noqa: BLE001 - a damaged or gapped log: the frontend reports it; never seed empty then
            return 1
        return max(record_seqs(recs), default=0)

    def _to_seed(self, d: Path, say: Callable[[str], None] | None = None) -> MirroredLog:
        """(:meth:`open_log`, an empty prefix) the shard ``d`` holds is its start; :meth:`seed` uploads it."""
        name = _whole_snapshot(d)
        records = list(WriteAheadLog(d / "wal.log"))
        log = WriteAheadLog(d / "wal.log")
        log.reset(records)
        log.close()
        self.seeded = True
        self._seed_with = (d / name if name else None, records, say)
        return MirroredLog(d / "wal.log", self.wal, len(records), 0)

    def seed(self) -> None:
        """(:func:`.snapshot.load`, once the local snapshot has loaded) upload what :meth:`open_log` found in the
        local directory for an empty prefix: the snapshot, the log records, then ``CURRENT``. A local snapshot that
        cannot be loaded is never uploaded, so the prefix stays empty and a repaired directory seeds it later
        (trial58b #5). Nothing to do when this start did not find an empty prefix, nor for a directory holding nothing
        while the storage's commit log has reached a sequence number above 0 (the start is refused next, and an empty
        shard in the prefix would stand for the directory that does hold the writes: trial59b F3, trial59c)."""
        if self._seed_with is None:
            return
        snap, records, say = self._seed_with
        if snap is None and not records and self._commits_seq() > 0:  # (an empty directory's start, refused next)
            self._seed_with = None
            return
        t = time.perf_counter()
        if say is not None:  # (trial59 F4: a stop before "seeded" leaves an unfinished prefix, seeded again next start)
            say(f"seeding {self.store.uri} from the local directory: snapshot {snap.name if snap else '(none)'} and "
                f"{len(records)} log records")
        nbytes = self._upload(snap) if snap is not None else 0
        for pos, rec in enumerate(records):
            self.wal.put(record_key(pos), encode_record(rec))
        self.store.put_atomic("CURRENT", json.dumps({"snapshot": snap.name if snap else None, "wal_from": 0}).encode())
        self._seed_with = None
        if say is not None:
            say(f"seeded {self.store.uri}: {nbytes} snapshot bytes and {len(records)} log records in "
                f"{time.perf_counter() - t:.1f} s")

    # ------------------------------------------------------------------ snapshot
    def _upload(self, snap: Path) -> int:
        """Put the snapshot directory's files under ``snap/<name>/``. :returns: their bytes."""
        n = 0
        for p in sorted(snap.rglob("*")):
            if p.is_file() and not p.name.endswith(".tmp"):
                data = p.read_bytes()
                self.store.put(f"snap/{snap.name}/{p.relative_to(snap).as_posix()}", data)
                n += len(data)
        return n

    def publish(self, snap: Path, log: MirroredLog) -> None:
        """After the snapshot ``snap`` was written locally and ``log`` reset (its kept records
        put again from ``log.first`` on): upload the snapshot, switch ``CURRENT`` to it, delete
        the log objects and snapshots it replaces. A storage that lost ``CURRENT`` (wiped while
        the shard ran) is re-established by this full snapshot (logged)."""
        if self.store.get("CURRENT") is None:
            logger.error("%s/CURRENT is gone (the storage was wiped or lost objects while the shard ran): "
                      "re-establishing it from this shard's full snapshot %s", self.store.uri, snap.name)
        self._upload(snap)
        self.store.put_atomic("CURRENT", json.dumps({"snapshot": snap.name, "wal_from": log.first}).encode())
        self.wal.delete(log.older_keys())
        keep = f"snap/{snap.name}/"
        self.store.delete([k for k in self.store.list("snap") if not k.startswith(keep)])


def copy_current(uri: str, src_uri: str, shard_id: int) -> str | None:
    """Replace shard ``shard_id``'s objects under ``uri`` by the current snapshot under
    ``src_uri`` (a sibling replica's), with an empty log (a catching-up replica replays the
    rest). :returns: the snapshot's name (None: the sibling has none)."""
    src, dst = ShardStorage(src_uri, shard_id), ShardStorage(uri, shard_id)
    cur = src.current()
    name = cur["snapshot"] if cur else None
    dst.store.delete_prefix("")
    if name is not None:
        pre = f"snap/{name}/"
        for key in src.store.list(pre):
            dst.store.copy_in(src.store, key)
    dst.store.put_atomic("CURRENT", json.dumps({"snapshot": name, "wal_from": 0}).encode())
    return name
