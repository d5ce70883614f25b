"""How the frontend reaches one shard. :class:`ShardTransport` is the interface the pool talks
to; :class:`PipeTransport` runs the shard in a spawned process behind a ``multiprocessing``
pipe. Another placement (an in-process shard for tests, :mod:`.inprocess`; a remote actor) is
another subclass.

Life cycle: ``start(committed)`` launches the shard without waiting (several shards load in
parallel), ``ready(loop, timeout_s)`` blocks until the shard reported READY and returns its
stats, then ``call(op, request)`` returns an awaitable reply. ``kill()`` ends the shard at
once, ``close()`` waits briefly for an exit (after :attr:`Op.SHUTDOWN`) then kills.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import socket
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from . import worker
from .protocol import Op, StatsReply

log = logging.getLogger("oprag")
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class ShardError(RuntimeError):
    """A shard answered with an error or is unavailable."""


class StorageUnavailable(ShardError):
    """Writes cannot be stored on ``--storage-uri`` (a write failed there, or this server lost
    its owner lease); the message says which. Nothing was stored."""


class ShardTransport(abc.ABC):
    """One shard as the frontend sees it.

    :param shard_id: shard index; :param dim: vector width D; :param data_dir: parent of the
        shard's snapshot and log (None = memory only); :param stem: BM25 stemming.
    Attribute ``dense``: the shard's dense index settings (a ``DenseConfig``; None = flat), set
    by the pool before :meth:`start`; ``storage``: the storage URI holding the shard's
    snapshot and log as objects too (``--storage-uri``, :mod:`.storage`; None = the data
    directory only), set likewise.
    """

    dense: Any = None
    storage: str | None = None
    replica: int = 0  # which of the shard's replicas (set by a ReplicaSet before start)
    replicas: int = 1  # how many its shard has (likewise)

    @property
    def who(self) -> str:
        """``shard i``, or ``shard i replica r`` when its shard has several replicas (log lines)."""
        return f"shard {self.shard_id}" + (f" replica {self.replica}" if self.replicas > 1 else "")

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> None:
        self.shard_id = shard_id
        self.dim = dim
        self.data_dir = data_dir
        self.stem = stem

    @abc.abstractmethod
    def start(self, committed: set[str] | None) -> None:
        """Launch the shard (it loads its snapshot and replays ``committed`` log records);
        does not wait."""

    @abc.abstractmethod
    def ready(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> StatsReply:
        """Block until the shard reported READY; replies then resolve on ``loop``.

        :returns: its stats with the full BM25 statistics and ``replayed``.
        :raises ShardError: it failed to load, exited, or was not ready within ``timeout_s``.
        """

    @abc.abstractmethod
    def call(self, op: Op, request: Any) -> Awaitable[Any]:
        """Send one request. The awaitable raises :class:`ShardError` when the shard answers
        with an error or is down."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """False once the shard is known to be down."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End the shard now (pending calls fail with :class:`ShardError`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the shard after it was asked to shut down (blocking, a few seconds at most)."""


#: ops whose request goes to several shards at once (query path; small requests)
_SHARED_OPS = frozenset({Op.SEARCH, Op.EXACT_MINMAX, Op.EXACT_LISTS})
_ids = itertools.count(1)  # request ids, unique over every transport: a broadcast's frame is one byte string
# (the last shared request, its op, request id, frame, and the transports it went to); replaced whole (threads)
_last: tuple = (None, None, 0, b"", frozenset())


def _frame(op: Op, request: Any) -> tuple[int, bytes]:
    """``(request id, op, request)`` pickled behind its length header."""
    req_id = next(_ids)
    body = pickle.dumps((req_id, op, request), protocol=pickle.HIGHEST_PROTOCOL)
    return req_id, worker.frame_head(len(body)) + body


def _shared_frame(op: Op, request: Any, to: Any) -> tuple[int, bytes]:
    """The frame of a broadcast request, pickled once: the same request object sent with the
    same op to another transport reuses the last frame (its request id too: ids need only be
    unique per transport); sent to the same transport again, it gets a new frame."""
    global _last
    last = _last
    if last[0] is request and last[1] is op and to not in last[4]:
        _last = (*last[:4], last[4] | {to})
        return last[2], last[3]
    req_id, frame = _frame(op, request)
    _last = (request, op, req_id, frame, frozenset((to,)))
    return req_id, frame


def _resolve(fut: Any, ok: bool, res: Any, shard_id: int) -> None:
    """Resolve ``fut`` (a future, or a :class:`~.gather.Slot`) with a reply or its error."""
    if fut.done():
        return
    if ok:
        fut.set_result(res)
    else:
        fut.set_exception(ShardError(f"shard {shard_id}: {res}"))


class PipeTransport(ShardTransport):
    """The shard in a spawned process behind one duplex pipe (a socket pair), read and written
    by the event loop itself: replies resolve their futures in the loop's reader callback, with
    no reader thread and no cross-thread hand-off. Frames are those of
    ``multiprocessing.connection`` (a 4-byte big-endian signed length, -1 then an 8-byte length
    for larger ones, then a pickle), so the peer uses a plain ``Connection``."""

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> None:
        super().__init__(shard_id, dim, data_dir, stem)
        self.proc: Any = None
        self.conn: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._alive = False
        self._fd = -1
        self._rbuf = bytearray(1 << 16)  # read into in place: bytes [0, _rlen) are unparsed input
        self._rlen = 0
        self._need = 0  # bytes still missing of the frame being read
        self._wq: collections.deque[memoryview] = collections.deque()  # unsent output

    def start(self, committed: set[str] | None) -> None:
        ctx = mp.get_context("spawn")
        # one BLAS/OpenMP thread per shard: shards run in parallel with each other, and a
        # multi-threaded matrix-vector product was 30x slower than a single-threaded one here
        saved = {k: os.environ.get(k) for k in _THREAD_VARS}
        os.environ.update({k: "1" for k in _THREAD_VARS})
        try:
            parent, child = ctx.Pipe(duplex=True)
            self.proc = ctx.Process(
                target=worker.main,
                args=(self.shard_id, child, self.dim, str(self.data_dir) if self.data_dir else None, self.stem,
                      set() if committed is None else committed, self.dense, self.storage, self.who),
                name=f"oprag-shard-{self.shard_id}",
                daemon=True,
            )
            self.proc.start()
            log.info("%s: process pid %d", self.who, self.proc.pid)  # (which process is which shard)
            child.close()
            self.conn = parent
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def ready(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> StatsReply:
        i = self.shard_id
        if not self.conn.poll(timeout_s):
            self.proc.kill()
            raise ShardError(f"shard {i} did not report READY within {timeout_s:.0f} s (the first start after an "
                             "install compiles the search kernels; its log says how far it got)")
        try:
            _, ok, res = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise ShardError(f"shard {i} exited while starting: {exc}") from exc
        if not ok:
            raise ShardError(f"shard {i} failed to start: {res}")
        self.attach(self.conn, loop)
        return res

    def attach(self, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Serve calls over ``conn`` (a ``multiprocessing.connection`` end whose peer answers
        ``(request_id, op, request)`` with ``(request_id, ok, reply)``; the shard's pipe, or a
        socket to a remote shard) on ``loop``; callable from any thread. The end is switched to
        non-blocking mode: from now on only this object reads and writes it."""
        self.conn, self.loop, self._alive = conn, loop, True
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._on_loop(self._install)

    def _on_loop(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the loop's thread: now when this is it, else soon."""
        loop = self.loop
        assert loop is not None
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            fn(*args)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)  # no loop will run it: close what needs closing now

    def _install(self) -> None:
        if self._alive and self._fd >= 0:
            self.loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        """Read what the pipe holds into ``_rbuf`` (in place: no bytes object per read, no copy
        per frame) and resolve the call of every complete frame in it."""
        want, held = max(1 << 16, self._need), self._rlen
        if len(self._rbuf) < held + want:  # (no view of it is alive here: it may grow)
            self._rbuf.extend(bytes(held + want - len(self._rbuf)))
        try:
            with memoryview(self._rbuf) as mv:
                got = os.readv(self._fd, [mv[held:held + want]])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if not got:
            self._hang_up("shard process exited")
            return
        end, pos, frames, bad = held + got, 0, [], ""
        with memoryview(self._rbuf) as mv:
            while end - pos >= 4:
                size, hdr = int.from_bytes(mv[pos:pos + 4], "big", signed=True), 4
                if size == -1:
                    if end - pos < 12:
                        break
                    size, hdr = int.from_bytes(mv[pos + 4:pos + 12], "big"), 12
                if end - pos < hdr + size:
                    break
                try:  # (a reply holds copies: nothing unpickled refers to the buffer)
                    req_id, ok, res = pickle.loads(mv[pos + hdr:pos + hdr + size])
                    frames.append((req_id, ok, res))
                except Exception as exc:  # noqa: BLE001 - a corrupt stream: nothing after it can be trusted
                    bad = f"unreadable reply: {type(exc).__name__}: {exc}"
                    break
                pos += hdr + size
        rest = 0 if bad else end - pos
        if rest and pos:
            self._rbuf[:rest] = self._rbuf[pos:end]  # (same length: no resize)
        self._rlen = rest
        if not rest and len(self._rbuf) > 1 << 22:  # after a large reply: back to 64 KiB
            self._rbuf = bytearray(1 << 16)
        self._need = (hdr + size - rest) if rest >= 4 and rest < hdr + size else 0
        for req_id, ok, res in frames:
            fut = self._pending.pop(req_id, None)
            if fut is not None:
                _resolve(fut, ok, res, self.shard_id)
        if bad:
            self._hang_up(bad)

    def _hang_up(self, why: str) -> None:
        """(On the loop) stop reading and writing; every pending call fails with ``why``."""
        self._alive = False
        if self._fd >= 0 and self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self._fd)
            self.loop.remove_writer(self._fd)
        self._wq.clear()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            _resolve(fut, False, why, self.shard_id)

    def _write(self, data: bytes) -> None:
        if not self._alive:
            return  # hung up: the call already failed
        if not self._wq:
            try:
                n = os.write(self._fd, data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._hang_up(f"write failed: {exc}")
                return
            if n == len(data):
                return
            self.loop.add_writer(self._fd, self._flush)
            data = memoryview(data)[n:]
        self._wq.append(memoryview(data))

    def _flush(self) -> None:
        while self._wq:
            head = self._wq[0]
            try:
                n = os.write(self._fd, head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._hang_up(f"write failed: {exc}")
                return
            if n < len(head):
                self._wq[0] = head[n:]
                return
            self._wq.popleft()
        self.loop.remove_writer(self._fd)

    #: answers into a :class:`~.gather.Slot` (``call(..., into=slot)``): see :meth:`ShardPool.gather_partial`
    joins = True
    #: a SEARCH's fields may come in a FIELDS reply right behind it (:func:`.gather.fields_later`)
    defers_fields = True

    def call(self, op: Op, request: Any, into: Any = None) -> asyncio.Future:
        """Send one request; its reply resolves a new future, or ``into`` (a slot of a
        :class:`~.gather.Gather`: its awaiter wakes once for the whole group)."""
        if into is None:
            fut = (self.loop or asyncio.get_running_loop()).create_future()
        else:
            fut = into
        if not self._alive:
            fut.set_exception(ShardError(f"shard {self.shard_id} is not running"))
            return fut
        try:
            req_id, frame = _shared_frame(op, request, self) if op in _SHARED_OPS else _frame(op, request)
        except Exception as exc:  # noqa: BLE001 - a request that cannot cross the pipe
            fut.set_exception(ShardError(f"shard {self.shard_id}: {type(exc).__name__}: {exc}"))
            return fut
        self._pending[req_id] = fut
        self._on_loop(self._write, frame)
        return fut

    def hangup(self) -> None:
        """Shut the connection down both ways and close it (any thread): pending calls fail.
        For a peer that may never answer (a lost node sends no FIN)."""
        try:
            socket.socket(fileno=os.dup(self._fd)).shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._on_loop(self._detach, "connection shut down")

    def _detach(self, why: str) -> None:
        self._hang_up(why)
        self._fd = -1
        try:
            if self.conn is not None:
                self.conn.close()
        except OSError:
            pass

    def is_alive(self) -> bool:
        return self._alive and (self.proc is None or self.proc.is_alive())  # no process: attached

    def kill(self) -> None:
        self._alive = False
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.join(timeout=5)
        self.kill()
        if self.loop is not None and self._fd >= 0:
            self._on_loop(self._detach, "shard closed")
        elif self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
