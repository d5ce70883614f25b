"""The commit protocol: sequence numbers and two-phase commit of writes on every shard.

Every write (an ingest stream, a delete) is one transaction with one sequence number:

1. *prepare*: every shard writes the transaction to its write-ahead log (fsync) without
   applying it;
2. the frontend appends ``{"txn", "seq"}`` to its commit log (fsync): the commit point;
3. *apply*: every shard applies it; the corpus-global BM25 statistics take the shards' deltas.

Commits run one at a time (``gate``); step 3 alone runs under the index write lock, so queries
see a write completely or not at all without waiting for the fsyncs of steps 1-2, which change
nothing they read (session 41: a query behind a 500-document replacement's whole commit waited
~125 ms of its 182 ms p50; ``bench.ingest_queries``). A crash before 2 leaves no trace after recovery (shards replay only logged transactions);
after 2, recovery replays it. A failure before 2 aborts the transaction on every shard that is
up and, unless its commit record's append had begun, gives its sequence number back (the next
transaction takes it: shards replay only committed transaction ids, so an aborted prepare record
with the same number is skipped), so committed transactions are numbered without gaps. Committed sequence numbers only grow: after a
restart they continue from the highest one any shard applied or the commit log holds.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..index.bm25 import CorpusStats
from ..index.disk_errors import disk_error
from ..index.objstore import MirroredLog, ObjectStore, open_mirrored
from ..index.wal import LogDamaged, WriteAheadLog, parse_records
from ..shards.pool import ShardPool
from ..shards.protocol import AbortRequest, ApplyReply, ApplyRequest, Op, PrepareRequest
from ..shards.transport import StorageUnavailable
from .commit_repair import prove, shard_logs, tail_is
from .rwlock import RWLock

log = logging.getLogger("oprag")
#: what a shard's (or the commit log's) failed object write says (:class:`~..index.objstore.StorageWriteError`)
WRITE_FAILED = "object storage write failed"


def skipped_in(records: Iterable[dict]) -> set[int]:
    """Sequence numbers the skip records of a commit log list: each was kept by a commit-record
    append that failed after its bytes may have reached the log (a failed cut-back, a mirrored
    log's failed put). Its transaction was aborted on every shard and its client told so, so a
    record with that number that the failed append left in the file is not a commit (a shard
    that replayed it would apply a write no other shard holds)."""
    return {int(n) for r in records for n in r.get("skipped", ())}


def missing_log(path: Path) -> None:
    """Refuse a start whose commit log ``path`` is gone while a shard's write-ahead log beside it
    (``shard-*/wal.log``, replicas' included) holds prepared transactions: without the log, those
    that were committed would be dropped silently as uncommitted (trial55b). The server never
    deletes the file (it is replaced atomically). :raises RuntimeError: naming the logs and the
    way past."""
    if path.exists():
        return
    held = [f"{wal} ({len(ops)})" for wal, ops in shard_logs(path.parent).items() if ops]
    if held:
        raise RuntimeError(
            f"{path} is missing, but the shards' write-ahead logs hold prepared transactions: {', '.join(held)}. Which "
            "of them were committed only the commit log says, so the server does not start without it: restore it "
            f"from a backup, or run `oprag salvage-log {path}`, which rebuilds it from what the shards' logs prove "
            "(README: Damaged logs)")


def torn_commit(path: Path, logged: list[dict], torn: bytes) -> None:
    """Name the damaged whole last record of a commit log when it is the commit record of the last
    transaction every shard prepared, with a few bytes changed (trial56 F1: dropped as a crash's torn
    tail, it lost an acknowledged write). :raises RuntimeError: naming it."""
    if not torn:
        return
    proof = prove(logged, shard_logs(path.parent))
    if proof.last is not None and tail_is(torn, *proof.last):
        seq, txn = proof.last
        raise RuntimeError(
            f"{path}: its last record ({len(torn)} bytes) is damaged, and it is the whole commit record of transaction "
            f"{txn} (sequence {seq}), which every shard prepared: not a record cut short by a crash, so it is not "
            f"dropped. The file is left as it is: run `oprag salvage-log {path}` to restore the record "
            "(README: Damaged logs)")


class _CallerLeft(Exception):
    """(:meth:`CommitProtocol._commit`) the caller was cancelled before the commit point."""


class CommittedAfterLeave(asyncio.CancelledError):
    """(:meth:`CommitProtocol.commit`) the caller was cancelled after the commit point: the
    transaction is committed whole, ``result`` is its ``(seq, apply replies)``; the cancellation
    goes on (a ``CancelledError``)."""

    def __init__(self, result: tuple[int, list[ApplyReply]]) -> None:
        super().__init__("cancelled after the commit point: committed")
        self.result = result


class CommitProtocol:
    """Two-phase commit over ``pool``; ``stats`` (the frontend's corpus-global BM25 statistics)
    take every applied delta; ``lock`` is the index lock (write side held by each commit's apply);
    ``on_apply()`` is called once each committed transaction is applied on every shard, also when
    its caller left after the commit point (Runtime: ``mark_dirty``, for the snapshot loop).
    ``metrics`` (:class:`~..service.metrics.Metrics`, optional): a write whose caller was
    cancelled (deadline passed, client left) counts in ``oprag_writes_after_caller_left_total``
    by kind (``upsert``, ``delete``) and outcome (``applied``: committed whole; ``aborted``:
    nothing stored), since the caller's status (DEADLINE_EXCEEDED, CANCELLED) does not say which.

    Attributes: ``seq`` the last issued sequence number; ``applied_seq`` the last one every
    shard applied; ``log`` the commit log (None until :meth:`open_log`: nothing is logged).
    """

    def __init__(self, pool: ShardPool, stats: CorpusStats, lock: RWLock,
                 on_apply: Callable[[], None] | None = None, metrics: Any = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.on_apply = on_apply
        self.stats = stats
        self.lock = lock
        # held by a commit for its whole time (its apply also holds the write lock), by a shard's restart while it reads
        # the committed ids (supervision.restart_shard) and by a snapshot (app.Runtime.snapshot) for its whole time: a
        # snapshot excludes commits without holding the read side, behind which a waiting commit would block every new
        # query until the snapshot is done
        self.gate = asyncio.Lock()
        self.seq = 0
        self.applied_seq = 0
        self.log: WriteAheadLog | None = None
        self._logged_seq = 0
        self._skipped: list[int] = []  # numbers kept by a failed commit-record append, until a skip record holds them
        self._applied = asyncio.Condition()
        self.lease = None  # the --storage-uri owner lease (index/lease.py): fenced -> writes refused
        self.write_error: str | None = None  # the last storage write failure, until a write succeeds

    # ------------------------------------------------------------------ recovery
    def open_log(self, path: Path, storage: str | None = None) -> dict[str, int]:
        """Open (or create) the commit log. With ``storage`` (``--storage-uri``) every commit
        record is also one object under ``<storage>/commits/``, put before the commit point
        passes, and the local file is rebuilt from those objects first (a frontend on a new
        node with an empty data directory finds every commit; :func:`~..index.objstore.open_mirrored`).

        :returns: ``{transaction id: sequence number}`` of the committed transactions in it, and
            ``{"skipped:<n>": n}`` for each number a failed commit-record append kept (skip records; the shards
            replay exactly these transactions from their write-ahead logs, and a shard refuses to
            load when its log and these disagree: :func:`..shards.txn.check_against`).
        :raises LogDamaged: intact records follow a damaged span (the file is left as it is).
        :raises RuntimeError: the log is missing while a shard's log holds prepared transactions
            (:func:`missing_log`)."""
        said: list[str] = []  # (a torn tail's WARNING waits for torn_commit: it may be a whole damaged record)
        if storage is None:
            missing_log(path)
            self.log = WriteAheadLog(path)
            self.log.warn = said.append
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.log = open_mirrored(path, ObjectStore.from_uri(storage).sub("commits"))
        try:
            logged = self.log.open()
        except LogDamaged as exc:  # (the last record, whole: say whose commit record it is, when the shards know)
            if storage is None and not exc.after:
                data = path.read_bytes()
                torn_commit(path, parse_records(data)[0], data[exc.start:])
            raise
        if storage is None:  # (a torn tail whose length field was hit: still the whole record, by its payload)
            torn_commit(path, logged, self.log.torn)
            self.log.warn = None
            for line in said:
                log.warning("%s", line)
        self._logged_seq = max([r["seq"] for r in logged] + [0])
        skipped = skipped_in(logged)
        out = {r["txn"]: int(r["seq"]) for r in logged if r["txn"] and int(r["seq"]) not in skipped}
        out.update({f"skipped:{n}": n for n in sorted(skipped)})
        return out

    def committed_txns(self) -> set[str]:
        """Transaction ids committed in the commit log now (for a shard that restarts): not those
        whose record a failed append left behind (aborted on every shard; :func:`skipped_in`)."""
        if self.log is None:
            return set()
        recs = list(self.log)
        skipped = skipped_in(recs) | set(self._skipped)
        return {r["txn"] for r in recs if r["txn"] and int(r["seq"]) not in skipped}

    def check_recovered(self, applied: dict[int, int], committed: set[str] | None = None) -> None:
        """Check that every shard recovered every transaction the commit log holds (each shard
        prepares and applies every transaction, so its ``applied_seq`` after replay reaches the
        log's highest sequence number; one below it lost log records).

        :param applied: shard id -> its ``applied_seq`` after loading.
        :param committed: the transactions the shards were given to replay (a restart while
            commits go on: only those count; a replica catching up has the later ones too).
            None: every transaction of the log (a start: nothing commits meanwhile).
        :raises RuntimeError: naming the shards behind, their sequence number and the log's."""
        # (the base record, txn "", holds the sequence number every shard's snapshot reached when the log was emptied)
        recs = list(self.log) if self.log is not None else []
        skipped = skipped_in(recs)
        recs = [r for r in recs if not r["txn"] or int(r["seq"]) not in skipped]
        want = max([r["seq"] for r in recs if committed is None or not r["txn"] or r["txn"] in committed] + [0])
        base = max([r["seq"] for r in recs if r.get("kind") == "base"] + [0])
        behind = {i: s for i, s in sorted(applied.items()) if s < want}
        if behind:
            where = f" ({self.log.store.uri})" if isinstance(self.log, MirroredLog) else ""
            older = any(s < base for s in behind.values())
            raise RuntimeError(
                "; ".join(f"shard {i} recovered up to sequence {s}" for i, s in behind.items())
                + f", but the commit log{where} holds committed transactions up to {want}"
                + (f" (every shard's snapshot had reached {base} when the log was last emptied: an older snapshot or "
                   "data directory was put in place of the live one)" if older else "")
                + ": the shard's log records of those (prepare records) are missing, so it is not served without "
                + ("them (restore its log objects or the live snapshot, or restore the storage from a backup; a shard "
                   "at 0 on an empty data directory may be one the storage holds nothing for yet, its seeding from "
                   "another data directory cut short: start once with that directory)" if where
                   else "them (restore its wal.log, or its live snapshot directory, from a backup)"))
        if committed is None and len(set(applied.values())) > 1:  # a start: every shard applied every transaction
            top = max(applied.values())
            raise RuntimeError(
                "; ".join(f"shard {i} recovered up to sequence {s}" for i, s in sorted(applied.items()) if s < top)
                + f", but another shard recovered up to {top}: every shard prepares and applies every transaction, "
                "so a shard's data directory was replaced by an older one (a restored backup or snapshot); it is not "
                "served short: restore the live one, or every shard's directories from the same backup")

    def recover(self, shard_applied: Iterable[int]) -> None:
        """Continue numbering after the highest sequence number a shard applied or the commit
        log holds (call once the shards are up)."""
        self.seq = self.applied_seq = max([*shard_applied, self._logged_seq, 0])

    def reset_log(self) -> None:
        """Empty the commit log (after every shard wrote a snapshot covering it), but for one base
        record ``{"txn": "", "seq": applied_seq}``: the sequence number the shards' snapshots
        reached, so a start that finds a shard below it refuses (an older snapshot put in place
        of the live one, trial55b), where an empty log let it serve short."""
        if self.log is not None:
            self.log.reset([{"txn": "", "seq": self.applied_seq, "kind": "base"}])
            if isinstance(self.log, MirroredLog):  # (an id left by a crash here is harmless:
                self.log.store.delete(self.log.older_keys())  # shards skip records they applied)

    # ------------------------------------------------------------------ writes
    def next_seq(self) -> int:
        """Issue the next sequence number (strictly greater than every earlier one)."""
        self.seq += 1
        return self.seq

    async def commit(self, txn: str, kind: str, doc_ids: list[str] | None = None) -> tuple[int, list[ApplyReply]]:
        """Commit transaction ``txn`` on every shard (steps 1-3 above; step 3 under the write lock).

        A caller cancelled meanwhile (a client that left or whose deadline passed) does not cut
        the commit short: it runs in a task of its own, which aborts the transaction when the
        caller left before the commit point (step 2) and otherwise applies it on every shard, as
        recovery would, before the cancellation is raised here. (Cut short, a commit logged its
        record from the executor thread while the shards were told to abort, and the write
        appeared only after a restart; or the shards applied it and the frontend's BM25
        statistics and ``applied_seq`` missed it: trial16.)

        :param kind: ``"upsert"`` (the batches each shard staged under ``txn``) or ``"delete"``.
        :returns: the transaction's sequence number and every shard's apply reply.
        :raises ShardError: a shard failed before the commit point (the transaction is aborted).
        :raises StorageUnavailable: this server lost the storage's owner lease, or a write to
            the storage failed (aborted; the message says which).
        :raises asyncio.CancelledError: the caller was cancelled (the transaction was then
            aborted or committed whole, as above; committed: :class:`CommittedAfterLeave`, which
            carries the sequence number and the replies).
        """
        if self.lease is not None and self.lease.fenced:
            raise StorageUnavailable(self.lease.fenced)
        left = asyncio.Event()  # set when the caller is cancelled
        task = asyncio.ensure_future(self._commit(txn, kind, doc_ids, left))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                self._count_left(kind, "aborted")
                raise
            left.set()
            while not task.done():  # the commit goes on to its end, whatever the caller's further cancels
                try:
                    await asyncio.shield(task)
                except BaseException:  # noqa: BLE001 - its outcome was for the caller, who left
                    pass
            if not task.cancelled() and task.exception() is None:
                self._count_left(kind, "applied")
                raise CommittedAfterLeave(task.result()) from None
            self._count_left(kind, "aborted")
            raise

    def _count_left(self, kind: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.writes_after_caller_left.labels(kind=kind, outcome=outcome).inc()

    async def _commit(self, txn: str, kind: str, doc_ids: list[str] | None,
                      left: asyncio.Event) -> tuple[int, list[ApplyReply]]:
        async with self.gate:
            if left.is_set():  # (it left while the commit waited for the lock: nothing was done)
                raise asyncio.CancelledError
            seq = self.next_seq()
            appending = False  # the commit record's append began (it may be in the log: keep the number)
            try:
                if self.log is not None:  # (a log that takes no record gets no prepare behind it: the shards'
                    self.log.check()      # logs then prove no number its start could not account for)
                    if self._skipped:  # numbers kept by failed appends: recorded before a later number is prepared
                        await asyncio.get_running_loop().run_in_executor(None, self.log.append, {
                            "txn": "", "seq": self.applied_seq, "kind": "skip", "skipped": list(self._skipped)})
                        self._skipped.clear()
                await self.pool.broadcast(Op.PREPARE, PrepareRequest(txn, seq, kind, list(doc_ids or [])))
                if left.is_set():  # the caller left before the commit point: nothing is committed
                    raise _CallerLeft
                if self.log is not None:
                    appending = True
                    await asyncio.get_running_loop().run_in_executor(None, self.log.append, {"txn": txn, "seq": seq})
            except _CallerLeft:
                await self.pool.gather_partial(Op.ABORT, AbortRequest(txn))
                self._give_back(seq)
                raise asyncio.CancelledError from None
            except Exception as exc:
                await self.pool.gather_partial(Op.ABORT, AbortRequest(txn))
                try:  # (aborted before its commit point, a kept number never committed: the trailer
                    exc.nothing_stored = True  # oprag-stored: none says so to the client: trial57 #10)
                except AttributeError:
                    pass
                if not (appending and self.log.left):  # (nothing of its record in the log: a full disk's ENOSPC)
                    self._give_back(seq)
                else:  # (kept: its record may be in the log) a skip record says so first (above; .txn, .commit_repair)
                    self._skipped.append(seq)
                self._storage_failed(exc)
                raise
            if self.write_error is not None:
                log.warning("writes succeed again (after: %s)", self.write_error)
                self.write_error = None
            async with self.lock.write():  # what queries read changes here only: the shards' apply and the statistics
                replies = await self.pool.broadcast(Op.APPLY, ApplyRequest(txn))
                for r in replies:
                    self.stats.apply_delta(*r.delta)
                self.applied_seq = max(self.applied_seq, seq)
            if self.on_apply is not None:  # (also when the caller left after the commit point)
                self.on_apply()
        async with self._applied:  # wake wait_applied callers
            self._applied.notify_all()
        return seq, replies

    def _give_back(self, seq: int) -> None:
        """An aborted transaction's number is issued again (under the gate no
        other number was issued since; shards replay by committed transaction id, not by number)."""
        if self.seq == seq:
            self.seq = seq - 1

    def _storage_failed(self, exc: Exception) -> None:
        """Record a failed write to the storage or to a local data directory in
        :attr:`write_error` (the Ingest health name turns NOT_SERVING until a commit succeeds;
        logged when the failure is new: once per change, not per request).

        :raises StorageUnavailable: ``exc`` is a failed object storage write. A full or failing
            local data directory (:func:`..index.disk_errors.disk_error`) is recorded and ``exc`` is
            left to the caller (its message already says what to do)."""
        msg = str(exc)
        if WRITE_FAILED not in msg:
            why = disk_error(exc)
            if why is not None:
                if self.write_error is None:
                    log.error("a data directory could not be written (%s): %s (writes fail until it can be)", why, msg)
                self.write_error = f"a data directory could not be written ({why}): {msg}"
            return
        msg = msg[msg.index(WRITE_FAILED):]
        if self.write_error is None:
            log.error("%s (writes are refused with UNAVAILABLE until the storage takes them again)", msg)
        self.write_error = msg
        err = StorageUnavailable(msg)
        err.nothing_stored = getattr(exc, "nothing_stored", False)
        raise err from exc

    async def delete(self, doc_ids: list[str]) -> tuple[int, int, int]:
        """Delete documents on every shard as one transaction.

        :returns: ``(documents deleted, chunks deleted, sequence number)``.
        """
        seq, replies = await self.commit(uuid.uuid4().hex, "delete", doc_ids)
        return sum(r.deleted_docs for r in replies), sum(r.removed for r in replies), seq

    async def wait_applied(self, seq: int, timeout: float | None) -> None:
        """Wait until every shard has applied ``seq``.

        :raises LookupError: ``seq`` was never issued by this service.
        :raises asyncio.TimeoutError: not applied within ``timeout`` seconds.
        """
        if seq <= self.applied_seq:
            return
        if seq > self.seq:
            raise LookupError(f"sequence number {seq} was never issued (the latest is {self.seq})")

        async def wait() -> None:
            async with self._applied:
                await self._applied.wait_for(lambda: self.applied_seq >= seq)

        await asyncio.wait_for(wait(), timeout)
