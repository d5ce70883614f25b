"""A small fair asyncio readers-writer lock.

Queries hold the read side while they fan out to shards, so that the corpus-global BM25
statistics the frontend sends always describe the same corpus state the shards score against;
commits hold the write side while shards apply a batch and the frontend applies its delta.
A waiting writer blocks new readers (no writer starvation).
"""

from __future__ import annotations

import asyncio
import contextlib


class RWLock:
    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._cond = asyncio.Condition()

    def read(self) -> "_Read":
        """The read side, ``async with lock.read():``. Taken at once (no wait, no condition
        round trip) when no writer holds or waits for the lock and nobody holds its condition."""
        return _Read(self)

    async def _read_slow(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1

    async def _unread_slow(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Read:
    """``RWLock.read()``: a reader that finds the lock free enters without awaiting; one that
    leaves while nobody waits on the condition leaves without it (a waiter checks its predicate
    before waiting, and the loop is single-threaded: nothing can start waiting in between)."""

    __slots__ = ("lock",)

    def __init__(self, lock: RWLock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        lk = self.lock
        if not lk._writer and lk._writers_waiting == 0 and not lk._cond.locked():
            lk._readers += 1
            return
        await lk._read_slow()

    async def __aexit__(self, *exc) -> None:
        lk = self.lock
        if not lk._cond.locked() and not lk._cond._waiters:  # noqa: SLF001 - asyncio.Condition's waiter deque
            lk._readers -= 1
            return
        await lk._unread_slow()
