"""A commit whose caller is cancelled (the client left, or its deadline passed) is either
aborted whole or committed whole (trial16). Before, the cancellation cut the commit wherever it
was: during the commit log's append the record was still written by the executor thread while
the shards were told to abort (the write was invisible, then appeared after a restart); during
the shards' apply the frontend's corpus-global BM25 statistics and ``applied_seq`` missed it."""

from __future__ import annotations

import asyncio
import threading
import time

from oprag_server.shards.protocol import Op

from test_commit import _protocol, _shard_stats, _stage


def _hold(cp, op: Op, shard: int = 0) -> asyncio.Event:
    """Hold ``op`` on one shard until the returned event is set."""
    gate = asyncio.Event()
    client = cp.pool.clients[shard]
    real_call = client.call

    async def held(o, req):
        if o is op:
            await gate.wait()
        return await real_call(o, req)

    client.call = held
    return gate


def _docs(cp) -> set[str]:
    return {d for c in cp.pool.clients for d in c.state.store.doc_slots}


async def _cancel_while_held(cp, op: Op, txn: str):
    await _stage(cp, txn, {"a": ["alpha beta"], "b": ["gamma"], "c": ["delta alpha"]})
    await _cancel_held(cp, op, lambda: cp.commit(txn, "upsert"))


async def _cancel_held(cp, op: Op, make) -> None:
    """Start ``make()`` (a commit), cancel its caller while ``op`` is held on shard 0, let ``op``
    go on: the commit ends first, then the cancellation is raised."""
    gate = _hold(cp, op)
    task = asyncio.create_task(make())
    for _ in range(200):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # the caller's cancellation waits for the commit's end
    gate.set()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the cancellation was not raised")


def test_cancelled_during_apply_commits_whole_and_the_statistics_follow(tmp_path):
    async def go():
        cp = _protocol()
        committed = cp.open_log(tmp_path / "commits.log")
        assert not committed
        await _cancel_while_held(cp, Op.APPLY, "t1")
        assert _docs(cp) == {"a", "b", "c"}
        assert cp.stats == _shard_stats(cp) and cp.stats.n_docs == 3
        assert cp.applied_seq == cp.seq == 1
        assert cp.committed_txns() == {"t1"}
        await cp.wait_applied(1, timeout=0)
        await _stage(cp, "t2", {"d": ["epsilon"]})
        assert (await cp.commit("t2", "upsert"))[0] == 2 and cp.stats == _shard_stats(cp)

    asyncio.run(go())


def test_cancelled_during_the_commit_log_append_commits_whole(tmp_path):
    async def go():
        cp = _protocol()
        cp.open_log(tmp_path / "commits.log")
        appending, real_append = threading.Event(), cp.log.append

        def slow_append(rec):
            appending.set()
            time.sleep(0.3)
            real_append(rec)

        cp.log.append = slow_append
        await _stage(cp, "t1", {"a": ["alpha beta"], "b": ["gamma"]})
        task = asyncio.create_task(cp.commit("t1", "upsert"))
        while not appending.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        # logged, so recovery would replay it: it is applied now as well (before: aborted on the shards)
        assert cp.committed_txns() == {"t1"}
        assert _docs(cp) == {"a", "b"} and cp.stats == _shard_stats(cp) and cp.applied_seq == 1

    asyncio.run(go())


def test_cancelled_before_the_commit_point_stores_nothing(tmp_path):
    async def go():
        cp = _protocol()
        cp.open_log(tmp_path / "commits.log")
        await _cancel_while_held(cp, Op.PREPARE, "t1")
        assert _docs(cp) == set() and cp.committed_txns() == set() and cp.stats.n_docs == 0
        for c in cp.pool.clients:  # aborted on every shard: nothing left prepared or staged
            assert not c.state.txns.prepared and not c.state.txns.staged
        await _stage(cp, "t2", {"d": ["epsilon"]})
        seq, _ = await cp.commit("t2", "upsert")
        assert _docs(cp) == {"d"} and cp.applied_seq == seq and cp.stats == _shard_stats(cp)

    asyncio.run(go())


def test_cancelled_while_waiting_for_the_write_lock_takes_no_sequence_number():
    async def go():
        cp = _protocol()
        await cp.gate.acquire()  # (a snapshot holds it)
        await _stage(cp, "t1", {"a": ["alpha"]})
        task = asyncio.create_task(cp.commit("t1", "upsert"))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        cp.gate.release()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert cp.seq == 0 and _docs(cp) == set()

    asyncio.run(go())


async def _delete_cancelled_while_held(cp, op: Op, doc_id: str) -> None:
    await _cancel_held(cp, op, lambda: cp.delete([doc_id]))  # (the caller's deadline passed)
    for c in cp.pool.clients:  # un-hold
        c.call = type(c).call.__get__(c)


def test_a_delete_whose_caller_left_is_counted_by_outcome_and_numbers_follow_what_was_applied():
    """Issue 17 trial: a Delete applied after its caller's deadline passed was counted only as
    DEADLINE_EXCEEDED, and very short deadlines used 4 sequence numbers for 2 applied deletes
    (an aborted transaction kept its number). Now oprag_writes_after_caller_left_total says
    applied / aborted, and an aborted transaction's number is taken by the next one."""
    from oprag_server.service.metrics import Metrics

    def count(m, outcome, kind="delete"):
        return m.registry.get_sample_value("oprag_writes_after_caller_left_total",
                                           {"kind": kind, "outcome": outcome}) or 0.0

    async def go():
        cp = _protocol()
        cp.metrics = m = Metrics()
        await _stage(cp, "t1", {"a": ["alpha"], "b": ["beta"], "c": ["gamma"], "d": ["delta"]})
        assert (await cp.commit("t1", "upsert"))[0] == 1
        await _delete_cancelled_while_held(cp, Op.PREPARE, "a")  # left before the commit point
        assert (count(m, "aborted"), count(m, "applied")) == (1, 0)
        assert cp.seq == cp.applied_seq == 1 and "a" in _docs(cp)
        await _delete_cancelled_while_held(cp, Op.APPLY, "b")  # left after it: applied whole
        assert (count(m, "aborted"), count(m, "applied")) == (1, 1)
        assert cp.seq == cp.applied_seq == 2 and "b" not in _docs(cp)
        await _delete_cancelled_while_held(cp, Op.PREPARE, "c")
        assert (await cp.delete(["d"]))[2] == 3  # 2 applied deletes: numbers 2 and 3
        assert cp.seq == cp.applied_seq == 3 and _docs(cp) == {"a", "c"}
        assert count(m, "aborted") == 2 and count(m, "applied") == 1

    asyncio.run(go())


def test_a_number_given_back_by_an_aborted_delete_replays_right_after_a_restart(tmp_path):
    """The aborted delete's prepare record and the next delete's share sequence number 2 in the
    shards' write-ahead logs; a restart replays the committed one only."""
    from oprag_server.engine.commit import CommitProtocol
    from oprag_server.engine.rwlock import RWLock
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.shards.inprocess import InProcessTransport
    from oprag_server.shards.pool import ShardPool

    def start(loop):
        cp = CommitProtocol(ShardPool(2, 4, tmp_path, transport=InProcessTransport), CorpusStats(), RWLock())
        ready = cp.pool.start(loop, committed=cp.open_log(tmp_path / "commits.log"))
        cp.recover(r.applied_seq for r in ready)
        return cp

    async def go():
        loop = asyncio.get_running_loop()
        cp = start(loop)
        await _stage(cp, "t1", {"a": ["alpha"], "b": ["beta"], "c": ["gamma"]})
        await cp.commit("t1", "upsert")
        await _delete_cancelled_while_held(cp, Op.PREPARE, "a")
        assert (await cp.delete(["b"]))[2] == 2
        before = _docs(cp)
        cp2 = start(loop)
        assert _docs(cp2) == before == {"a", "c"} and cp2.seq == 2

    asyncio.run(go())
