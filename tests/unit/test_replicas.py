"""ReplicaSet (shards/replicas.py) over in-process shards with real data directories: writes
reach every live replica, a replica failing a write its sibling completed is taken out, reads
rotate, a returning replica catches up (snapshot + backlog, transactions in flight included)
before it serves, a replica marked STALE does not serve after a restart. The process-level
test with SIGKILL is tests/integration/test_replicas.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from oprag_server import records
from oprag_server.engine.commit import CommitProtocol
from oprag_server.engine.rwlock import RWLock
from oprag_server.index.bm25 import CorpusStats
from oprag_server.shards.inprocess import InProcessTransport
from oprag_server.shards.pool import ShardError, ShardPool
from oprag_server.shards.protocol import Op, ReuseRequest, StageRequest, StatsRequest
from oprag_server.shards.replicas import ReplicaSet, replica_dir

DIM = 4


def _batch(doc_ids: list[str]):
    n = len(doc_ids)
    texts = [f"tide table {d}" for d in doc_ids]
    return records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in doc_ids], doc_ids=doc_ids, titles=[""] * n, texts=texts, metadata=[{}] * n,
        ordinals=[0] * n, generations=[1] * n, content_hashes=texts, vectors=np.ones((n, DIM), np.float32))


async def _pool(tmp_path, replicas: int = 2) -> tuple[ShardPool, CommitProtocol]:
    pool = ShardPool(1, DIM, tmp_path, transport=InProcessTransport, replicas=replicas)
    pool.start(asyncio.get_running_loop(), committed=set())
    cp = CommitProtocol(pool, CorpusStats(), RWLock())
    cp.open_log(tmp_path / "commits.log")
    return pool, cp


async def _stage(pool: ShardPool, txn: str, docs: list[str]) -> None:
    await pool.call(0, Op.STAGE, StageRequest(txn, records.to_ipc(_batch(docs))))


async def _write(pool, cp, txn: str, docs: list[str]) -> None:
    await _stage(pool, txn, docs)
    await cp.commit(txn, "upsert")


def _docs(rs: ReplicaSet, r: int) -> int:
    return rs.reps[r].state.stats(StatsRequest()).documents


def test_writes_reach_every_replica_and_reads_rotate(tmp_path):
    async def main():
        pool, cp = await _pool(tmp_path)
        rs = pool.clients[0]
        assert isinstance(rs, ReplicaSet) and (tmp_path / "replica-1" / "shard-0").is_dir()
        await _write(pool, cp, "t1", ["a", "b"])
        assert [_docs(rs, r) for r in range(2)] == [2, 2]
        assert replica_dir(tmp_path, 1) == tmp_path / "replica-1" and replica_dir(tmp_path, 0) == tmp_path
        hits = [0, 0]
        for r, t in enumerate(rs.reps):
            def counted(op, req, r=r, call=t.call):
                hits[r] += 1
                return call(op, req)
            t.call = counted
        for _ in range(6):
            await pool.call(0, Op.STATS, StatsRequest())
        assert hits == [3, 3]  # one request at a time alternates over the two replicas
        await asyncio.gather(*[pool.call(0, Op.STATS, StatsRequest()) for _ in range(4)])
        assert hits == [5, 5]  # concurrent ones go to the replica with fewer outstanding

    asyncio.run(main())


def test_a_replica_failing_a_write_is_taken_out_and_caught_up_before_serving(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        pool, cp = await _pool(tmp_path)
        rs = pool.clients[0]
        await _write(pool, cp, "t1", ["a"])
        await _stage(pool, "t2", ["b"])  # in flight while replica 1 fails and comes back
        rs.reps[1].kill()
        await _write(pool, cp, "t3", ["c"])  # succeeds on replica 0 alone
        assert rs.live == [True, False] and pool.degraded_shards() == [0] and pool.down_shards() == []
        assert (tmp_path / "replica-1" / "shard-0" / "STALE").exists()
        await loop.run_in_executor(None, pool.restart, 0, loop, cp.committed_txns())
        assert rs.serving == [True, True] and pool.degraded_shards() == []
        assert not (tmp_path / "replica-1" / "shard-0" / "STALE").exists()
        await cp.commit("t2", "upsert")  # staged before the catch-up: replayed into replica 1
        assert [_docs(rs, r) for r in range(2)] == [3, 3]
        rep = await rs.reps[1].call(Op.REUSE, ReuseRequest(["a", "b", "c"]))
        assert sorted(rep.vectors) == ["a", "b", "c"]

    asyncio.run(main())


def test_an_error_every_replica_gives_fails_the_call_and_takes_no_replica_out(tmp_path):
    async def main():
        pool, cp = await _pool(tmp_path)
        with pytest.raises(ShardError):
            await pool.call(0, Op.STAGE, StageRequest("t", b"not arrow"))
        assert pool.clients[0].live == [True, True]

    asyncio.run(main())


def test_a_stale_replica_does_not_serve_after_a_restart(tmp_path):
    async def main():
        pool, cp = await _pool(tmp_path)
        rs = pool.clients[0]
        rs.reps[0].kill()
        await _write(pool, cp, "t1", ["a"])  # replica 0 misses it and is marked STALE
        await pool.shutdown(snapshot=True)
        pool2 = ShardPool(1, DIM, tmp_path, transport=InProcessTransport, replicas=2)
        st = pool2.start(asyncio.get_running_loop(), committed=cp.committed_txns())
        assert st[0].documents == 1 and pool2.clients[0].serving == [False, True]

    asyncio.run(main())


def test_a_replica_found_gone_by_a_read_is_marked_stale_at_the_next_write(tmp_path):
    """trial27: a replica that died holds every write acknowledged so far; it is marked STALE only
    before the first write acknowledged without it. Both replicas of the shard found gone by reads,
    no write between: neither is STALE, and a restart serves both."""
    async def main():
        pool, cp = await _pool(tmp_path)
        rs = pool.clients[0]
        await _write(pool, cp, "t1", ["a"])
        stale = [tmp_path / "shard-0" / "STALE", tmp_path / "replica-1" / "shard-0" / "STALE"]
        rs.reps[0].kill()
        rs._down(0, "failed a read", behind=False)  # noqa: SLF001 - what a read that found it gone does
        assert rs.serving == [False, True] and not stale[0].exists()
        await _write(pool, cp, "t2", ["b"])  # acknowledged without replica 0: marked first
        assert stale[0].exists() and not stale[1].exists()
        rs.reps[1].kill()
        rs._down(1, "failed a read", behind=False)  # noqa: SLF001
        assert not stale[1].exists()  # replica 1 holds every acknowledged write
        with pytest.raises(ShardError, match="no serving sibling"):  # (a revival's round: nothing to copy from)
            await rs.catch_up(1, cp.committed_txns(), 30)
        assert not stale[1].exists()  # ... and it did not mark the replica it could not catch up
        pool2 = ShardPool(1, DIM, tmp_path, transport=InProcessTransport, replicas=2)
        st = pool2.start(asyncio.get_running_loop(), committed=cp.committed_txns())
        assert st[0].documents == 2 and pool2.clients[0].serving == [False, True]

    asyncio.run(main())


def test_exact_hybrid_is_one_read_that_a_sibling_answers_when_its_replica_dies(tmp_path):
    from oprag_server.shards.protocol import ExactMinmaxRequest, QueryBatch

    async def main():
        pool, cp = await _pool(tmp_path)
        rs = pool.clients[0]
        await _write(pool, cp, "t1", ["a", "b", "c"])
        q = np.full((1, DIM), 0.5, np.float32)
        req = ExactMinmaxRequest(QueryBatch(q, [["tide"]], [np.ones(1)], 3.0, 1.2, 0.75), [2], 3, [(0.5, 0.5)])
        want = await pool.call(0, Op.EXACT_MINMAX, req)
        rs.reps[0].kill()
        got = await pool.call(0, Op.EXACT_MINMAX, req)
        assert got.band[0].chunk_ids == want.band[0].chunk_ids and len(want.band[0].chunk_ids) >= 2
        assert got.eligible == want.eligible == [3] and pool.degraded_shards() == [0]

    asyncio.run(main())


def test_a_shutdown_during_a_revival_marks_no_up_to_date_replica_stale(tmp_path):
    """trial22: a SIGTERM while a dead replica was being caught up let the revival go on to the
    sibling the shutdown had just stopped, mark it down (``STALE``) too, and the next start was
    refused: "no replica came up with current data"."""
    import threading

    async def main():
        loop = asyncio.get_running_loop()
        pool, cp = await _pool(tmp_path)
        rs = pool.clients[0]
        await _write(pool, cp, "t1", ["a"])
        rs.reps[0].kill()
        await _write(pool, cp, "t2", ["b"])  # acknowledged by replica 1 alone
        copying, go = threading.Event(), threading.Event()
        real = rs._copy  # noqa: SLF001

        def slow_copy(src, dst):  # the revival is under way when the shutdown comes
            copying.set()
            assert go.wait(20)
            real(src, dst)

        rs._copy = slow_copy  # noqa: SLF001
        revival = loop.run_in_executor(None, pool.restart, 0, loop, cp.committed_txns())
        assert await loop.run_in_executor(None, copying.wait, 20)
        await pool.shutdown(snapshot=True)  # as the server's SIGTERM does
        go.set()
        with pytest.raises(ShardError, match="stopping"):
            await revival
        assert not (tmp_path / "replica-1" / "shard-0" / "STALE").exists()  # it holds every write
        assert (tmp_path / "shard-0" / "STALE").exists()  # replica 0 missed t2: still marked
        pool2 = ShardPool(1, DIM, tmp_path, transport=InProcessTransport, replicas=2)
        st = pool2.start(loop, committed=cp.committed_txns())
        assert st[0].documents == 2 and pool2.clients[0].serving == [False, True]

    asyncio.run(main())
