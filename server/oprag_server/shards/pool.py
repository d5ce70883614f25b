"""Shard pool: spawns shard worker processes, fans requests out to them and gathers replies.

Communication patterns over the pipes: *broadcast* (same request to every shard, e.g. a query
batch), *route* (one request to the shard that owns a routing key, e.g. an upsert batch) and
*gather* (await every reply). Routing uses a stable hash (BLAKE2b of the UTF-8 key), so a
document lands on the same shard in every process and every run.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Any

from . import worker

log = logging.getLogger(__name__)
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def route(key: str, n_shards: int) -> int:
    """Shard index of a routing key: ``blake2b(key, 8 bytes) mod n_shards`` (stable)."""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") % n_shards


class ShardError(RuntimeError):
    """A shard answered with an error or is unavailable."""


class _ShardClient:
    """One pipe to one shard process, with a reader thread resolving asyncio futures."""

    def __init__(self, shard_id: int, proc: mp.Process, conn, loop: asyncio.AbstractEventLoop) -> None:
        self.shard_id = shard_id
        self.proc = proc
        self.conn = conn
        self.loop = loop
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self.alive = True
        self._reader = threading.Thread(target=self._read_loop, name=f"shard-{shard_id}-reader", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        while True:
            try:
                req_id, ok, res = self.conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.pop(req_id, None)
            if fut is not None:
                self.loop.call_soon_threadsafe(_resolve, fut, ok, res, self.shard_id)
        self.alive = False
        for fut in list(self._pending.values()):
            self.loop.call_soon_threadsafe(_resolve, fut, False, "shard process exited", self.shard_id)
        self._pending.clear()

    def call(self, op: str, args: dict) -> asyncio.Future:
        fut = self.loop.create_future()
        if not self.alive:
            fut.set_exception(ShardError(f"shard {self.shard_id} is not running"))
            return fut
        req_id = next(self._ids)
        self._pending[req_id] = fut
        try:
            with self._send_lock:
                self.conn.send((req_id, op, args))
        except (OSError, ValueError) as exc:
            self._pending.pop(req_id, None)
            fut.set_exception(ShardError(f"shard {self.shard_id}: {exc}"))
        return fut


def _resolve(fut: asyncio.Future, ok: bool, res: Any, shard_id: int) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(res)
    else:
        fut.set_exception(ShardError(f"shard {shard_id}: {res}"))


class ShardPool:
    """Spawn and talk to ``n`` shard processes.

    :param n: number of shards.
    :param dim: vector width D of the embedder.
    :param data_dir: parent directory of the shards' snapshots (None = in memory only).
    """

    def __init__(self, n: int, dim: int, data_dir: Path | None, stem: bool = False) -> None:
        self.n = n
        self.dim = dim
        self.data_dir = data_dir
        self.stem = stem
        self.clients: list[_ShardClient] = []
        self.ready_stats: list[dict] = []

    def start(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 120.0, committed: set[str] | None = None) -> list[dict]:
        """Spawn every shard and wait for READY. Blocking; call before serving.

        :returns: each shard's initial stats (see ``ShardState.stats``).
        :raises ShardError: a shard failed to load or did not report READY in time.
        """
        procs = [self._spawn(i, committed) for i in range(self.n)]
        stats = []
        for i, (p, parent) in enumerate(procs):
            stats.append(self._await_ready(i, p, parent, timeout_s))
            self.clients.append(_ShardClient(i, p, parent, loop))
        self.ready_stats = stats
        return stats

    def _spawn(self, i: int, committed: set[str] | None):
        ctx = mp.get_context("spawn")
        # one BLAS/OpenMP thread per shard: shards run in parallel with each other, and a
        # multi-threaded matrix-vector product was 30x slower than a single-threaded one here
        saved = {k: os.environ.get(k) for k in _THREAD_VARS}
        os.environ.update({k: "1" for k in _THREAD_VARS})
        try:
            return self._spawn_process(ctx, i, committed)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _spawn_process(self, ctx, i: int, committed: set[str] | None):
        parent, child = ctx.Pipe(duplex=True)
        p = ctx.Process(
            target=worker.run,
            args=(i, child, self.dim, str(self.data_dir) if self.data_dir else None, self.stem, committed or set()),
            name=f"oprag-shard-{i}",
            daemon=True,
        )
        p.start()
        child.close()
        return p, parent

    @staticmethod
    def _await_ready(i: int, p, parent, timeout_s: float) -> dict:
        if not parent.poll(timeout_s):
            p.kill()
            raise ShardError(f"shard {i} did not report READY within {timeout_s:.0f} s")
        try:
            _, ok, res = parent.recv()
        except (EOFError, OSError) as exc:
            raise ShardError(f"shard {i} exited while starting: {exc}") from exc
        if not ok:
            raise ShardError(f"shard {i} failed to start: {res}")
        return res

    def restart(self, i: int, loop: asyncio.AbstractEventLoop, committed: set[str] | None,
                timeout_s: float = 120.0) -> dict:
        """Replace a dead shard process by a new one that reloads its snapshot and replays its
        committed write-ahead log (blocking; run it in an executor). :returns: READY stats."""
        old = self.clients[i]
        old.alive = False
        if old.proc.is_alive():
            old.proc.kill()
        old.proc.join(timeout=5)
        p, parent = self._spawn(i, committed)
        res = self._await_ready(i, p, parent, timeout_s)
        self.clients[i] = _ShardClient(i, p, parent, loop)
        return res

    def alive_shards(self) -> list[int]:
        return [c.shard_id for c in self.clients if c.alive and c.proc.is_alive()]

    async def gather_partial(self, op: str, args: dict | list[dict],
                             shards: list[int] | None = None) -> tuple[dict[int, Any], list[int]]:
        """Like :meth:`broadcast` but tolerant: :returns: ``({shard: reply}, missing shards)``
        where a shard that is down or fails is missing instead of failing the call."""
        targets = list(range(self.n)) if shards is None else shards
        per = args if isinstance(args, list) else [args] * len(targets)
        futs = [self.clients[s].call(op, a) for s, a in zip(targets, per)]
        if len(futs) == 1:  # one shard (e.g. a single session's memory): no gather wrapper
            try:
                outs = [await futs[0]]
            except ShardError as exc:
                outs = [exc]
        else:
            outs = await asyncio.gather(*futs, return_exceptions=True)
        got, missing = {}, []
        for s, o in zip(targets, outs):
            if isinstance(o, BaseException):
                if not isinstance(o, ShardError):
                    raise o
                missing.append(s)
            else:
                got[s] = o
        return got, missing

    async def call(self, shard: int, op: str, args: dict) -> Any:
        return await self.clients[shard].call(op, args)

    async def broadcast(self, op: str, args: dict | list[dict]) -> list[Any]:
        """Send ``op`` to every shard (``args`` may be one dict or one per shard) and gather."""
        per = args if isinstance(args, list) else [args] * self.n
        futs = [c.call(op, a) for c, a in zip(self.clients, per)]
        return list(await asyncio.gather(*futs))

    def healthy(self) -> bool:
        return all(c.alive and c.proc.is_alive() for c in self.clients)

    async def shutdown(self, snapshot: bool = True, timeout_s: float = 60.0) -> None:
        """Ask every shard to snapshot and exit; kill any that does not within ``timeout_s``."""
        futs = []
        for c in self.clients:
            if c.alive:
                futs.append(c.call("shutdown", {"snapshot": snapshot}))
        if futs:
            try:
                await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout_s)
            except asyncio.TimeoutError:
                log.error("shards did not shut down within %.0f s", timeout_s)
        for c in self.clients:
            c.proc.join(timeout=5)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join(timeout=5)
            try:
                c.conn.close()
            except OSError:
                pass
