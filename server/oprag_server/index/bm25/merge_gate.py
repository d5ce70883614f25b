"""One BM25 merge build at a time across the shards of one machine.

Issue 13 (snap18, 1M chunks, 2 process shards): a 1M-chunk shard's merge holds ~2.3 GB of transient
memory for ~15 s (the new segment, the frozen delta's int64 temporaries, the previous segment's
pages read); the shards receive the same writes, so their write-time, idle and snapshot merges
started together and the process tree's peak was two merges at once (8.45 GB against a target of
8 GiB). A :class:`MergeGate` is held for the build of one merge: a thread lock (shards on threads
of one process share the gate object, :meth:`MergeGate.at`) and an ``flock`` of one file in the
data directory (shard processes and replicas of one server). The kernel releases the ``flock``
when a process dies, so a killed shard never holds the others' merges.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import threading
from pathlib import Path

__all__ = ["MergeGate"]

#: the lock file's name in the server's data directory (beside the ``shard-<i>`` directories)
LOCK_NAME = ".bm25-merge.lock"
#: the directory, beside the lock file, of merged segments moved out of memory
#: (:meth:`MergeGate.spill_dir`, :meth:`..segment.Segment.spill`): ``<pid>-<n>`` per segment
SPILL_NAME = ".bm25-spill"


class MergeGate:
    """A machine-wide lock for one BM25 merge build (module docstring). Not reentrant."""

    _gates: dict[str, "MergeGate"] = {}
    _gates_lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._flocked = False
        self._spills = itertools.count()
        # a shard that starts (a restart too) removes what dead processes left (spill_dir)
        sweep_spills(self.path.parent / SPILL_NAME)

    @classmethod
    def at(cls, data_dir: Path) -> "MergeGate":
        """The process's one gate for ``data_dir`` (its file :data:`LOCK_NAME`), so that shards on
        threads of one process exclude each other too (an ``flock`` does not between the threads
        that share its file descriptor)."""
        key = str(Path(data_dir).resolve() / LOCK_NAME)
        with cls._gates_lock:
            return cls._gates.setdefault(key, cls(Path(key)))

    def acquire(self, blocking: bool) -> bool:
        """Take the gate; without ``blocking`` return False at once when another merge holds it.
        Where the file cannot be locked (a read-only or lock-less file system: ``OSError`` other
        than "would block"), the gate holds within this process only: merges are never refused
        for want of a lock file."""
        if not self._lock.acquire(blocking):
            return False
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            self._flocked = True
        except BlockingIOError:
            self._lock.release()
            return False
        except OSError:
            self._flocked = False
        return True

    def release(self) -> None:
        """Give the gate back (the thread that took it, or the merge thread it was handed to)."""
        if self._flocked:
            self._flocked = False
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            except OSError:
                pass
        self._lock.release()

    def spill_dir(self) -> Path:
        """A new directory name for one merged segment's files (:meth:`..segment.Segment.spill`),
        ``<data dir>/.bm25-spill/<pid>-<n>`` (not created). A gate's creation (a shard's start)
        removes the directories of processes that are gone (a killed or stopped shard's: a
        segment's files go when it is freed, which an exit does not do); a live process's stay."""
        return self.path.parent / SPILL_NAME / f"{os.getpid()}-{next(self._spills)}"


def sweep_spills(root: Path) -> int:
    """Remove the spill directories under ``root`` whose process (the ``<pid>`` of
    ``<pid>-<n>``) no longer runs. :returns: how many were removed."""
    n = 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    for e in entries:
        pid = e.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(e, ignore_errors=True)
            n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: someone else's process)
        return True
    return True
