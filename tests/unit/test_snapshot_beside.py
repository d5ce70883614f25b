"""A shard writes its snapshot beside its request loop (issue 13, snap14): queries sent while a
(deliberately slowed) snapshot is written are answered before it is done; writes wait for it,
in order, and so does whatever comes after them; a shard killed (SIGKILL) while it writes one
keeps the previous snapshot live and its log whole, so every acknowledged write is there after
a restart."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.shards import chunk_files
from oprag_server.shards import snapshot as snapshots
from oprag_server.shards import worker
from oprag_server.shards.protocol import (ApplyRequest, FetchRequest, MemoryLookupRequest, Op, PrepareRequest,
                                          PromoteRequest, QueryBatch, SearchRequest, ShutdownRequest,
                                          SnapshotRequest, StageRequest, StatsRequest)
from oprag_server.shards.state import ShardState

D = 8
HOLD_S = 8.0  # how long the slowed snapshot waits for the queries' replies before it goes on


def _batch(lo: int, hi: int):
    texts = [f"chunk {i} lighthouse topic {i % 5}" for i in range(lo, hi)]
    v = np.random.default_rng(lo).standard_normal((hi - lo, D)).astype(np.float32)
    return records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(lo, hi)], doc_ids=[f"d{i}" for i in range(lo, hi)],
        titles=[""] * (hi - lo), texts=texts, metadata=[{}] * (hi - lo), ordinals=[0] * (hi - lo),
        generations=[1] * (hi - lo), content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=v / np.linalg.norm(v, axis=1, keepdims=True))


def _seed(tmp_path, n: int = 200) -> None:
    """A shard directory holding a snapshot of ``n`` chunks and an empty log."""
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, n)]), 1)
    st.snapshot()
    st.txns.wal.close()


def _search() -> SearchRequest:
    q = np.ones((1, D), np.float32) / np.sqrt(D)
    return SearchRequest(QueryBatch(q, [["lighthouse"]], [np.ones(1)], 5.0, 1.5, 0.75), mode="hybrid", n=5)


def _serve(tmp_path, client) -> None:
    """``worker.run`` in this (the main) thread, ``client(conn)`` on another; signal handlers restored."""
    front, back = mp.get_context("spawn").Pipe(duplex=True)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    errors: list = []

    def run_client():
        try:
            client(front)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            front.close()

    t = threading.Thread(target=run_client)
    t.start()
    try:
        worker.run(0, back, D, str(tmp_path), False, set())
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        t.join(30)
    if errors:
        raise errors[0]


def _hold(monkeypatch) -> threading.Event:
    """Hold the snapshot's chunks file until the returned event is set (at most HOLD_S): its
    write, or its link when the stored fields did not change since the loaded snapshot."""
    released, real, link = threading.Event(), chunk_files.fsync_write_with, chunk_files.link

    def slow(path, write):
        if path.name.startswith("chunks."):
            released.wait(HOLD_S)
        return real(path, write)

    def slow_link(src, dst):
        released.wait(HOLD_S)
        return link(src, dst)

    monkeypatch.setattr(chunk_files, "fsync_write_with", slow)
    monkeypatch.setattr(chunk_files, "link", slow_link)
    return released


def test_reads_are_answered_while_the_snapshot_is_written_and_writes_wait_in_order(tmp_path, monkeypatch):
    _seed(tmp_path)
    released = _hold(monkeypatch)  # the snapshot's chunks file: held until the queries were answered
    order: list[int] = []
    replies: dict[int, tuple] = {}

    def client(conn):
        rid, ok, ready = conn.recv()
        assert ok and ready.chunks == 200
        t0 = time.perf_counter()

        def recv(n):
            for _ in range(n):
                rid, ok, rep = conn.recv()
                order.append(rid)
                replies[rid] = (ok, rep, time.perf_counter() - t0)

        conn.send((1, Op.SNAPSHOT, SnapshotRequest()))
        conn.send((2, Op.STATS, StatsRequest()))
        conn.send((3, Op.SEARCH, _search()))
        conn.send((4, Op.FETCH, FetchRequest([0, 1, 199])))
        recv(3)
        conn.send((5, Op.PROMOTE, PromoteRequest("s", "q?", "", [], [], np.ones(D, np.float32), max_turns=4)))
        conn.send((6, Op.MEMORY_LOOKUP, MemoryLookupRequest(["s"], 4)))  # a read: passes the held write
        recv(1)
        released.set()
        recv(2)
        conn.send((7, Op.MEMORY_LOOKUP, MemoryLookupRequest(["s"], 4)))
        conn.send((8, Op.SHUTDOWN, ShutdownRequest(snapshot=False)))
        recv(2)

    _serve(tmp_path, client)
    # the reads came back while the snapshot was held (before: only after HOLD_S, the snapshot first)
    assert order[:4] == [2, 3, 4, 6] and all(replies[i][2] < HOLD_S / 2 for i in (2, 3, 4, 6)), (order, replies)
    assert all(replies[i][0] for i in replies), replies
    assert replies[2][1].chunks == 200 and replies[4][1].found == [True, True, True]
    assert len(replies[3][1].candidates) == 1 and len(replies[3][1].candidates[0].slots) == 5
    assert replies[6][1].turns == [[]]  # (the promote waits for the snapshot)
    # then the snapshot, then the write held behind it; a lookup after its reply sees it
    assert order[4:] == [1, 5, 7, 8] and replies[1][1].written and replies[1][1].chunks == 200
    assert [t.question for t in replies[7][1].turns[0]] == ["q?"]


def _stall_before_current() -> None:
    """(In a forked child) every snapshot from now on stops before ``CURRENT`` switches, until
    the process is killed."""
    real = snapshots.fsync_write

    def never(path, data):
        if path.name == "CURRENT":
            time.sleep(3600)  # killed here
        return real(path, data)

    snapshots.fsync_write = never


def _kill_mid_snapshot(tmp_path, conn_child):
    """(A forked child) serve the shard; its snapshot stops before ``CURRENT`` switches."""
    _stall_before_current()
    worker.run(0, conn_child, D, str(tmp_path), False, set())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_shard_killed_while_it_writes_a_snapshot_keeps_everything_acknowledged(tmp_path):
    _seed(tmp_path)
    live = (tmp_path / "shard-0" / "CURRENT").read_text()
    front, back = mp.get_context("fork").Pipe(duplex=True)
    proc = mp.get_context("fork").Process(target=_kill_mid_snapshot, args=(tmp_path, back), daemon=True)
    proc.start()
    try:
        _ack_t1(front)
        front.send((4, Op.SNAPSHOT, SnapshotRequest()))
        front.send((5, Op.STATS, StatsRequest()))
        assert front.poll(30)
        rid, ok, stats = front.recv()
        assert (rid, ok, stats.chunks) == (5, True, 260)  # answered while the snapshot is written
        _kill_once_written(proc, tmp_path, live)
    finally:
        if proc.is_alive():
            proc.kill()
    _assert_recovered(tmp_path, live)


def _ack_t1(front) -> None:
    """Once the shard served on ``front`` is ready: an acknowledged transaction t1 after its
    snapshot (chunks 200..259, in the log only)."""
    assert front.poll(60) and front.recv()[1]
    front.send((1, Op.STAGE, StageRequest("t1", records.to_ipc(_batch(200, 260)))))
    front.send((2, Op.PREPARE, PrepareRequest("t1", 2, "upsert")))
    front.send((3, Op.APPLY, ApplyRequest("t1")))
    assert [front.recv()[1] for _ in range(3)] == [True] * 3


def _kill_once_written(proc, tmp_path, live: str) -> None:
    """SIGKILL ``proc`` once the new snapshot's files are in shard 0's directory (``CURRENT``,
    still naming ``live``, not switched yet)."""
    deadline = time.monotonic() + 30
    while not any((p / "meta.json").exists() for p in (tmp_path / "shard-0").glob("snap-*") if p.name != live):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def _assert_recovered(tmp_path, live: str) -> None:
    """After such a kill: the previous snapshot is live, the log replays the acknowledged
    transaction t1 (chunks 200..259), and the restarted shard's next snapshot replaces the
    half-written one."""
    assert (tmp_path / "shard-0" / "CURRENT").read_text() == live  # the previous snapshot is live
    again = ShardState(0, D, tmp_path)
    assert again.load({"t1"}) >= 1  # the log replays the acknowledged transaction
    assert len(again.store.chunks) == 260 and all(f"d{i}" in again.store.doc_slots for i in range(260))
    again.snapshot()
    assert len(list((tmp_path / "shard-0").glob("snap-*"))) == 1


def test_a_commit_waiting_for_a_snapshot_does_not_hold_queries_back():
    """``Runtime.snapshot`` excludes commits (``CommitProtocol.gate``) without holding the read
    side of the index lock: a commit waiting for the snapshot is then no waiting writer, which
    would block every new query (reader) until the snapshot was done (before: it was)."""
    import asyncio

    from oprag_server import app
    from oprag_server.engine.commit import CommitProtocol
    from oprag_server.engine.rwlock import RWLock
    from oprag_server.index.bm25 import CorpusStats

    async def go():
        written = asyncio.Event()
        order = []

        class Pool:
            async def broadcast(self, op, req):
                if op is Op.SNAPSHOT:
                    await written.wait()
                order.append(op.value)
                return []

            async def snapshot(self, skip=()):  # (ShardPool.snapshot: one shard at a time)
                await self.broadcast(Op.SNAPSHOT, SnapshotRequest())

        rt = type("Rt", (), {})()
        rt.lock, rt.pool, rt._dirty = RWLock(), Pool(), True
        rt.commits = CommitProtocol(rt.pool, CorpusStats(), rt.lock)
        snap = asyncio.create_task(app.Runtime.snapshot(rt))
        await asyncio.sleep(0.01)
        commit = asyncio.create_task(rt.commits.commit("t1", "delete", ["x"]))
        await asyncio.sleep(0.01)
        assert not commit.done()  # commits wait for the snapshot

        async def query():
            async with rt.lock.read():
                return True

        assert await asyncio.wait_for(query(), 2.0)  # a query goes on meanwhile
        written.set()
        await snap
        await commit
        assert order == ["snapshot", "prepare", "apply"]

    asyncio.run(go())
