"""A shard snapshot's ``chunks.arrow`` is written as record batches of bounded size, each built,
written and dropped (issue 13, snap18: one batch of every row was a ~0.85 GB copy of a 1M-chunk
shard's texts at the snapshot's memory peak), and served back from the mapped file (one part, a chunk
per batch, read from the Arrow buffers of every chunk); a snapshot
whose stored fields did not change since the last one (the merge-only snapshot of an unsaved BM25
segment) links the previous file instead of writing it. Round trips with deletes and replaces, a
restart, a kill in the middle of the write, and the link surviving the sweep of its first
directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pyarrow as pa
import pytest
from test_snapshot_beside import D, _ack_t1, _assert_recovered, _batch, _seed

from oprag_server.config import DenseConfig
from oprag_server.shards import chunks as chunkstore
from oprag_server.shards import snapshot as snapshots
from oprag_server.shards import worker
from oprag_server.shards.protocol import FetchRequest, Op, SnapshotRequest
from oprag_server.shards.state import ShardState


def _ingest(st: ShardState) -> None:
    """Chunks d0..d299 in three batches, d10..d39 deleted, d100..d149 replaced (generation 2)."""
    for lo in (0, 100, 200):
        st.store.upsert(pa.Table.from_batches([_batch(lo, lo + 100)]), lo + 1)
    st.store.delete([f"d{i}" for i in range(10, 40)], 400)
    new = _batch(100, 150)
    new = new.set_column(new.schema.get_field_index("generation"), "generation", pa.array([2] * 50, pa.uint64()))
    new = new.set_column(new.schema.get_field_index("text"), "text", pa.array([f"new {i}" for i in range(100, 150)]))
    st.store.upsert(pa.Table.from_batches([new]), 401)


def _by_id(st: ShardState) -> dict:
    slots = st.store.fields.slots()
    recs = st.store.fields.records(slots)
    return {r.chunk_id: (r.doc_id, r.title, r.text, r.metadata, r.ordinal, r.generation, r.content_hash) for r in recs}


def _fetch_all(st: ShardState) -> list:
    slots = st.store.fields.slots()
    order = np.random.default_rng(3).permutation(slots)  # rows of every part, in no order
    rep = st.search.fetch(FetchRequest(order.tolist()))
    return sorted(zip(rep.doc_ids, rep.texts, rep.titles, rep.metadata))


def test_a_multi_batch_snapshot_round_trips_with_deletes_replaces_and_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(chunkstore, "BATCH_ROWS", 64)
    st = ShardState(0, D, tmp_path)
    st.load(set())
    _ingest(st)
    want, fetched = _by_id(st), _fetch_all(st)
    assert len(want) == 270 and want["d120#0"][2] == "new 120" and "d20#0" not in want
    assert st.snapshot().chunks == 270
    d = tmp_path / "shard-0"
    snap = d / (d / "CURRENT").read_text().strip()
    sizes = [b.num_rows for b in pa.ipc.open_stream(pa.memory_map(str(snap / "chunks.arrow")))]
    assert sizes == [64, 64, 64, 64, 14]  # bounded batches, slot order
    assert len(st.store.fields._parts) == 1 and st.store.fields._parts[0].column("text").num_chunks == 5
    assert _by_id(st) == want and _fetch_all(st) == fetched
    slots = st.store.fields.slots()
    assert st.store.fields.hit_utf8(slots[[200, 3, 130, 64, 0]]) is not None  # rows of four batches, from the buffers
    # more writes on the mapped parts, a second snapshot, then a restart from it
    st.store.delete(["d0", "d299"], 500)
    st.store.upsert(pa.Table.from_batches([_batch(300, 330)]), 501)
    want = _by_id(st)
    st.snapshot()
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path)
    again.load(set())
    assert _by_id(again) == want and again.store.fields._parts[0].column("text").num_chunks == 5
    assert _fetch_all(again) == _fetch_all(st)


def test_a_mapped_snapshot_is_written_out_in_slices_without_a_copy(tmp_path, monkeypatch):
    """The batches of fields served from a mapped file are slices of it: the writer's Arrow
    allocations stay far below the texts (base: one combined copy of every column)."""
    monkeypatch.setattr(chunkstore, "BATCH_ROWS", 1000)
    st = ShardState(0, D, tmp_path)
    st.load(set())
    big = _batch(0, 3000)
    big = big.set_column(big.schema.get_field_index("text"), "text", pa.array([f"{i} " + "t" * 2000 for i in range(3000)]))
    st.store.upsert(pa.Table.from_batches([big]), 1)
    st.snapshot()  # now served from its chunks.arrow, mapped
    pool = pa.default_memory_pool()
    before, most = pool.bytes_allocated(), 0
    for b in st.store.batches(vectors=False):
        most = max(most, pool.bytes_allocated() - before)
        assert b.num_rows == 1000
    assert most < 1_000_000  # 6 MB of texts, none copied


@pytest.mark.parametrize("kind", ["flat", "hnsw"])  # (hnsw: chunks.arrow without its vector column)
def test_a_snapshot_without_field_changes_links_the_file_and_the_sweep_keeps_it(tmp_path, kind):
    dense = DenseConfig(kind=kind)
    st = ShardState(0, D, tmp_path, dense=dense)
    st.load(set())
    _ingest(st)
    want = _by_id(st)
    st.snapshot()
    d = tmp_path / "shard-0"
    first = d / (d / "CURRENT").read_text().strip()
    ino = (first / "chunks.arrow").stat().st_ino
    st.store.postings.merge()  # (a snapshot that only the BM25 segment needs)
    assert snapshots.write(d, st.store, st.memory, st.txns).chunks == 270
    second = d / (d / "CURRENT").read_text().strip()
    assert second != first and not first.exists()  # swept
    f = second / "chunks.arrow"
    assert f.stat().st_ino == ino and f.stat().st_nlink == 1  # the same file, alive after the sweep
    assert _by_id(st) == want
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path, dense=dense)
    again.load(set())
    assert _by_id(again) == want
    snapshots.write(d, again.store, again.memory, again.txns)  # a restart's fields are the file's rows too
    third = d / (d / "CURRENT").read_text().strip()
    assert (third / "chunks.arrow").stat().st_ino == ino
    again.store.delete(["d0"], 900)  # a write: the next snapshot writes a new file
    snapshots.write(d, again.store, again.memory, again.txns)
    fourth = d / (d / "CURRENT").read_text().strip()
    assert (fourth / "chunks.arrow").stat().st_ino != ino and len(again.store.fields) == 269


def test_a_crash_after_the_link_before_current_leaves_the_live_file_whole(tmp_path, monkeypatch):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    _ingest(st)
    want = _by_id(st)
    st.snapshot()
    d = tmp_path / "shard-0"
    live = (d / "CURRENT").read_text().strip()
    real = snapshots.fsync_write

    def crash(path, data):
        if path.name == "CURRENT":
            raise SystemExit("killed before CURRENT switched")
        return real(path, data)

    monkeypatch.setattr(snapshots, "fsync_write", crash)
    with pytest.raises(SystemExit):
        snapshots.write(d, st.store, st.memory, st.txns)
    monkeypatch.undo()
    left = [p for p in d.glob("snap-*") if p.name != live]
    assert len(left) == 1 and (left[0] / "chunks.arrow").stat().st_nlink == 2  # the link beside the live file
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path)
    again.load(set())  # sweeps the cut-off directory
    assert [p.name for p in d.glob("snap-*")] == [live] and (d / live / "chunks.arrow").stat().st_nlink == 1
    assert _by_id(again) == want


def test_link_falls_back_to_a_copy(tmp_path, monkeypatch):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    _ingest(st)
    st.snapshot()
    d = tmp_path / "shard-0"

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    snapshots.write(d, st.store, st.memory, st.txns)
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path)
    again.load(set())
    assert _by_id(again) == _by_id(st)


def _stall_mid_chunks(marker: str) -> None:
    """(In a forked child) a snapshot's writer stops after its second record batch of
    ``chunks.arrow`` (touching ``marker``), until the process is killed."""
    real = chunkstore.ChunkStore.batches

    def slow(self, vectors=True, rows=None, start=0):
        for i, b in enumerate(real(self, vectors, 16, start)):
            if i == 2:
                open(marker, "w").close()
                time.sleep(3600)  # killed here
            yield b

    chunkstore.ChunkStore.batches = slow


def _serve_stalled(tmp_path, conn, marker):
    _stall_mid_chunks(marker)
    worker.run(0, conn, D, str(tmp_path), False, set())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_shard_killed_in_the_middle_of_the_chunks_file_keeps_everything_acknowledged(tmp_path):
    _seed(tmp_path)
    live = (tmp_path / "shard-0" / "CURRENT").read_text()
    marker = str(tmp_path / "mid-write")
    front, back = mp.get_context("fork").Pipe(duplex=True)
    proc = mp.get_context("fork").Process(target=_serve_stalled, args=(tmp_path, back, marker), daemon=True)
    proc.start()
    try:
        _ack_t1(front)
        front.send((4, Op.SNAPSHOT, SnapshotRequest()))
        deadline = time.monotonic() + 30
        while not os.path.exists(marker):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    _assert_recovered(tmp_path, live)


def test_the_pool_snapshots_one_shard_at_a_time_and_stops_at_a_failure():
    """The frontend's snapshot asks the shards one after another (each 1M-chunk shard's snapshot
    starts with a BM25 merge of ~1.8 GB transient memory; all at once made the tree's peak)."""
    import asyncio

    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards.transport import ShardError

    state = {"now": 0, "most": 0, "asked": []}

    class Client:
        def __init__(self, i, fail=False):
            self.i, self.fail = i, fail

        async def call(self, op, req):
            assert op is Op.SNAPSHOT
            state["asked"].append(self.i)
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            await asyncio.sleep(0.01)
            state["now"] -= 1
            if self.fail:
                raise ShardError("disk full")

    pool = ShardPool.__new__(ShardPool)
    pool.n, pool.clients, pool.fenced = 3, [Client(0), Client(1), Client(2)], lambda: None
    asyncio.run(pool.snapshot())
    assert state["most"] == 1 and state["asked"] == [0, 1, 2]
    state["asked"].clear()
    pool.clients[1].fail = True
    with pytest.raises(ShardError):
        asyncio.run(pool.snapshot())
    assert state["asked"] == [0, 1]  # shard 2 not asked after shard 1 failed
