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
import itertools
import multiprocessing as mp
import os
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from . import worker
from .protocol import Op, StatsReply

_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class ShardError(RuntimeError):
    """A shard answered with an error or is unavailable."""


class ShardTransport(abc.ABC):
    """One shard as the frontend sees it.

    :param shard_id: shard index; :param dim: vector width D; :param data_dir: parent of the
        shard's snapshot and log (None = memory only); :param stem: BM25 stemming.
    Attribute ``dense``: the shard's dense index settings (a ``DenseConfig``; None = flat), set
    by the pool before :meth:`start`.
    """

    dense: Any = None

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


def _resolve(fut: asyncio.Future, ok: bool, res: Any, shard_id: int) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(res)
    else:
        fut.set_exception(ShardError(f"shard {shard_id}: {res}"))


class PipeTransport(ShardTransport):
    """The shard in a spawned process; one duplex pipe, a reader thread resolving futures."""

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> None:
        super().__init__(shard_id, dim, data_dir, stem)
        self.proc: Any = None
        self.conn: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._alive = False

    def start(self, committed: set[str] | None) -> None:
        ctx = mp.get_context("spawn")
        # one BLAS/OpenMP thread per shard: shards run in parallel with each other, and a
        # multi-threaded matrix-vector product was 30x slower than a single-threaded one here
        saved = {k: os.environ.get(k) for k in _THREAD_VARS}
        os.environ.update({k: "1" for k in _THREAD_VARS})
        try:
            parent, child = ctx.Pipe(duplex=True)
            self.proc = ctx.Process(
                target=worker.run,
                args=(self.shard_id, child, self.dim, str(self.data_dir) if self.data_dir else None, self.stem,
                      committed or set(), self.dense),
                name=f"oprag-shard-{self.shard_id}",
                daemon=True,
            )
            self.proc.start()
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
            raise ShardError(f"shard {i} did not report READY within {timeout_s:.0f} s")
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
        socket to a remote shard) and resolve replies on ``loop``."""
        self.conn, self.loop, self._alive = conn, loop, True
        threading.Thread(target=self._read_loop, name=f"shard-{self.shard_id}-reader", daemon=True).start()

    def _read_loop(self) -> None:
        loop = self.loop
        assert loop is not None
        while True:
            try:
                req_id, ok, res = self.conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.pop(req_id, None)
            if fut is not None:
                loop.call_soon_threadsafe(_resolve, fut, ok, res, self.shard_id)
        self._alive = False
        for fut in list(self._pending.values()):
            loop.call_soon_threadsafe(_resolve, fut, False, "shard process exited", self.shard_id)
        self._pending.clear()

    def call(self, op: Op, request: Any) -> asyncio.Future:
        loop = self.loop or asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._alive:
            fut.set_exception(ShardError(f"shard {self.shard_id} is not running"))
            return fut
        req_id = next(self._ids)
        self._pending[req_id] = fut
        try:
            with self._send_lock:
                self.conn.send((req_id, op, request))
        except (OSError, ValueError) as exc:
            self._pending.pop(req_id, None)
            fut.set_exception(ShardError(f"shard {self.shard_id}: {exc}"))
        return fut

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
        try:
            if self.conn is not None:
                self.conn.close()
        except OSError:
            pass
