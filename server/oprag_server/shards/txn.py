"""A shard's half of the two-phase commit: staged ingest batches, prepared transactions in the
shard's write-ahead log, apply, abort, and replay of committed log records at load.

Log record (pickled dict): ``{"txn", "seq", "kind": "upsert", "ipc": Arrow IPC bytes}`` or
``{"txn", "seq", "kind": "delete", "doc_ids": [...]}``; the same log also holds the shard's
memory records (:mod:`.memory`), which :meth:`Transactions.replay` leaves alone. The frontend's commit log decides
which prepared transactions count (see :mod:`oprag_server.engine.commit`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .. import records
from ..index.wal import WriteAheadLog
from .chunks import ChunkStore
from .protocol import (AbortReply, AbortRequest, ApplyReply, ApplyRequest, PrepareReply, PrepareRequest, StageReply,
                       StageRequest)


def _few(seqs: list[int]) -> str:
    return f"{seqs[:10]}{' ...' if len(seqs) > 10 else ''} ({len(seqs)})"


#: the advice of :func:`check_against` for a log kept on ``--storage-uri`` (the local files are rebuilt from the store
#: at every start, so ``salvage-log`` of them cannot help: trial57 #6-#8)
STORE_ADVICE = ("the log is kept on --storage-uri, whose objects each start rebuilds the local files from (so "
                "`oprag salvage-log` of a local file does not apply): if another server wrote to the storage after "
                "this one took it over (--storage-takeover while the old one still ran), stop that server and start "
                "this one again; otherwise restore the storage's objects from a backup")


def check_against(path, ops: list[dict], committed: dict[str, int], applied: int, store: str | None = None) -> None:
    """A start's check of a shard's prepare records ``ops`` (sorted by sequence number) against the
    commit log's ``committed`` (``{txn: seq}``, skipped numbers included:
    :meth:`..engine.commit.CommitProtocol.open_log`), above the snapshot's ``applied``.

    Commits run one at a time and every shard prepares every transaction, and a number is
    committed, given back (its transaction aborted: the next one takes it) or recorded as skipped
    (a skip record in the commit log) before the next one is prepared. So below the log's highest prepare record every number it
    holds has a commit record, and every committed number has its prepare record here.

    :raises RuntimeError: a committed transaction is missing between this log's records (a
        salvaged damaged span held it); or numbers this log prepared before later ones have no
        commit record (a damaged, emptied or replaced ``commits.log``, trial56 F2, F3)."""
    top, have = max((r["seq"] for r in ops), default=0), {r["txn"] for r in ops}
    lost = sorted(s for t, s in committed.items() if applied < s < top and t not in have and ":" not in t)
    if lost:
        raise RuntimeError(
            f"{path}: committed transactions {_few(lost)} are not in this log, which holds later ones (up to {top}): "
            + ("records were lost (a log object missing or cut short), so the shard is not served without them: "
               f"{STORE_ADVICE} ({store})" if store else "records were lost (a damaged span that was salvaged), so the "
               "shard is not served without them: restore the log from a backup"))
    numbers = set(committed.values())
    orphans = sorted({r["seq"] for r in ops if applied < r["seq"] < top and r["seq"] not in numbers})
    if orphans:
        raise RuntimeError(
            f"{path}: this log prepared sequence numbers {_few(orphans)} before later ones (up to {top}), but the commit "
            "log holds no commit record for them: commits run one at a time, so their records were lost from "
            + (f"the commit log (its objects under commits/ of --storage-uri). Stop here: {STORE_ADVICE}" if store else
               "commits.log (damaged, emptied or replaced). Stop here and run `oprag salvage-log "
               "<data-dir>/commits.log`: it restores the commit records the shards' logs prove (README: Damaged logs)"))


class Transactions:
    """Staging and two-phase commit over a :class:`ChunkStore`. ``wal`` is None in memory-only
    shards (nothing is logged)."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.staged: dict[str, list[pa.Table]] = {}
        # BM25 term ids of staged batches (ChunkStore.analyse), analysed while the stream still runs
        self.tokens: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.prepared: dict[str, dict] = {}
        self.wal: WriteAheadLog | None = None

    def stage(self, req: StageRequest) -> StageReply:
        """Hold a bulk batch of an ingest stream without touching the index."""
        tables = self.staged.setdefault(req.txn, [])
        table = records.from_ipc(req.ipc)
        tables.append(table)
        self.tokens.setdefault(req.txn, []).append(self.store.analyse(table))
        return StageReply(staged=sum(t.num_rows for t in tables))

    def abort(self, req: AbortRequest) -> AbortReply:
        """Drop a transaction's staged batches, or its prepared record (never applied)."""
        self.prepared.pop(req.txn, None)
        self.tokens.pop(req.txn, None)
        return AbortReply(dropped=sum(t.num_rows for t in self.staged.pop(req.txn, [])))

    def prepare(self, req: PrepareRequest) -> PrepareReply:
        """Phase 1: make a transaction durable in this shard's write-ahead log (fsync) without
        applying it.

        :raises ValueError: unknown ``kind``.
        """
        if req.kind == "upsert":
            tables = self.staged.pop(req.txn, [])
            ipc = records.to_ipc(pa.concat_tables(tables).combine_chunks().to_batches()[0]) if tables else b""
            rec = {"txn": req.txn, "seq": int(req.seq), "kind": "upsert", "ipc": ipc}
        elif req.kind == "delete":
            rec = {"txn": req.txn, "seq": int(req.seq), "kind": "delete", "doc_ids": list(req.doc_ids)}
        else:
            raise ValueError(f"unknown transaction kind {req.kind!r}")
        if self.wal is not None:
            self.wal.append(rec)
        self.prepared[req.txn] = rec
        return PrepareReply()

    def apply(self, req: ApplyRequest) -> ApplyReply:
        """Phase 2 (after the frontend logged the commit): apply a prepared transaction.

        :raises KeyError: ``txn`` was not prepared here.
        """
        parts = self.tokens.pop(req.txn, None)
        tokens = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])) if parts else None
        return self.apply_record(self.prepared.pop(req.txn), tokens)

    def apply_record(self, rec: dict, tokens: tuple[np.ndarray, np.ndarray] | None = None) -> ApplyReply:
        """Apply one log record to the store (``tokens``: its rows' term ids analysed at staging,
        in the order of the staged batches, which ``prepare`` concatenated in that order; see
        :meth:`ChunkStore.analyse`)."""
        if rec["kind"] == "upsert":
            if rec["ipc"]:
                return self.store.upsert(records.from_ipc(rec["ipc"]), rec["seq"], tokens=tokens)
            self.store.applied_seq = max(self.store.applied_seq, int(rec["seq"]))
            return ApplyReply(delta=self.store.postings.drain_delta())
        return self.store.delete(rec["doc_ids"], rec["seq"])

    def replay(self, wal: WriteAheadLog, committed: set[str] | dict[str, int] | None) -> int:
        """Open ``wal`` for appending, then apply, in sequence order, its records of committed
        transactions newer than the store. :returns: records applied.

        :param committed: the commit log's transaction ids; as ``{txn: seq}`` (a start,
            :meth:`..engine.commit.CommitProtocol.open_log`) the log is also checked for holes.
        :raises LogDamaged: intact records follow a damaged span of ``wal`` (left as it is).
        :raises RuntimeError: a committed transaction newer than the snapshot is missing between
            the log's records (a salvaged damaged span held it): the shard is not served short.
            (One missing after the log's last record is the frontend's check: a shard behind.)"""
        self.wal = wal
        replayed = 0
        ops = sorted((r for r in wal.open() if r.get("kind") in ("upsert", "delete")), key=lambda r: r["seq"])
        if isinstance(committed, dict):  # (a log on --storage-uri: advice for the store, not the local file)
            check_against(wal.path, ops, committed, self.store.applied_seq, getattr(getattr(wal, "store", None), "uri",
                                                                                    None))
        for rec in ops:
            if rec["seq"] <= self.store.applied_seq or committed is None or rec["txn"] not in committed:
                continue
            self.apply_record(rec)
            replayed += 1
        return replayed

    def in_flight(self) -> list[dict]:
        """Log records of transactions prepared but not yet applied (kept across a snapshot)."""
        if self.wal is None or not self.prepared:  # (none: the log is not read back, ~MBs per snapshot)
            return []
        return [r for r in self.wal if r.get("txn") in self.prepared]
