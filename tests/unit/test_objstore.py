"""Shard snapshots and logs on object storage (``--storage-uri``), through ``file://`` URIs: the
same ``pyarrow.fs`` calls an S3 or GCS URI makes (a ``SubTreeFileSystem`` over the URI's
filesystem). A shard whose local directory is gone comes back from the storage alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from oprag_server import records
from oprag_server.index.objstore import (LocalNewer, LogGapError, MirroredLog, ObjectStore, read_log_objects,
                                         record_key)
from oprag_server.index.wal import WriteAheadLog, encode_record
from oprag_server.shards.protocol import (ApplyRequest, MemoryClearRequest, MemoryLookupRequest, PrepareRequest,
                                          PromoteRequest, ReuseRequest, StageRequest, StatsRequest)
from oprag_server.shards.state import ShardState
from oprag_server.shards.storage import LocalAhead, ShardStorage, copy_current, replica_uri
from oprag_server.startup import check_storage

DIM = 4


def _batch(doc_ids: list[str]):
    n = len(doc_ids)
    texts = [f"tide table {d}" for d in doc_ids]
    vecs = np.random.default_rng(len(doc_ids)).standard_normal((n, DIM)).astype(np.float32)
    return records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in doc_ids], doc_ids=doc_ids, titles=[""] * n, texts=texts, metadata=[{}] * n,
        ordinals=[0] * n, generations=[1] * n, content_hashes=texts, vectors=vecs)


def _commit(s: ShardState, txn: str, seq: int, docs: list[str], committed: set[str]) -> None:
    s.txns.stage(StageRequest(txn, records.to_ipc(_batch(docs))))
    s.txns.prepare(PrepareRequest(txn, seq, "upsert", []))
    committed.add(txn)  # the frontend's commit point
    s.txns.apply(ApplyRequest(txn))


def _promote(s: ShardState, sid: str, q: str) -> None:
    s.memory.promote(PromoteRequest(sid, q, "s", [], [], np.ones(DIM, np.float32), max_turns=10))


def _view(s: ShardState) -> tuple:
    """Everything a reader can see: the stored chunks (with vectors), counts, memory."""
    ids = sorted(s.store.doc_slots)
    vec = s.store.reuse(ReuseRequest(ids)).vectors
    st = s.stats(StatsRequest())
    mem = s.memory.lookup(MemoryLookupRequest(["u1", "u2"], 10)).turns
    return (ids, {k: {h: np.asarray(x).tolist() for h, x in v.items()} for k, v in vec.items()}, st.chunks, st.applied_seq,
            [[t.question for t in ts] for ts in mem])


def _state(d, uri, committed=None) -> ShardState:
    s = ShardState(0, DIM, d, storage=uri)
    s.load(committed if committed is not None else set())
    return s


@pytest.fixture()
def uri(tmp_path):
    return (tmp_path / "bucket" / "oprag").as_uri()  # file:///.../bucket/oprag


def test_object_store_keys_order_atomic_replace_and_probe(tmp_path, uri):
    st = ObjectStore.from_uri(uri)
    st.probe()
    for pos in (10, 2, 1000, 0):
        st.sub("wal").put(record_key(pos), b"x")
    assert st.list("wal") == [f"wal/{record_key(p)}" for p in (0, 2, 10, 1000)]  # key order = position order
    st.put_atomic("CURRENT", b"old")
    st.put_atomic("CURRENT", b"new")
    assert st.get("CURRENT") == b"new" and st.get("missing") is None
    assert not [k for k in st.list() if ".tmp-" in k] and not list((tmp_path / "bucket").rglob("*.tmp-*"))
    st.delete_prefix("wal")
    assert st.list() == ["CURRENT"]


@pytest.mark.parametrize("bad", ["relative/path", "nosuch://bucket/x", "file://host/x", ""])
def test_a_bad_uri_is_a_start_up_error_naming_the_flag(bad):
    with pytest.raises(RuntimeError, match="--storage-uri"):
        check_storage(bad)


def test_the_storage_records_its_layout_and_refuses_another(uri):
    check_storage(uri, 2, 384)
    check_storage(uri, 2, 384)
    with pytest.raises(RuntimeError, match="--storage-uri .*shards = 2.*--shards 2"):
        check_storage(uri, 3, 384)
    with pytest.raises(RuntimeError, match="dim = 384"):
        check_storage(uri, 2, 16)


def test_log_objects_are_read_in_order_and_a_torn_one_is_skipped(tmp_path, uri):
    store = ObjectStore.from_uri(uri).sub("wal")
    log = MirroredLog(tmp_path / "wal.log", store, next_pos=0)
    log.open()
    for i in range(12):
        log.append({"kind": "memory_clear", "session_id": f"s{i}"})
    assert log.puts == 12 and len(store.list()) == 12
    (tmp_path / "bucket" / "oprag" / "wal" / record_key(5)).write_bytes(b"\x40\x00\x00\x00\x01")  # torn
    recs, nxt = read_log_objects(store, 3)
    assert [r["session_id"] for r in recs] == [f"s{i}" for i in range(3, 12) if i != 5] and nxt == 12


def test_a_shard_with_an_empty_directory_comes_back_from_storage(tmp_path, uri):
    committed: set[str] = set()
    a = _state(tmp_path / "node-a", uri)
    _commit(a, "t1", 1, ["d1", "d2"], committed)
    _promote(a, "u1", "q1")
    a.snapshot()
    _commit(a, "t2", 2, ["d3"], committed)
    _promote(a, "u2", "q2")
    a.memory.clear(MemoryClearRequest("u1"))
    a.txns.stage(StageRequest("t3", records.to_ipc(_batch(["d4"]))))
    a.txns.prepare(PrepareRequest("t3", 3, "upsert", []))  # prepared, never committed: must not appear
    want = _view(a)
    b = _state(tmp_path / "node-b", uri, set(committed))  # a new node: nothing local
    assert b.storage.downloaded
    assert _view(b) == want and want[0] == ["d1", "d2", "d3"] and want[4] == [[], ["q2"]]


def test_snapshot_switches_current_last_and_collects_garbage(tmp_path, uri):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    for i in range(3):
        _commit(a, f"t{i}", i + 1, [f"d{i}"], committed)
    st = a.storage.store
    assert len(st.list("wal")) == 3 and json.loads(st.get("CURRENT"))["snapshot"] is None
    a.snapshot()
    cur = json.loads(st.get("CURRENT"))
    assert cur["snapshot"] and cur["wal_from"] == 3
    assert st.list("wal") == []  # covered by the snapshot: deleted after the switch
    _commit(a, "t9", 9, ["d9"], committed)
    a.snapshot()
    cur2 = json.loads(st.get("CURRENT"))
    assert cur2["snapshot"] != cur["snapshot"]
    assert {k.split("/")[1] for k in st.list("snap")} == {cur2["snapshot"]}  # the old snapshot is gone


def test_a_crash_between_upload_and_switch_leaves_the_old_snapshot_readable(tmp_path, uri, monkeypatch):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.snapshot()
    _commit(a, "t2", 2, ["d2"], committed)
    _promote(a, "u2", "q")
    want = _view(a)
    before = a.storage.store.get("CURRENT")

    def crash(key, data, real=a.storage.store.put_atomic):
        if key == "CURRENT":
            raise OSError("node lost")
        real(key, data)

    monkeypatch.setattr(a.storage.store, "put_atomic", crash)
    with pytest.raises(OSError):
        a.snapshot()  # every file of the new snapshot is uploaded, CURRENT is not switched
    st = ObjectStore.from_uri(uri).sub("shard-0")
    assert st.get("CURRENT") == before and len({k.split("/")[1] for k in st.list("snap")}) == 2
    b = _state(tmp_path / "b", uri, set(committed))
    assert _view(b) == want
    b.snapshot()  # the next snapshot collects the orphan
    assert len({k.split("/")[1] for k in st.list("snap")}) == 1


def test_a_local_directory_seeds_empty_storage(tmp_path, uri):
    committed: set[str] = set()
    a = ShardState(0, DIM, tmp_path / "a")
    a.load(set())
    _commit(a, "t1", 1, ["d1"], committed)
    a.snapshot()
    _commit(a, "t2", 2, ["d2"], committed)
    want = _view(a)
    a.txns.wal.close()
    moved = _state(tmp_path / "a", uri, set(committed))  # the same directory, now with a URI
    assert _view(moved) == want
    assert _view(_state(tmp_path / "b", uri, set(committed))) == want


def test_a_replica_copy_and_replica_uris(tmp_path, uri):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1", "d2"], committed)
    a.snapshot()
    r1 = replica_uri(uri, 1)
    assert r1 == uri + "/replica-1" and replica_uri(uri, 0) == uri and replica_uri(None, 3) is None
    ShardStorage(r1, 0).store.put("wal/" + record_key(0), b"stale")
    assert copy_current(r1, uri, 0) == json.loads(a.storage.store.get("CURRENT"))["snapshot"]
    b = _state(tmp_path / "b", r1, set(committed))
    assert _view(b)[:4] == _view(a)[:4]
    shutil.rmtree(tmp_path / "b")


def test_a_replica_catches_up_through_storage_with_its_local_directory_gone(tmp_path, uri):
    import asyncio

    from oprag_server.engine.commit import CommitProtocol
    from oprag_server.engine.rwlock import RWLock
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.shards.inprocess import InProcessTransport
    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards.protocol import Op, SnapshotRequest

    async def main():
        loop = asyncio.get_running_loop()
        pool = ShardPool(1, DIM, tmp_path / "local", transport=InProcessTransport, replicas=2, storage=uri)
        pool.start(loop, committed=set())
        cp = CommitProtocol(pool, CorpusStats(), RWLock())
        cp.open_log(tmp_path / "commits.log")

        async def write(txn, docs):
            await pool.call(0, Op.STAGE, StageRequest(txn, records.to_ipc(_batch(docs))))
            await cp.commit(txn, "upsert")

        rs = pool.clients[0]
        await write("t1", ["a", "b"])
        assert ShardStorage(replica_uri(uri, 1), 0).wal.list()  # replica 1 logs under its own prefix
        rs.reps[1].kill()
        shutil.rmtree(tmp_path / "local" / "replica-1")  # its node is gone
        await write("t2", ["c"])
        await loop.run_in_executor(None, pool.restart, 0, loop, cp.committed_txns())
        assert rs.serving == [True, True]
        assert rs.reps[1].state.storage.downloaded  # from the sibling's snapshot, copied in storage
        await write("t3", ["d"])
        views = [_view(rs.reps[r].state)[:3] for r in range(2)]
        assert views[0] == views[1] and views[0][0] == ["a", "b", "c", "d"]

    asyncio.run(main())


def test_the_commit_log_is_mirrored_and_a_new_frontend_finds_every_commit(tmp_path, uri):
    import asyncio

    from oprag_server.engine.commit import CommitProtocol
    from oprag_server.engine.rwlock import RWLock
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.shards.inprocess import InProcessTransport
    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards.protocol import Op, SnapshotRequest

    async def main():
        loop = asyncio.get_running_loop()
        pool = ShardPool(2, DIM, tmp_path / "a", transport=InProcessTransport, storage=uri)
        cp = CommitProtocol(pool, CorpusStats(), RWLock())
        pool.start(loop, committed=cp.open_log(tmp_path / "a" / "commits.log", uri))
        for t in ("t1", "t2"):
            for s in range(2):
                await pool.call(s, Op.STAGE, StageRequest(t, records.to_ipc(_batch([f"{t}-{s}"]))))
            await cp.commit(t, "upsert")
        commits = ObjectStore.from_uri(uri).sub("commits")
        assert len(commits.list()) == 2
        want = [_view(c.state)[:4] for c in pool.clients]
        # a new frontend node: its data directory and every shard's are empty
        cp2 = CommitProtocol(pool, CorpusStats(), RWLock())
        committed = cp2.open_log(tmp_path / "b" / "commits.log", uri)
        assert committed == {"t1": 1, "t2": 2}
        pool2 = ShardPool(2, DIM, tmp_path / "b", transport=InProcessTransport, storage=uri)
        cp2.recover(r.applied_seq for r in pool2.start(loop, committed=committed))
        assert [_view(c.state)[:4] for c in pool2.clients] == want
        await pool2.broadcast(Op.SNAPSHOT, SnapshotRequest())
        cp2.reset_log()
        assert cp2.committed_txns() == set()  # only the base record is left, in the store too
        assert [r["seq"] for r in cp2.log] == [2] and len(commits.list()) == 1

    asyncio.run(main())


def _flip(p) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))


def _snapshotted(tmp_path, uri, docs: list[str]):
    """A shard under ``tmp_path/n`` on ``uri`` with ``docs`` committed, one session turn and a snapshot:
    ``(shard state, committed ids, shard directory, snapshot name)``."""
    committed: set[str] = set()
    a = _state(tmp_path / "n", uri)
    _commit(a, "t1", 1, docs, committed)
    _promote(a, "u1", "q1")
    a.snapshot()
    shard = tmp_path / "n" / "shard-0"
    return a, committed, shard, (shard / "CURRENT").read_text().strip()


@pytest.mark.parametrize("victim", ["memory.json", "chunk file", "meta.json"])
def test_a_damaged_local_snapshot_is_downloaded_again_from_storage(tmp_path, uri, victim):
    """A local snapshot file damaged on the node (CRC-32 refused) while the storage holds the same snapshot: the start
    sets the local copy aside, loads the storage's copy into a fresh shard, then removes the damaged copy."""
    a, committed, shard, name = _snapshotted(tmp_path, uri, ["d1", "d2"])
    _commit(a, "t2", 2, ["d3"], committed)
    want = _view(a)
    snap = shard / name
    files = {"memory.json": [snap / "memory.json"], "chunk file": sorted(snap.glob("chunks*.arrow")),
             "meta.json": [snap / "meta.json"]}  # (damaged postings are rebuilt from the texts in place)
    assert files[victim], sorted(p.name for p in snap.rglob("*"))
    _flip(files[victim][0])
    b = _state(tmp_path / "n", uri, set(committed))
    assert b.storage.downloaded and _view(b) == want
    assert not (shard / f"damaged-{snap.name}").exists() and (snap / "meta.json").exists()


def test_a_damaged_local_snapshot_whose_storage_copy_is_damaged_too_is_left_as_it_was(tmp_path, uri):
    _, committed, shard, name = _snapshotted(tmp_path, uri, ["d1"])
    _flip(shard / name / "memory.json")
    stored = tmp_path / "bucket" / "oprag" / "shard-0" / "snap" / name / "memory.json"
    _flip(stored)
    local = (shard / name / "memory.json").read_bytes()
    with pytest.raises(RuntimeError, match="starting from the storage's copy .* failed too: .* The local copy is left as it"):
        _state(tmp_path / "n", uri, set(committed))
    assert (shard / name / "memory.json").read_bytes() == local  # the local copy put back, byte for byte
    assert not (shard / f"damaged-{name}").exists() and (shard / "CURRENT").read_text().strip() == name


def test_a_crash_while_the_storage_copy_was_downloaded_leaves_nothing_behind(tmp_path, uri):
    """kill -9 after the damaged local copy was set aside and before the download loaded: the next start downloads
    the storage's copy (the local one is missing) and removes the copy set aside once it has loaded."""
    a, committed, shard, name = _snapshotted(tmp_path, uri, ["d1", "d2"])
    want = _view(a)
    (shard / name).rename(shard / f"damaged-{name}")  # where load_again's crash leaves it
    b = _state(tmp_path / "n", uri, set(committed))
    assert b.storage.downloaded and _view(b) == want
    assert sorted(p.name for p in shard.iterdir() if p.is_dir()) == [name]


def test_a_damaged_local_snapshot_seeding_an_empty_prefix_is_refused_once(tmp_path, uri):
    """trial58b #5: an empty prefix is seeded from the local directory; when its snapshot is damaged, the start stops
    with that file's error, not with a download of the copy it has just uploaded."""
    _, committed, shard, name = _snapshotted(tmp_path, uri, ["d1"])
    _flip(shard / name / "memory.json")
    shutil.rmtree(tmp_path / "bucket")
    with pytest.raises(RuntimeError) as info:
        _state(tmp_path / "n", uri, set(committed))
    assert "memory.json" in str(info.value) and "storage's copy" not in str(info.value)
    assert not (shard / f"damaged-{name}").exists() and (shard / name / "meta.json").exists()
    prefix = tmp_path / "bucket" / "oprag" / "shard-0"
    assert not prefix.exists() or not [p for p in prefix.rglob("*") if p.is_file()]  # nothing uploaded
    memory = shard / name / "memory.json"
    _flip(memory)  # (flipped back: the local directory repaired)
    b = _state(tmp_path / "n", uri, set(committed))
    assert b.storage.seeded and (prefix / "snap" / name / "memory.json").read_bytes() == memory.read_bytes()
    assert ShardStorage(uri, 0).current() == {"snapshot": name, "wal_from": 0}


def test_a_seed_cut_short_is_seeded_again_and_the_local_copy_kept(tmp_path, uri, capfd):
    """trial59 F1: kill -9 while the first start seeded an empty prefix left part of the snapshot there and no
    CURRENT; the next start took the prefix as the store's ("holds no snapshot") and deleted the local snapshot, the
    only full copy. A prefix without CURRENT is now seeded again from the local directory, its leftovers deleted."""
    a, committed, shard, name = _snapshotted(tmp_path, uri, ["d1", "d2"])
    _commit(a, "t2", 2, ["d3"], committed)  # (a record in the local log after the snapshot)
    want = _view(a)
    a.txns.wal.close()
    prefix = tmp_path / "bucket" / "oprag" / "shard-0"
    shutil.rmtree(prefix)
    part = sorted(p for p in (shard / name).rglob("*") if p.is_file())[0]
    store = ShardStorage(uri, 0).store
    store.put(f"snap/{name}/{part.relative_to(shard / name).as_posix()}", part.read_bytes()[:5])  # cut short
    store.put("snap/snap-000000000000-1/meta.json", b"{")  # and an object of no snapshot of this shard
    records = [encode_record(r) for r in WriteAheadLog(shard / "wal.log")]
    first = records[0]
    store.put(f"wal/{record_key(0)}", first)  # the seed's copy of the local log's first record
    store.put(f"wal/{record_key(len(records) - 1)}", records[-1][:7])  # and a put cut short (trial59b F1)
    capfd.readouterr()
    b = _state(tmp_path / "n", uri, set(committed))
    assert _view(b) == want and b.storage.seeded and (shard / name / "meta.json").exists()
    assert ShardStorage(uri, 0).current() == {"snapshot": name, "wal_from": 0}
    assert (prefix / "snap" / name / part.relative_to(shard / name)).read_bytes() == part.read_bytes()
    assert store.get(f"wal/{record_key(0)}") == first
    assert not (prefix / "snap" / "snap-000000000000-1").exists()
    assert "no CURRENT (a seeding start cut short)" in capfd.readouterr().err
    c = _state(tmp_path / "m", uri, set(committed))  # a new node's empty directory, from the seeded prefix
    assert c.storage.downloaded and _view(c) == want


def test_log_objects_without_current_that_the_local_log_lacks_are_not_deleted(tmp_path, uri):
    """A prefix without CURRENT whose log objects differ from the local log's records may hold writes the local
    directory lacks (a prefix that lost its CURRENT, trial57 #4): the start refuses, and both stay as they were."""
    a, committed, shard, name = _snapshotted(tmp_path, uri, ["d1"])
    _commit(a, "t2", 2, ["d2"], committed)
    a.txns.wal.close()
    prefix = tmp_path / "bucket" / "oprag" / "shard-0"
    shutil.rmtree(prefix)
    store = ShardStorage(uri, 0).store
    store.put(f"wal/{record_key(1)}", b"another writer's record")
    with pytest.raises(LogGapError, match="still holds snapshot .*, left as it is"):
        _state(tmp_path / "n", uri, set(committed))
    assert store.get(f"wal/{record_key(1)}") == b"another writer's record" and store.get("CURRENT") is None
    assert (shard / name / "meta.json").exists() and (shard / "CURRENT").read_text().strip() == name


def test_a_local_snapshot_newer_than_the_storage_is_never_replaced(tmp_path, uri):
    """trial59b F3: an empty directory started on the storage after a seeding start was cut short seeded empty shards
    (CURRENT naming no snapshot); the original directory's next start then replaced its snapshot by that: 5,300
    acknowledged documents gone, the server READY with 0. A local directory holding writes the storage lacks is now
    refused before anything local changes, saying how to go on either way."""
    a, committed, shard, name = _snapshotted(tmp_path, uri, ["d1", "d2"])
    want = _view(a)
    a.txns.wal.close()
    prefix = tmp_path / "bucket" / "oprag" / "shard-0"
    shutil.rmtree(prefix)
    commits = ObjectStore.from_uri(uri).sub("commits")  # the frontend's commit log, reset at sequence 1 (trial59c)
    commits.put(record_key(0), encode_record({"txn": "", "seq": 1, "kind": "base"}))
    e = _state(tmp_path / "nothing", uri, set())  # the commit log reached 1: an empty shard is not seeded
    e.txns.wal.close()
    assert ShardStorage(uri, 0).current() is None
    commits.delete(commits.list())
    e = _state(tmp_path / "empty", uri, set())  # (a new deployment: the empty shard is seeded)
    e.txns.wal.close()
    assert ShardStorage(uri, 0).current() == {"snapshot": None, "wal_from": 0}
    before = sorted(p.relative_to(shard) for p in shard.rglob("*"))
    with pytest.raises(LocalAhead, match=rf"holds snapshot {name} and writes up to sequence 1, newer than anything the "
                                         r"storage .* \(up to 0, snapshot \(none\)\): the local copy is not replaced"):
        _state(tmp_path / "n", uri, set(committed))
    assert sorted(p.relative_to(shard) for p in shard.rglob("*")) == before
    shutil.rmtree(prefix)  # the message's way on: the storage's prefix moved aside
    b = _state(tmp_path / "n", uri, set(committed))
    assert b.storage.seeded and _view(b) == want


def test_a_commit_log_seeding_cut_short_is_seeded_again_from_the_local_file(tmp_path, uri):
    """trial59b F2: kill -9 while the first start put the local commit log's records into an empty store left part of
    them there; the next start took the store's part as the log (the local file rewritten from it: 301 -> 149 records)
    and the shards refused. The seeding now puts a SEEDING object first and deletes it last; a start that finds it
    seeds the store again from the local file, and one whose file holds nothing (another data directory) refuses."""
    from oprag_server.index.objstore import SEEDING, open_mirrored

    path = tmp_path / "a" / "commits.log"
    path.parent.mkdir()
    log = WriteAheadLog(path)
    recs = [{"txn": f"t{i}", "seq": i, "kind": "commit"} for i in range(1, 8)]
    log.reset(recs)
    log.close()
    local = path.read_bytes()
    commits = ObjectStore.from_uri(uri).sub("commits")
    open_mirrored(path, commits).close()  # a seeding that finished: no marker left
    assert commits.get(SEEDING) is None and len(commits.list()) == len(recs)
    commits.delete(commits.list())
    commits.put(SEEDING, b"")  # the cut-short seeding: the marker, three records, a fourth put cut short
    for pos in range(3):
        commits.put(record_key(pos), encode_record(recs[pos]))
    commits.put(record_key(3), encode_record(recs[3])[:9])
    with pytest.raises(RuntimeError, match="seeding from another data directory was cut short"):
        open_mirrored(tmp_path / "empty" / "commits.log", commits)  # a fresh directory: refused, nothing changed
    assert len(commits.list()) == 5
    m = open_mirrored(path, commits)
    m.close()
    assert path.read_bytes() == local and commits.get(SEEDING) is None
    assert read_log_objects(commits, None) == (recs, len(recs))


def test_a_store_log_emptied_since_is_not_called_lost(tmp_path, uri):
    """trial59b F5: a local commit log of 7 records beside a store whose log another start emptied after every shard
    snapshotted (one base record at the same sequence number) was reported as "the store lost its newest objects".
    Only a store log that does not reach the file's highest sequence number is."""
    import logging

    from oprag_server.index.objstore import local_extra

    path = tmp_path / "commits.log"
    log = WriteAheadLog(path)
    log.reset([{"txn": f"t{i}", "seq": i, "kind": "commit"} for i in range(1, 8)])
    log.close()
    level, line = local_extra(path, [{"txn": "", "seq": 7, "kind": "base"}], uri)
    assert level == logging.INFO and "emptied since" in line and "lost" not in line
    with pytest.raises(LocalNewer, match=r"holds 7 intact records, the store .* 1 .*the file holds writes the store "
                                         r"lacks \(it was written without --storage-uri since"):
        local_extra(path, [{"txn": "t1", "seq": 1, "kind": "commit"}], uri)  # (trial59c N1)


def test_a_directory_served_without_the_storage_since_is_not_cut_down_to_it(tmp_path, uri):
    """trial59c N1: a data directory seeded onto the storage, then served without --storage-uri (300 acknowledged
    documents in its logs, same snapshot), then started with it again: its logs were cut down to the store's copy and
    the server was READY without those documents. The start is now refused, nothing changed."""
    from oprag_server.shards.state import ShardState

    a, committed, shard, name = _snapshotted(tmp_path, uri, ["d1"])
    a.txns.wal.close()
    b = ShardState(0, DIM, tmp_path / "n")  # the same directory without --storage-uri
    b.load(set(committed))
    _commit(b, "t2", 2, ["d2"], committed)
    _commit(b, "t3", 3, ["d3"], committed)
    b.txns.wal.close()
    local = (shard / "wal.log").read_bytes()
    with pytest.raises(LocalNewer, match="the file holds writes the store lacks"):
        _state(tmp_path / "n", uri, set(committed))
    assert (shard / "wal.log").read_bytes() == local and (shard / "CURRENT").read_text().strip() == name


def test_a_damaged_storage_copy_downloaded_by_a_new_node_is_named_as_the_storage_s(tmp_path, uri):
    """trial59b F8: the error named the just-downloaded local file and said the chunks had no other copy, while the
    storage's object was the damaged one and the original directory held the snapshot whole."""
    _, committed, shard, name = _snapshotted(tmp_path, uri, ["d1"])
    _flip(tmp_path / "bucket" / "oprag" / "shard-0" / "snap" / name / "memory.json")
    with pytest.raises(RuntimeError, match=rf"the storage's copy of snapshot {name}, just downloaded from .*"
                                           r"cannot be loaded: .*memory.json.* The storage's objects are damaged"):
        _state(tmp_path / "m", uri, set(committed))
    assert (shard / name / "meta.json").exists()


def test_a_local_log_alone_newer_than_the_storage_is_not_replaced(tmp_path, uri):
    """The same guards for a shard directory holding no snapshot, only log records the storage lacks (served without
    --storage-uri since): with the storage naming no snapshot either, two records more refuse (one more is what a
    crash mid-put leaves); with the storage's snapshot below the log's sequence numbers, any record does. Refused
    with its log byte for byte as it was."""
    a = _state(tmp_path / "n", uri)  # seeded: an empty shard, CURRENT naming no snapshot
    a.txns.wal.close()
    b = ShardState(0, DIM, tmp_path / "n")  # then served without the storage
    committed: set[str] = set()
    b.load(set())
    _commit(b, "t1", 1, ["d1"], committed)
    _commit(b, "t2", 2, ["d2"], committed)
    b.txns.wal.close()
    shard = tmp_path / "n" / "shard-0"
    local = (shard / "wal.log").read_bytes()
    with pytest.raises(LocalNewer, match="the file holds writes the store lacks"):
        _state(tmp_path / "n", uri, set(committed))
    assert (shard / "wal.log").read_bytes() == local
    other = uri.replace("/bucket/", "/bucket2/")
    s, _, _, name = _snapshotted(tmp_path / "other", other, ["x1"])  # another storage, its snapshot at seq 1
    s.txns.wal.close()
    with pytest.raises(LocalAhead, match=rf"holds snapshot \(none\) and writes up to sequence 2, newer than anything "
                                         rf"the storage .* \(up to 1, snapshot {name}\)"):
        _state(tmp_path / "n", other, set(committed))
    assert (shard / "wal.log").read_bytes() == local
