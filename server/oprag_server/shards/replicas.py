"""Replicas: one shard held by R transports (``--replicas R``), behind the transport interface.

:class:`ReplicaSet` is a :class:`~.transport.ShardTransport` for the pool, so the pool, the
commit protocol and every operator are unchanged. Rules:

* **Writes** (stage, prepare, apply, abort, memory writes, snapshot) go to every *live*
  replica. A write succeeds when at least one replica succeeded; a replica that failed a write
  another one completed is marked down (killed, ``STALE`` file in its directory) and no longer
  serves. A replica that went down otherwise (its process died, a read found it gone) holds
  every write acknowledged so far: it is marked ``STALE`` only before the first write
  acknowledged without it (trial27: marked at once, a shard whose two replicas died one after
  the other, no write between, had both marked and never came back, not even after a restart,
  though the second one held every acknowledged write). When every replica fails, the shard
  fails the call (:class:`ShardError`) as a single shard does. So a write is acknowledged when
  every live replica committed it, and at least one replica of every shard did.
* **Reads** go to the serving replica with the fewest outstanding requests (ties rotate); a read
  that fails because its replica went down is retried on another one (reads change nothing).
* **Catch-up.** A replica that comes back never serves before it holds every acknowledged write:
  a live sibling writes a snapshot (:attr:`Op.SNAPSHOT`), the snapshot directory is copied into
  the replica's own directory, a fresh process loads it; the writes sent after the snapshot
  request (a backlog, plus the staged and prepared requests of the transactions then in flight,
  which the set holds until they commit or abort) are replayed into it in order; only when all
  of them succeeded does it serve. Needs a data directory (a memory-only replica stays down).

Replica ``r``'s directory is ``data_dir`` for ``r = 0`` (the single-replica layout) and
``data_dir/replica-r`` otherwise; each holds its own ``shard-i/`` snapshot and write-ahead log.
With ``--storage-uri`` the same layout is under the URI, and catch-up copies the sibling's
current snapshot there (:func:`.storage.copy_current`); the replica downloads it wherever it starts.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .protocol import Op, SnapshotRequest, StatsReply, StatsRequest
from .storage import copy_current, replica_uri
from .transport import ShardError, ShardTransport

log = logging.getLogger(__name__)
#: ops that change a shard (sent to every live replica; the rest are reads)
WRITES = frozenset({Op.STAGE, Op.PREPARE, Op.APPLY, Op.ABORT, Op.PROMOTE, Op.MEMORY_CLEAR, Op.SNAPSHOT, Op.SHUTDOWN})


def replica_dir(data_dir: Path | None, r: int) -> Path | None:
    """Parent directory of replica ``r``'s ``shard-i/`` (None: memory only)."""
    if data_dir is None or r == 0:
        return data_dir
    return data_dir / f"replica-{r}"


class ReplicaSet(ShardTransport):
    """Shard ``shard_id`` held by ``replicas`` transports made by ``factory(shard_id, dim,
    replica_dir, stem)`` (a :data:`~.pool.TransportFactory`)."""

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool, replicas: int,
                 factory: Callable[..., ShardTransport]) -> None:
        super().__init__(shard_id, dim, data_dir, stem)
        self.factory, self.r = factory, replicas
        self.reps = [self._make(r) for r in range(replicas)]
        self.live = [False] * replicas  # receives writes
        self.serving = [False] * replicas  # answers reads (live and caught up)
        self.outstanding = [0] * replicas
        self.backlog: dict[int, list[tuple[Op, Any]]] = {}  # catching-up replica -> writes to replay
        self.held: dict[str, list[tuple[Op, Any]]] = {}  # txn in flight -> its STAGE/PREPARE requests
        self.loop: asyncio.AbstractEventLoop | None = None
        self._snap = asyncio.Lock()
        self._rr = 0
        self._closing = False  # a SHUTDOWN was sent or the set closed: no replica is revived any more
        self._marked: set[int] = set()  # replicas marked STALE by this set (those behind: see _down)

    def _make(self, r: int) -> ShardTransport:
        t = self.factory(self.shard_id, self.dim, replica_dir(self.data_dir, r), self.stem)
        t.dense, t.replica, t.replicas, t.storage = self.dense, r, self.r, replica_uri(self.storage, r)
        return t

    def _stale(self, r: int, on: bool) -> None:
        (self._marked.add if on else self._marked.discard)(r)
        d = replica_dir(self.data_dir, r)
        if d is None:
            return
        f = d / f"shard-{self.shard_id}" / "STALE"
        if on:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"")
        else:
            f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ life cycle
    def start(self, committed: set[str] | None) -> None:
        for r, t in enumerate(self.reps):
            t.dense, t.storage = self.dense, replica_uri(self.storage, r)
            t.start(committed)

    def ready(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> StatsReply:
        """Every replica loads its own directory; the one with the highest applied sequence
        number that is not marked ``STALE`` serves; those behind it are marked down (the
        supervisor catches them up). :raises ShardError: no replica came up."""
        self.loop, got = loop, {}
        for r, t in enumerate(self.reps):
            try:
                got[r] = t.ready(loop, timeout_s)
            except ShardError as exc:
                log.error("shard %d replica %d did not start: %s", self.shard_id, r, exc)
        d = self.data_dir
        fresh = {r: s for r, s in got.items()
                 if d is None or not (replica_dir(d, r) / f"shard-{self.shard_id}" / "STALE").exists()}
        if not fresh:
            seqs = ", ".join(f"replica {r} applied seq {got[r].applied_seq}" for r in sorted(got)) or "none started"
            raise ShardError(
                f"shard {self.shard_id}: no replica came up with current data (every one is marked STALE: {seqs}). "
                "Older OpRAG versions marked a replica STALE as soon as it died; if the replicas all died "
                "with no write acknowledged after, the one with the highest applied seq holds every acknowledged "
                f"write: delete the STALE file in its shard-{self.shard_id} directory and start again")
        best = max(fresh, key=lambda r: fresh[r].applied_seq)
        for r in range(self.r):
            ok = r in fresh and fresh[r].applied_seq == fresh[best].applied_seq
            self.live[r] = self.serving[r] = ok
            if not ok:  # planned (e.g. a first start with more replicas): a warning, not an error (trial22)
                log.warning("shard %d replica %d is behind its siblings at start (applied seq %s, theirs %d): it "
                            "catches up from them before it serves", self.shard_id, r,
                            fresh[r].applied_seq if r in fresh else "unknown", fresh[best].applied_seq)
                self._down(r, "behind its siblings at start", quiet=True)
        return fresh[best]

    def _down(self, r: int, why: str, quiet: bool = False, behind: bool = True) -> None:
        """Replica ``r`` stops serving and is killed; ``behind``: it missed (or is about to miss)
        an acknowledged write, so it is marked ``STALE`` now; otherwise at the first write
        acknowledged without it (:meth:`_send_all`)."""
        if not quiet and (self.live[r] or r in self.backlog or self.reps[r].is_alive()):
            log.error("shard %d replica %d is down: %s", self.shard_id, r, why)
        self.live[r] = self.serving[r] = False
        self.backlog.pop(r, None)
        if behind:
            self._stale(r, True)
        self.reps[r].kill()

    def _up(self, r: int) -> bool:
        return self.serving[r] and self.reps[r].is_alive()

    def is_alive(self) -> bool:
        return any(map(self._up, range(self.r)))

    def replicas_up(self) -> list[bool]:
        """Per replica: it serves reads (alive and caught up; a replica catching up is not)."""
        return [self._up(r) for r in range(self.r)]

    def degraded(self) -> bool:
        """Some replica is down while the shard serves (the supervisor revives it)."""
        up = self.replicas_up()
        return any(up) and any(not u and r not in self.backlog for r, u in enumerate(up))

    def kill(self) -> None:
        for r in range(self.r):
            self.live[r] = self.serving[r] = False
            self.reps[r].kill()

    def close(self) -> None:
        self._closing = True
        for t in self.reps:
            t.close()

    # ------------------------------------------------------------------ calls
    def call(self, op: Op, request: Any):
        if op == Op.SHUTDOWN:  # (the server stops: a replica it stops is not "down", trial22)
            self._closing = True
        return self._write(op, request) if op in WRITES else self._read(op, request)

    def _one(self, r: int, op: Op, request: Any) -> asyncio.Future:
        """Send now (requests to one replica keep their order) and count it outstanding."""
        self.outstanding[r] += 1
        fut = asyncio.ensure_future(self.reps[r].call(op, request))

        def done(_: Any) -> None:
            self.outstanding[r] -= 1

        fut.add_done_callback(done)
        return fut

    async def _read(self, op: Op, request: Any) -> Any:
        tried: set[int] = set()
        while True:
            ok = [r for r in range(self.r) if r not in tried and self._up(r)]
            if not ok:
                raise ShardError(f"shard {self.shard_id}: no replica is serving")
            self._rr += 1  # ties (e.g. one request at a time) rotate over the replicas
            r = min(ok, key=lambda r: (self.outstanding[r], (r - self._rr) % self.r))
            try:
                return await self._one(r, op, request)
            except ShardError:
                if self.reps[r].is_alive():
                    raise  # the shard's own answer (e.g. a bad request): the same on every replica
                self._down(r, "failed a read", behind=False)  # (a read changes nothing: not behind yet)
                tried.add(r)

    async def _write(self, op: Op, request: Any) -> Any:
        if op is Op.SNAPSHOT:
            async with self._snap:  # not while a catch-up copies a snapshot directory
                return await self._send_all(op, request)
        return await self._send_all(op, request)

    async def _send_all(self, op: Op, request: Any) -> Any:
        txn = getattr(request, "txn", None)
        if op in (Op.STAGE, Op.PREPARE):
            self.held.setdefault(txn, []).append((op, request))
        elif op in (Op.APPLY, Op.ABORT):
            self.held.pop(txn, None)
        for q in self.backlog.values() if op is not Op.SHUTDOWN else ():
            q.append((op, request))
        targets = [r for r in range(self.r) if self.live[r]]
        if not targets:
            raise ShardError(f"shard {self.shard_id}: no replica is live")
        outs = await asyncio.gather(*[self._one(r, op, request) for r in targets], return_exceptions=True)
        good = [o for o in outs if not isinstance(o, BaseException)]
        for r, o in zip(targets, outs):
            if isinstance(o, BaseException) and not isinstance(o, ShardError):
                raise o
        if not good:
            raise outs[0]  # every replica failed: the shard fails the call, as a single shard would
        for r, o in zip(targets, outs):
            if isinstance(o, BaseException):
                self._down(r, f"failed {op.value} that a sibling completed: {o}")
        if len(self._marked) < self.r:  # a replica down since an earlier write misses this one: mark it first
            for r in range(self.r):
                if not self.live[r] and r not in self._marked:
                    self._stale(r, True)
        return good[0]

    # ------------------------------------------------------------------ catch-up
    def revive(self, loop: asyncio.AbstractEventLoop, committed: set[str] | None, timeout_s: float) -> StatsReply:
        """Bring back every replica that is down (blocking; run it in an executor, the set's
        loop keeps running). With no replica serving, every replica restarts from its own
        directory (:meth:`ready`). Once the set is stopping (a SHUTDOWN sent, or closed) no
        replica is revived or marked down: the replicas the shutdown stops hold every
        acknowledged write (trial22: a SIGTERM during a revival marked every replica ``STALE``
        and the next start was refused). :returns: a serving replica's stats. :raises ShardError:
        nothing came back, or the set is stopping."""
        if self._closing:
            raise ShardError(f"shard {self.shard_id}: stopping, no replica revived")
        if not self.is_alive():
            for r in range(self.r):
                self.reps[r].kill()
                self.reps[r].close()
                self.reps[r] = self._make(r)
            self.start(committed)
            return self.ready(loop, timeout_s)
        failed = []
        for r in range(self.r):
            if self._closing:
                raise ShardError(f"shard {self.shard_id}: stopping, no replica revived")
            if r not in self.backlog and not self._up(r):
                try:
                    asyncio.run_coroutine_threadsafe(self.catch_up(r, committed, timeout_s), loop).result()
                except Exception as exc:  # noqa: BLE001 - the others still try; raised below
                    failed.append(f"replica {r}: {type(exc).__name__}: {exc}")
        up = [r for r in range(self.r) if self._up(r)]
        if failed or not up:  # the supervisor retries on its next round
            raise ShardError(f"shard {self.shard_id}: {'; '.join(failed) or 'no replica serving'}")
        src = up[0]

        async def stats() -> StatsReply:
            return await self._one(src, Op.STATS, StatsRequest(lexical=True))

        return asyncio.run_coroutine_threadsafe(stats(), loop).result()

    async def catch_up(self, r: int, committed: set[str] | None, timeout_s: float) -> None:
        """Rebuild replica ``r`` from a serving sibling's snapshot, replay what was written
        since, then let it serve (see the module docstring). :raises ShardError: no data
        directory, or the sibling or the new replica failed."""
        if self.data_dir is None:
            raise ShardError(f"shard {self.shard_id}: a memory-only replica cannot catch up")
        if self._closing:
            raise ShardError(f"shard {self.shard_id}: stopping, replica {r} not caught up")
        srcs = [s for s in range(self.r) if s != r and self.serving[s] and self.reps[s].is_alive()]
        if not srcs:  # (before marking it: the shard may come back from this replica's own directory)
            raise ShardError(f"shard {self.shard_id}: no serving sibling to catch replica {r} up from")
        self._down(r, "catching up")
        src = min(srcs, key=lambda s: self.outstanding[s])
        loop = asyncio.get_running_loop()
        async with self._snap:
            snap = self._one(src, Op.SNAPSHOT, SnapshotRequest())  # sent now, the cut: later writes go to the backlog
            self.backlog[r] = [x for ops in self.held.values() for x in ops]
            try:
                await snap
                await loop.run_in_executor(None, self._copy, src, r)
            except BaseException:
                self.backlog.pop(r, None)
                raise
        await loop.run_in_executor(None, self.reps[r].close)  # (killed: at once) its threads, its channel
        if self._closing:  # (no new replica process after the shutdown: it stays STALE, behind)
            self.backlog.pop(r, None)
            raise ShardError(f"shard {self.shard_id}: stopping, replica {r} not caught up")
        new = self._make(r)
        self.reps[r] = new
        try:
            new.start(committed)
            await loop.run_in_executor(None, new.ready, loop, timeout_s)
        except BaseException:
            self.backlog.pop(r, None)
            raise
        todo = self.backlog.pop(r, None)
        if todo is None:
            raise ShardError(f"shard {self.shard_id} replica {r} went down while catching up")
        replay = [self._one(r, op, req) for op, req in todo]  # sent in order, in one step
        self.live[r] = True  # later writes go to it directly, after the replayed ones
        outs = await asyncio.gather(*replay, return_exceptions=True)
        bad = [o for o in outs if isinstance(o, BaseException)]
        if bad or not self.live[r]:
            self._down(r, f"replay failed: {bad[:1]}")
            raise ShardError(f"shard {self.shard_id} replica {r}: replay failed")
        self.serving[r] = True
        await loop.run_in_executor(None, self._stale, r, False)
        log.info("shard %d replica %d caught up (%d writes replayed)", self.shard_id, r, len(todo))

    def _copy(self, src: int, dst: int) -> None:
        """Replace replica ``dst``'s shard directory by ``src``'s current snapshot (no log: the
        snapshot covers every applied write; the rest is replayed). Marked ``STALE`` until
        it serves."""
        s = replica_dir(self.data_dir, src) / f"shard-{self.shard_id}"
        d = replica_dir(self.data_dir, dst) / f"shard-{self.shard_id}"
        if self.storage is not None:  # inside the storage; the replica downloads it where it starts
            shutil.rmtree(d, ignore_errors=True)
            copy_current(replica_uri(self.storage, dst), replica_uri(self.storage, src), self.shard_id)
        else:
            name = (s / "CURRENT").read_text().strip()
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(s / name, d / name)
            (d / "CURRENT").write_text(name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "STALE").write_bytes(b"")

