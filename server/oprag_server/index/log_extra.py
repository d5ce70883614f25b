"""Whether a local log file holds more than the store's copy of the same log (:func:`local_extra`): what a start on
``--storage-uri`` says, or refuses, before it rewrites the file from the store (:mod:`.objstore`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from .wal import read_records


def record_seqs(records) -> list[int]:
    """The sequence numbers of log records (a shard log's upserts and deletes, a commit log's commit and base records;
    memory records carry none)."""
    return [int(r["seq"]) for r in records if "seq" in r]


class LocalNewer(RuntimeError):
    """(:func:`local_extra`) a local log holds records the store lacks: it is not rewritten from the store."""


def local_extra(path: Any, recs: list[dict], uri: str) -> tuple[int, str] | None:
    """``(level, line)`` for the log when the local log file ``path`` holds more intact records than the ``recs`` the
    store's objects hold (the local file is about to be rewritten from the store), else None. One more is what a
    crash between the local append and the put leaves, or a put that failed (never acknowledged either way), but
    also the store losing its newest object: INFO, as the two cannot be told apart. Two or more: INFO when the
    store's records reach the file's highest sequence number (emptied since); else :class:`LocalNewer` is raised
    before anything changes (trial57 #1, #2, trial59c N1). Counted from the frames over a map of the file."""
    import mmap  # noqa: PLC0415

    from .wal import frames  # noqa: PLC0415

    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                n = sum(1 for _ in frames(m))
    except (OSError, ValueError):
        return None
    if n <= len(recs):
        return None
    if n == len(recs) + 1:
        return logging.INFO, (f"{path}: its last record is not in the store {uri} (a crash before its put finished, "
                              "or a put that failed: never acknowledged; or the store lost its newest object); the "
                              "store's log is used")
    seqs = [record_seqs(read_records(path)[0]), record_seqs(recs)]
    if seqs[1] and max(seqs[1]) >= max(seqs[0], default=0):  # (not behind the file: emptied since, trial59b F5)
        return logging.INFO, (f"{path} holds {n} records, the store {uri} {len(recs)} reaching sequence number "
                              f"{max(seqs[1])}: the store's log was emptied since (its shards snapshotted past them); "
                              "the store's log is used")
    raise LocalNewer(f"{path} holds {n} intact records, the store {uri} {len(recs)} (a crash or a failed put leaves "
                     "one more at most): the file holds writes the store lacks (it was written without --storage-uri "
                     "since, or the store lost objects). Nothing was changed. If the data directory is the copy to "
                     "serve, move the storage's prefix aside and start again (an empty prefix is seeded from it); if "
                     "the storage is, move the file away (trial59c N1: it was cut down to the store's copy)")
