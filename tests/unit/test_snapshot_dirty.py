"""A memory write that a shard applies while the shards' snapshot is written keeps the snapshot
loop's dirty flag (app.Runtime.snapshot). The commit gate excludes commits from a snapshot, not
memory writes (a recorded turn, a ClearSession): the flag was cleared after the snapshot, so such
a write -- applied after its shard's cut -- waited for the next write before any snapshot held it
(found as a flaky test_small18_server under load: no snapshot came after a ClearSession). The real
``Runtime.snapshot`` runs on a stand-in pool; the served path is test_small18_server's."""

from __future__ import annotations

import asyncio
import types

import pytest

from oprag_server.app import Runtime


def _runtime(during):
    rt = types.SimpleNamespace(_dirty=False, gauges=types.SimpleNamespace(stale=lambda: None), resets=0)
    rt.mark_dirty = lambda: Runtime.mark_dirty(rt)

    async def snapshot(skip=()):
        await asyncio.sleep(0)
        during(rt)
        await asyncio.sleep(0)

    def reset_log():
        rt.resets += 1
    rt.pool = types.SimpleNamespace(snapshot=snapshot)
    rt.commits = types.SimpleNamespace(gate=asyncio.Lock(), reset_log=reset_log)
    return rt


def test_a_write_applied_during_the_snapshot_leaves_the_shards_dirty():
    async def go():
        rt = _runtime(lambda rt: rt.mark_dirty())  # a ClearSession applied after its shard's cut
        rt._dirty = True  # (what the loop saw: a write before the snapshot)
        await Runtime.snapshot(rt)
        assert rt._dirty and rt.resets == 1  # the next round snapshots it
        quiet = _runtime(lambda rt: None)
        quiet._dirty = True
        await Runtime.snapshot(quiet)
        assert not quiet._dirty  # nothing came meanwhile: clean
    asyncio.run(go())


def test_a_failed_snapshot_leaves_the_shards_dirty():
    def boom(rt):
        raise OSError(28, "No space left on device")

    async def go():
        rt = _runtime(boom)
        rt._dirty = True
        with pytest.raises(OSError):
            await Runtime.snapshot(rt)
        assert rt._dirty and rt.resets == 0  # the log is kept, the next round tries again
    asyncio.run(go())
