"""The frontend's readers-writer lock (engine/rwlock.py), also through its fast read path
(issue 13, front12): readers share, a writer excludes them, a waiting writer blocks new readers
and is woken when the last reader leaves, cancellation leaves the lock usable."""

from __future__ import annotations

import asyncio

import pytest

from oprag_server.engine.rwlock import RWLock


def test_readers_share_and_a_waiting_writer_blocks_new_readers():
    async def go():
        lk, log = RWLock(), []
        r1_in, r1_out = asyncio.Event(), asyncio.Event()

        async def reader(name, hold):
            async with lk.read():
                log.append(f"{name}+")
                if hold is not None:
                    r1_in.set()
                    await hold.wait()
                log.append(f"{name}-")

        async def writer():
            async with lk.write():
                log.append("w+")
                await asyncio.sleep(0)
                log.append("w-")

        t1 = asyncio.create_task(reader("r1", r1_out))
        await r1_in.wait()
        await reader("r2", None)  # a second reader enters beside the first
        tw = asyncio.create_task(writer())
        await asyncio.sleep(0.01)
        assert "w+" not in log and lk._writers_waiting == 1
        t3 = asyncio.create_task(reader("r3", None))  # behind the waiting writer
        await asyncio.sleep(0.01)
        assert "r3+" not in log
        r1_out.set()
        await asyncio.wait_for(asyncio.gather(t1, tw, t3), 5)
        assert log.index("r1-") < log.index("w+") < log.index("w-") < log.index("r3+")
        assert log[:4] == ["r1+", "r2+", "r2-", "r1-"]
        assert lk._readers == 0 and not lk._writer

    asyncio.run(go())


def test_a_writer_excludes_readers_and_cancelled_waiters_leave_it_usable():
    async def go():
        lk = RWLock()
        inside, release = asyncio.Event(), asyncio.Event()

        async def writer():
            async with lk.write():
                inside.set()
                await release.wait()

        tw = asyncio.create_task(writer())
        await inside.wait()

        async def reader():
            async with lk.read():
                return lk._writer

        tr = asyncio.create_task(reader())
        await asyncio.sleep(0.01)
        assert not tr.done()
        tr.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tr
        release.set()
        await tw
        assert await asyncio.wait_for(reader(), 5) is False
        assert lk._readers == 0

        async def failing():
            async with lk.read():
                raise ValueError("x")

        with pytest.raises(ValueError):
            await failing()
        assert lk._readers == 0
        async with lk.write():
            assert lk._readers == 0 and lk._writer

    asyncio.run(go())
