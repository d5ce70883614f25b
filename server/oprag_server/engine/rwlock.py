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

    @contextlib.asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
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
