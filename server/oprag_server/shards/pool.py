"""Shard pool: starts one transport per shard, fans requests out and gathers replies.

Patterns: *call* (one shard), *broadcast* (every shard, all must answer), *gather_partial*
(every or some shards, a shard that is down is reported missing instead of failing the call)
and *scatter* (items grouped by owning shard, one request per shard). Routing uses a stable
hash (BLAKE2b of the UTF-8 key), so a document or session lands on the same shard in every
process and every run. The pool talks only to :class:`~.transport.ShardTransport` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .gather import Gather, fields_later, hold_wakeups, release
from .protocol import Op, ShutdownRequest, SnapshotRequest, StatsReply, StatsRequest
from .replicas import ReplicaSet
from .transport import PipeTransport, ShardError, ShardTransport, StorageUnavailable

#: seconds a shard may take to report READY: the first start after an install compiles the
#: search kernels (numba; 30 s on a quiet 2-core machine, over 2 minutes on a busy one)
START_TIMEOUT_S = 600.0

__all__ = ["ShardError", "ShardPool", "route"]

log = logging.getLogger(__name__)
T = TypeVar("T")
TransportFactory = Callable[[int, int, "Path | None", bool], ShardTransport]


def route(key: str, n_shards: int) -> int:
    """Shard index of a routing key: ``blake2b(key, 8 bytes) mod n_shards`` (stable)."""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") % n_shards


def placement(cfg: Any) -> dict:
    """``ShardPool`` keyword arguments for a ``ServerConfig``: ``{"transport": RayPlacement |
    ThreadTransport | first_inline}`` (``--ray-address`` | ``--shard-workers thread | inline``)
    or ``{}`` (a process per shard)."""
    if cfg.ray.address is not None:
        from .ray_transport import RayPlacement  # noqa: PLC0415 - Ray only when asked for

        return {"transport": RayPlacement(cfg.ray, cfg.shards, cfg.replicas)}
    mod, name = {"thread": (".threaded", "ThreadTransport"), "inline": (".inline", "first_inline")}.get(
        cfg.shard_workers, (None, None))
    return {"transport": getattr(importlib.import_module(mod, __package__), name)} if mod else {}


def _behind(into: list, shard: int, client: Any, req: Any) -> None:
    """Send ``client`` the FIELDS request ``req`` (None: nothing) right behind its SEARCH and append
    ``(shard, future)`` to ``into``; the future's exception is marked as retrieved when it fails (a
    FIELDS reply nobody awaits when the request failed before its hits were materialised logs nothing)."""
    if req is not None:
        fut = client.call(Op.FIELDS, req)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        into.append((shard, fut))


class ShardPool:
    """``n`` shards behind transports.

    :param n: number of shards. :param dim: vector width D of the embedder.
    :param data_dir: parent directory of the shards' snapshots (None = in memory only).
    :param transport: ``(shard_id, dim, data_dir, stem) -> ShardTransport`` (default: a
        process per shard).
    :param replicas: transports per shard; above 1 each shard is a :class:`~.replicas.ReplicaSet`
        (writes to every live replica, reads to the least busy one).
    :param storage: storage URI holding every shard's snapshot and log as objects too (:mod:`.storage`).
    """

    def __init__(self, n: int, dim: int, data_dir: Path | None, stem: bool = False,
                 transport: TransportFactory = PipeTransport, dense: Any = None, replicas: int = 1,
                 storage: str | None = None) -> None:
        self.replicas = replicas
        self.storage = storage  # --storage-uri of every shard (None: the data directory only)
        # why shards may not write to the storage now (the owner lease was lost; None: they may)
        self.fenced: Callable[[], str | None] = lambda: None
        self.n = n
        self.dense = dense  # DenseConfig of every shard (None = flat)
        self.dim = dim
        self.data_dir = data_dir
        self.stem = stem
        self.transport = transport
        self.clients: list[ShardTransport] = []
        # shards being restarted (restart, in an executor thread) and whether shutdown began: a restart that
        # ended after the shutdown left a process nobody stopped, and the frontend's exit waited for it forever
        self._starting: dict[int, ShardTransport] = {}
        self.closed, self._lock = False, threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop, timeout_s: float = START_TIMEOUT_S,
              committed: set[str] | None = None) -> list[StatsReply]:
        """Start every shard and wait for READY (they load in parallel). Blocking; call before
        serving.

        :returns: each shard's READY stats (full BM25 statistics, ``replayed``).
        :raises ShardError: a shard failed to load or did not report READY in time.
        """
        clients = [self._make(i) for i in range(self.n)]
        try:
            for c in clients:
                c.dense, c.storage = self.dense, self.storage
                c.start(committed)
            stats = [c.ready(loop, timeout_s) for c in clients]
        except BaseException:  # the shards already started must not keep the process alive
            for c in clients:
                with contextlib.suppress(Exception):
                    c.kill()
            raise
        self.clients = clients
        return stats

    def restart(self, i: int, loop: asyncio.AbstractEventLoop, committed: set[str] | None,
                timeout_s: float = START_TIMEOUT_S) -> StatsReply:
        """Replace shard ``i`` by a new one that reloads its snapshot and replays its committed
        write-ahead log (blocking; run it in an executor). A transport with ``revive`` (a Ray
        actor, which Ray itself restarts) is reloaded in place. :returns: READY stats."""
        revive = getattr(self.clients[i], "revive", None)
        if revive is not None:
            return revive(loop, committed, timeout_s)
        self.clients[i].kill()
        new = self._make(i)
        new.dense, new.storage = self.dense, self.storage
        with self._lock:  # (a shutdown that began kills it: shutdown)
            if self.closed:
                raise ShardError(f"shard {i} is not restarted: the server is shutting down")
            self._starting[i] = new
        try:
            new.start(committed)
            if self.closed:  # (a shutdown's kill that came before the process existed)
                new.kill()
            res = new.ready(loop, timeout_s)
            with self._lock:
                if not self.closed:
                    self.clients[i] = new
                    return res
        finally:
            self._starting.pop(i, None)
        # the shutdown came during the start: nobody would stop this process (it held the frontend's exit)
        new.kill()
        raise ShardError(f"shard {i} is not restarted: the server is shutting down")

    def _make(self, i: int) -> ShardTransport:
        if self.replicas > 1:
            return ReplicaSet(i, self.dim, self.data_dir, self.stem, self.replicas, self.transport)
        return self.transport(i, self.dim, self.data_dir, self.stem)

    def degraded_shards(self) -> list[int]:
        """Shards that serve with a replica down (for supervision: revive the replica)."""
        return [c.shard_id for c in self.clients if getattr(c, "degraded", bool)()]

    def replicas_up(self) -> list[tuple[int, int, bool]]:
        """``(shard, replica, serving)`` of every replica (replica 0 alone without ``--replicas``)."""
        return [(c.shard_id, r, up) for c in self.clients
                for r, up in enumerate(c.replicas_up() if hasattr(c, "replicas_up") else [c.is_alive()])]

    def down_shards(self) -> list[int]:
        """Shards known to be down (for supervision)."""
        return [c.shard_id for c in self.clients if not c.is_alive()]

    def owner(self, key: str) -> int:
        """The shard that owns a routing key (document id or session id)."""
        return route(key, self.n)

    #: ops that write log records or snapshots to storage (refused while :attr:`fenced`)
    WRITES = frozenset({Op.PREPARE, Op.PROMOTE, Op.MEMORY_CLEAR, Op.SNAPSHOT})

    def _guard(self, op: Op) -> None:
        why = self.fenced() if op in self.WRITES else None
        if why:
            raise StorageUnavailable(why)

    def call(self, shard: int, op: Op, request: Any):
        """One request to one shard (awaitable; :raises ShardError:; ``StorageUnavailable``
        at once for a write while :attr:`fenced`)."""
        self._guard(op)
        return self.clients[shard].call(op, request)

    async def broadcast(self, op: Op, request: Any) -> list[Any]:
        """Send ``op`` to every shard (one request for all, or a list with one per shard) and
        gather. :raises ShardError: any shard failed."""
        self._guard(op)
        per = request if isinstance(request, list) else [request] * self.n
        return list(await asyncio.gather(*[c.call(op, r) for c, r in zip(self.clients, per)]))

    #: shards writing a snapshot at once (:meth:`snapshot`): a 1M-chunk shard's snapshot starts with
    #: a BM25 merge of ~1.8 GB of transient memory, and every shard took theirs at the same moment
    #: (snap18: the tree's peak, 9.7 GB, was both shards' merges at once; on 2 cores they share
    #: the CPU anyway, so one at a time takes about as long)
    SNAPSHOTS_AT_ONCE = 1

    async def snapshot(self, skip: Sequence[int] = ()) -> None:
        """:attr:`Op.SNAPSHOT` to every shard but those in ``skip``, :attr:`SNAPSHOTS_AT_ONCE` at
        a time, in shard order. :raises ShardError: a shard failed (the shards after it are not asked)."""
        self._guard(Op.SNAPSHOT)
        k, ask = max(1, self.SNAPSHOTS_AT_ONCE), [c for i, c in enumerate(self.clients) if i not in skip]
        for i in range(0, len(ask), k):
            await asyncio.gather(*[c.call(Op.SNAPSHOT, SnapshotRequest()) for c in ask[i: i + k]])

    async def unsaved(self) -> tuple[int, bool]:
        """What no snapshot holds and a restart would build again (the snapshot loop's test): the most BM25 segment
        bytes one shard holds in anonymous memory (:attr:`.protocol.StatsReply.segment_unsaved`), and whether some
        shard's dense index was compacted, renumbered or given new seeds by an idle step since its last snapshot
        (``ann_unsaved``: a rebuild at the next start costs seconds to minutes whatever its bytes, trial51b F5);
        ``(0, False)`` when the shards do not answer."""
        try:
            got, _ = await self.gather_partial(Op.STATS, StatsRequest())
        except Exception:  # noqa: BLE001 - asked by the snapshot loop, which must go on
            return 0, False
        return (max((int(getattr(r, "segment_unsaved", 0)) for r in got.values()), default=0),
                any(int(getattr(r, "ann_unsaved", 0)) > 0 for r in got.values()))

    async def gather_partial(self, op: Op, request: Any, shards: list[int] | None = None,
                             fields_into: list | None = None) -> tuple[dict[int, Any], list[int]]:
        """Like :meth:`broadcast` (to ``shards``, default all) but tolerant.

        ``fields_into`` (a list; a SEARCH with ``fetch_k`` > 0): the shards behind a process
        boundary (``defers_fields``) get the request with ``fields_later`` set and, right behind
        it, the FIELDS request that gets the fields its reply leaves out (computed while the
        frontend merges the replies); ``(shard, awaitable FieldsReply)`` of each is appended.

        :returns: ``({shard: reply}, missing shards)``: a shard that is down or fails is missing.
        :raises StorageUnavailable: a write while :attr:`fenced`.
        """
        self._guard(op)
        targets = list(range(self.n)) if shards is None else shards
        per = list(request) if isinstance(request, list) else [request] * len(targets)
        clients = [self.clients[s] for s in targets]
        later = fields_later(op, per, clients, fields_into)
        if len(clients) > 1 and all(getattr(c, "joins", False) for c in clients):
            # the replies resolve one Gather: this task wakes once, when the last is in
            g = Gather(asyncio.get_running_loop(), len(clients))
            # a shard served on this thread (--shard-workers inline) last: the others search meanwhile
            ks = sorted(range(len(clients)), key=lambda k: getattr(clients[k], "inline", False))
            # no shard woken here takes the frontend's core before the last write (or the inline search) ends
            held = hold_wakeups([clients[k] for k in ks])
            try:
                for k in ks:
                    clients[k].call(op, per[k], into=g.slot(k))
                    _behind(fields_into, targets[k], clients[k], later[k])
            finally:
                release(held)
            return self._sorted(targets, await g.future)
        futs = []
        for k, c in enumerate(clients):
            futs.append(c.call(op, per[k]))
            _behind(fields_into, targets[k], c, later[k])
        if len(futs) == 1:  # one shard (e.g. a single session's memory): no gather wrapper
            try:
                outs = [await futs[0]]
            except ShardError as exc:
                outs = [exc]
        elif all(isinstance(f, asyncio.Future) for f in futs):  # all sent already: await in turn (no gather)
            outs = []
            for f in futs:
                try:
                    outs.append(await f)
                except Exception as exc:  # noqa: BLE001 - as gather(return_exceptions=True): sorted below
                    outs.append(exc)
        else:  # gather starts a call that is a coroutine (a replica set's read) before awaiting any
            outs = await asyncio.gather(*futs, return_exceptions=True)
        return self._sorted(targets, outs)

    @staticmethod
    def _sorted(targets: list[int], outs: list[Any]) -> tuple[dict[int, Any], list[int]]:
        """``({shard: reply}, missing shards)`` of the outcomes of a call to ``targets``: a
        :class:`ShardError` is a missing shard, another exception is raised."""
        got, missing = {}, []
        for s, o in zip(targets, outs):
            if isinstance(o, BaseException):
                if not isinstance(o, ShardError):
                    raise o
                missing.append(s)
            else:
                got[s] = o
        return got, missing

    @staticmethod
    def group(items: Sequence[T], shard_of: Callable[[T], int]) -> dict[int, list[int]]:
        """``{shard: indices of its items in input order}``, shards in ascending order."""
        by: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            by.setdefault(shard_of(item), []).append(i)
        return dict(sorted(by.items()))

    async def scatter(self, op: Op, items: Sequence[T], shard_of: Callable[[T], int],
                      request: Callable[[list[T]], Any], *, partial: bool = True
                      ) -> tuple[dict[int, tuple[list[int], Any]], list[int]]:
        """Group ``items`` by owning shard and send each shard one request built from its items.

        :param shard_of: item -> shard index (e.g. ``lambda d: pool.owner(d)``).
        :param request: the shard's items (input order) -> its request.
        :param partial: a shard that is down is reported missing (True) or raises (False).
        :returns: ``({shard: (indices of its items, reply)}, missing shards)``.
        :raises ShardError: a shard failed and ``partial`` is False.
        """
        self._guard(op)
        by = self.group(items, shard_of)
        if not by:
            return {}, []
        shards = list(by)
        reqs = [request([items[i] for i in by[s]]) for s in shards]
        if partial:
            got, missing = await self.gather_partial(op, reqs, shards=shards)
        else:
            got = dict(zip(shards, await asyncio.gather(*[self.clients[s].call(op, r) for s, r in zip(shards, reqs)])))
            missing = []
        return {s: (by[s], rep) for s, rep in got.items()}, missing

    async def shutdown(self, snapshot: bool = True, timeout_s: float = 60.0) -> None:
        """Ask every shard to (snapshot and) exit; kill any that does not within ``timeout_s``,
        and any being restarted (:meth:`restart` then raises; none starts after this)."""
        with self._lock:
            self.closed, starting = True, list(self._starting.values())
        for c in starting:
            with contextlib.suppress(Exception):
                c.kill()
        futs = [c.call(Op.SHUTDOWN, ShutdownRequest(snapshot)) for c in self.clients if c.is_alive()]
        if futs:
            try:
                await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout_s)
            except asyncio.TimeoutError:
                log.error("shards did not shut down within %.0f s", timeout_s)
        for c in self.clients:
            c.close()
        release = getattr(self.transport, "release", None)  # e.g. a Ray placement group
        if release is not None:
            release()
