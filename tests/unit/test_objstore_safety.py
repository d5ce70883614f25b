"""``--storage-uri`` against misuse: two servers on one storage (owner lease, write-if-absent log
objects), lost log objects and snapshots (refused, never served silently), a read-only store
(a clear UNAVAILABLE), refused starts that leave nothing local, odd URIs. ``file://`` stores."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import types
from pathlib import Path

import grpc
import numpy as np
import pytest

from oprag_server.config import ServerConfig
from oprag_server.engine.commit import CommitProtocol
from oprag_server.index.lease import LeaseHeld, OwnerLease
from oprag_server.index.objstore import (LocalNewer, LogGapError, MirroredLog, ObjectStore, StorageWriteError,
                                         record_key)
from oprag_server.service.interceptors import status_for
from oprag_server.shards.protocol import MemoryClearRequest, PromoteRequest
from oprag_server.shards.transport import StorageUnavailable
from oprag_server.startup import acquire_storage, check_storage
from oprag_server.supervision import ShardSupervisor

from test_objstore import DIM, _commit, _state, uri  # noqa: F401 - the fixture


def test_a_second_server_is_refused_naming_the_holder_and_a_takeover_fences_the_first(uri):
    a, b = OwnerLease(ObjectStore.from_uri(uri)), OwnerLease(ObjectStore.from_uri(uri))
    assert a.acquire() is None and a.renew() == "ok"
    with pytest.raises(LeaseHeld, match=rf"in use by server {a.me['id']} on host .* \(pid \d+\).*--storage-takeover"):
        b.acquire()
    assert b.acquire(takeover=True)["id"] == a.me["id"]
    assert a.renew() == "taken" and "no longer owns" in a.fenced and b.renew() == "ok"
    b.store.delete(["owner"])  # the storage wiped
    assert b.renew() == "gone" and b.read()["id"] == b.me["id"]


def test_the_lease_is_renewed_while_the_start_blocks(uri):
    """trial59 F5: the heartbeat was written once at acquire and renewed only once the shards had loaded, so a long
    start (a seed, a download, a replay) looked like a dead holder's after ttl_s. ``renewing`` renews it from a thread
    for the block's length, stops with it, and stops renewing once fenced."""
    import time

    from oprag_server.index.lease import renewing

    a = OwnerLease(ObjectStore.from_uri(uri), renew_s=0.02)
    a.acquire()
    first = a.read()["heartbeat"]
    with renewing(a):
        time.sleep(0.3)
        during = a.read()["heartbeat"]
    after = a.read()["heartbeat"]
    time.sleep(0.1)
    assert first < during <= after == a.read()["heartbeat"]  # renewed inside, not after
    b = OwnerLease(ObjectStore.from_uri(uri))
    with renewing(a):
        b.acquire(takeover=True)
        time.sleep(0.2)
    assert a.fenced and a.read()["id"] == b.me["id"]  # fenced: renews nothing over the new holder
    with renewing(None):
        pass


def test_a_lease_of_a_killed_process_not_yet_reaped_is_taken_at_once(uri):
    """trial59b F9: a holder killed on this host but not yet reaped (a zombie) still answered ``kill(pid, 0)``, so a
    restart right after a kill -9 was refused as if that server were running."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][:1] != "Z":  # exited, not reaped: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        a = OwnerLease(ObjectStore.from_uri(uri))
        a.me["pid"] = child.pid  # the lease of the zombie's server
        a.acquire()
        assert OwnerLease(ObjectStore.from_uri(uri)).acquire()["pid"] == child.pid  # taken at once
    finally:
        child.wait()


def test_an_expired_lease_is_taken_without_takeover(uri):
    a, b = OwnerLease(ObjectStore.from_uri(uri), ttl_s=0.0), OwnerLease(ObjectStore.from_uri(uri), ttl_s=0.0)
    a.acquire()
    assert b.acquire()["id"] == a.me["id"]


def test_a_lease_of_a_gone_process_on_this_host_is_taken_live_one_refused(uri):
    import subprocess
    import sys
    store = ObjectStore.from_uri(uri)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held = OwnerLease(store)
        held.me = {**held.me, "pid": other.pid}  # a live server process of this host
        held.acquire()
        with pytest.raises(LeaseHeld, match="is in use by"):
            OwnerLease(store).acquire()
    finally:
        other.kill()
        other.wait()
    # the holder was SIGKILLed: its lease is stale at once, no --storage-takeover needed
    assert OwnerLease(store).acquire()["pid"] == other.pid


def test_a_fenced_server_refuses_writes_with_a_clear_unavailable(uri):
    cp = CommitProtocol(pool=None, stats=None, lock=None)
    cp.lease = types.SimpleNamespace(fenced="this server no longer owns --storage-uri X")
    with pytest.raises(StorageUnavailable) as e:
        asyncio.run(cp.commit("t", "upsert"))
    assert status_for(e.value, "Ingest") == (grpc.StatusCode.UNAVAILABLE, "this server no longer owns --storage-uri X", ())


def test_a_log_object_is_never_overwritten(tmp_path, uri):
    store = ObjectStore.from_uri(uri).sub("wal")
    a = MirroredLog(tmp_path / "a.log", store, next_pos=0)
    b = MirroredLog(tmp_path / "b.log", store, next_pos=0)  # a second server at the same position
    a.open(), b.open()
    a.append({"kind": "memory_clear", "session_id": "a"})
    with pytest.raises(StorageWriteError, match="object storage write failed: .*already exists.*nothing was stored"):
        b.append({"kind": "memory_clear", "session_id": "b"})
    assert store.get(record_key(0)) == ObjectStore.from_uri(uri).sub("wal").get(record_key(0))
    from oprag_server.index.objstore import read_log_objects
    assert [r["session_id"] for r in read_log_objects(store)[0]] == ["a"] and b.pos == 0


@pytest.mark.parametrize("how", ["short write", "ENOSPC"])
def test_a_put_the_full_disk_cut_leaves_no_object_and_the_position_takes_the_next_write(tmp_path, uri, monkeypatch,
                                                                                         how):
    """trial57: a full store disk cut a log object's write (a short write, or ENOSPC); the half-written object stayed,
    so every later write at that position failed "already exists (is another server writing to this storage?)", also
    once space was freed: writes never came back. A short write was also taken as a whole object."""
    import errno
    import os

    from oprag_server.index import objstore

    store = ObjectStore.from_uri(uri).sub("wal")
    log = MirroredLog(tmp_path / "a.log", store, next_pos=0)
    log.open()
    real = os.write

    def full(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".rec"):  # (the local log's disk has room)
            return real(fd, data)
        if how == "short write":  # the disk takes 10 bytes, then nothing
            return real(fd, bytes(data[:10])) if len(data) > 10 else (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(objstore.os, "write", full)
    with pytest.raises(StorageWriteError, match=r"00000000000000000000\.rec: .*(No space|full)"):
        log.append({"kind": "memory_clear", "session_id": "a"})
    assert store.get(record_key(0)) is None  # (nothing left at the position)
    monkeypatch.setattr(objstore.os, "write", real)  # space freed
    log.open()  # (the local append was cut back; a new open, as a restart)
    log.append({"kind": "memory_clear", "session_id": "b"})
    from oprag_server.index.objstore import read_log_objects
    assert [r["session_id"] for r in read_log_objects(store)[0]] == ["b"]


def test_a_storage_write_failure_is_unavailable_with_its_own_message_logged_once(caplog):
    cp = CommitProtocol(pool=None, stats=None, lock=None)
    err = RuntimeError("shard 1: StorageWriteError: object storage write failed: file:///x/wal/1.rec: "
                       "read-only file system; nothing was stored")
    with caplog.at_level(logging.ERROR, "oprag"):
        for _ in range(3):
            with pytest.raises(StorageUnavailable) as e:
                cp._storage_failed(err)
    assert str(e.value).startswith("object storage write failed: ") and "being restarted" not in str(e.value)
    assert status_for(e.value, "Ingest")[0] == grpc.StatusCode.UNAVAILABLE
    assert len([r for r in caplog.records if "object storage write failed" in r.getMessage()]) == 1
    cp._storage_failed(RuntimeError("shard 0 died"))  # not a storage failure: left to the caller


def test_a_gap_in_the_log_objects_is_refused_naming_the_positions(tmp_path, uri):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    for i in range(4):
        _commit(a, f"t{i}", i + 1, [f"d{i}"], committed)
    a.storage.wal.delete([record_key(1), record_key(2)])
    with pytest.raises(LogGapError, match=r"log objects 1-2 are missing.*from position 0.*to 3"):
        _state(tmp_path / "b", uri, set(committed))


def test_a_log_without_current_that_starts_after_position_0_is_refused(tmp_path, uri):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.snapshot()  # CURRENT -> snapshot, wal_from 1
    _commit(a, "t2", 2, ["d2"], committed)
    a.storage.store.delete(["CURRENT"] + a.storage.store.list("snap"))  # wiped except the newest log object
    with pytest.raises(RuntimeError, match="holds 1 objects but no CURRENT: .* move the storage's prefix aside"):
        _state(tmp_path / "b", uri, set(committed))  # (an empty directory: trial59b F4)
    with pytest.raises(LogGapError, match="log objects 0 are missing"):
        _state(tmp_path / "a", uri, set(committed))  # (the directory that holds the shard)


def test_a_wiped_store_is_re_established_by_the_next_snapshot(tmp_path, uri, caplog):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.storage.store.delete_prefix("")
    _commit(a, "t2", 2, ["d2"], committed)
    with caplog.at_level(logging.ERROR, "oprag"):
        a.snapshot()
    assert any("CURRENT is gone" in r.getMessage() for r in caplog.records)
    b = _state(tmp_path / "b", uri, set(committed))
    assert sorted(b.store.doc_slots) == ["d1", "d2"]


def test_current_naming_a_missing_snapshot_says_so(tmp_path, uri):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.snapshot()
    name = json.loads(a.storage.store.get("CURRENT"))["snapshot"]
    a.storage.store.delete_prefix("snap")
    with pytest.raises(RuntimeError, match=rf"CURRENT names snapshot {name}, which is not in the store"):
        _state(tmp_path / "b", uri, set(committed))


def test_failed_restarts_back_off_exponentially_with_a_cap(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("oprag_server.supervision.time.monotonic", lambda: now[0])
    tries = []

    async def restart(i):
        tries.append(now[0])
        raise RuntimeError("CURRENT names snapshot X, which is not in the store")

    async def hset(*a):
        pass

    pool = types.SimpleNamespace(n=2, down_shards=lambda: [1])
    metrics = types.SimpleNamespace(shards_up=types.SimpleNamespace(set=lambda n: None))
    sup = ShardSupervisor(pool, restart, types.SimpleNamespace(set=hset), ("",), metrics, backoff=(1.0, 4.0))

    async def run():
        for _ in range(400):
            await sup.check()
            now[0] += 0.25

    asyncio.run(run())
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:4] == [1.0, 2.0, 4.0, 4.0] and max(gaps) == 4.0


def test_a_replaced_local_snapshot_is_logged(tmp_path, uri, capfd):
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.snapshot()
    (tmp_path / "a" / "shard-0" / "CURRENT").write_text("snap-000000000000-1")  # a local corpus of its own
    (tmp_path / "a" / "shard-0" / "snap-000000000000-1").mkdir()
    capfd.readouterr()
    _state(tmp_path / "a", uri, set(committed))
    err = capfd.readouterr().err  # (the shard's own WARNING line, not a bare one: trial59b F7)
    assert "WARNING shard 0: shard directory" in err and "holds snapshot snap-000000000000-1" in err, err
    assert "replacing the local copy" in err


def test_a_refused_start_writes_nothing_local(tmp_path, uri):
    from oprag_server.app import Runtime

    check_storage(uri, 2, 4)
    cfg = ServerConfig(data_dir=tmp_path / "data", storage_uri=uri, shards=3)
    rt = Runtime(cfg, types.SimpleNamespace(dim=4, name="fake"), None)
    with pytest.raises(RuntimeError, match="--shards 2"):
        rt.start_shards(None)
    assert not (tmp_path / "data" / "oprag.json").exists()
    assert OwnerLease(ObjectStore.from_uri(uri)).read() is None  # refused before taking the lease
    cfg2 = ServerConfig(data_dir=tmp_path / "data", storage_uri=uri, shards=2)
    lease = acquire_storage(cfg2, 4)
    assert lease.read()["id"] == lease.me["id"]


@pytest.mark.parametrize("bad,want", [("file:///", "filesystem root"), ("/", "filesystem root"),
                                      ("file:///tmp/a b", "%20")])
def test_odd_uris_are_refused_clearly(bad, want):
    with pytest.raises(RuntimeError, match=want):
        check_storage(bad)


def test_a_bare_absolute_path_and_a_percent_encoded_space_work(tmp_path):
    d = tmp_path / "a b"
    check_storage(str(d), 1, 4)
    check_storage(d.as_uri(), 1, 4)  # file:///.../a%20b
    assert json.loads((d / "oprag.json").read_text())["shards"] == 1


def test_a_shard_missing_tail_records_the_commit_log_holds_is_refused(tmp_path, uri):
    from oprag_server.shards.state import ShardState

    cp = CommitProtocol(pool=None, stats=None, lock=None)
    committed = set(cp.open_log(tmp_path / "commits.log", uri))
    s0, s1 = (ShardState(i, 4, tmp_path / "a", storage=uri) for i in (0, 1))
    for s in (s0, s1):
        s.load(committed)
    for s in (s0, s1):  # one transaction, prepared on both shards, committed, applied
        _commit(s, "t1", 1, [f"d{s.shard_id}"], committed)
    cp.log.append({"txn": "t1", "seq": 1})
    s1.storage.wal.delete(s1.storage.wal.list())  # shard 1's prepare record is lost
    got = {}
    for i in (0, 1):
        s = ShardState(i, 4, tmp_path / "b", storage=uri)
        s.load(cp.committed_txns())
        got[i] = s.store.applied_seq
    assert got == {0: 1, 1: 0}
    with pytest.raises(RuntimeError, match=r"shard 1 recovered up to sequence 0, but the commit log \(.*commits\) "
                                           r"holds committed transactions up to 1"):
        cp.check_recovered(got)
    cp.check_recovered({0: 1, 1: 1})
    # a restart while commits go on: shard 1 was given {t1} to replay; t2, committed meanwhile
    # (a replica catching up gets it from its backlog), does not make it "behind"
    cp.log.append({"txn": "t2", "seq": 2})
    cp.check_recovered({1: 1}, committed={"t1"})
    with pytest.raises(RuntimeError, match="shard 1 recovered up to sequence 1"):
        cp.check_recovered({1: 1})
    with pytest.raises(RuntimeError, match="shard 1 recovered up to sequence 0"):
        cp.check_recovered({1: 0}, committed={"t1"})


def test_a_restarted_shard_that_lost_records_is_stopped_again():
    from oprag_server.supervision import restart_shard

    killed = []
    client = types.SimpleNamespace(kill=lambda: killed.append(1))
    pool = types.SimpleNamespace(restart=lambda i, loop, c: types.SimpleNamespace(applied_seq=0), clients=[client])

    def check(applied, committed):
        raise RuntimeError(f"behind: {applied}")

    with pytest.raises(RuntimeError, match=r"behind: \{0: 0\}"):
        asyncio.run(restart_shard(pool, 0, committed=set(), lock=None, stats=None, check=check))
    assert killed == [1]


def test_a_fenced_pool_refuses_every_storage_write_but_serves_reads():
    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards.protocol import Op, PromoteRequest, SnapshotRequest, StatsRequest

    calls = []

    async def call(op, req):
        calls.append(op)
        return op

    pool = ShardPool(2, 4, None)
    pool.clients = [types.SimpleNamespace(call=call, shard_id=i) for i in range(2)]
    pool.fenced = lambda: "this server no longer owns --storage-uri X"

    async def run():
        assert await pool.broadcast(Op.STATS, StatsRequest()) == [Op.STATS, Op.STATS]
        for coro in (lambda: pool.broadcast(Op.SNAPSHOT, SnapshotRequest()), pool.snapshot,
                     lambda: pool.gather_partial(Op.PROMOTE, None, shards=[0]),
                     lambda: pool.scatter(Op.MEMORY_CLEAR, ["s"], lambda s: 0, lambda xs: None)):
            with pytest.raises(StorageUnavailable, match="no longer owns"):
                await coro()
        with pytest.raises(StorageUnavailable):
            pool.call(0, Op.PREPARE, None)

    asyncio.run(run())
    assert calls == [Op.STATS, Op.STATS]


def test_keep_lease_puts_a_wiped_lease_back_and_stops_when_fenced(uri):
    from oprag_server.supervision import keep_lease

    a = OwnerLease(ObjectStore.from_uri(uri), renew_s=0.01)
    a.acquire()
    wiped = []

    async def on_wiped():
        wiped.append(1)
        OwnerLease(ObjectStore.from_uri(uri)).acquire(takeover=True)  # then another server takes it

    async def run():
        a.store.delete(["owner"])
        await asyncio.wait_for(keep_lease(a, on_wiped, asyncio.Event()), 5)  # returns: fenced

    asyncio.run(run())
    assert wiped == [1] and a.fenced and "took it over" in a.fenced


def test_the_ingest_health_name_follows_storage_write_failures():
    from oprag_server.supervision import INGEST_HEALTH, NOT_SERVING, SERVING

    calls, err = [], [None]

    async def hset(name, st):
        calls.append((name, st))

    pool = types.SimpleNamespace(n=1, down_shards=lambda: [])
    metrics = types.SimpleNamespace(shards_up=types.SimpleNamespace(set=lambda n: None))
    sup = ShardSupervisor(pool, None, types.SimpleNamespace(set=hset), ("",), metrics, write_error=lambda: err[0])

    async def run():
        await sup.check()
        err[0] = "object storage write failed: x; nothing was stored"
        await sup.check()
        await sup.check()
        err[0] = None
        await sup.check()

    asyncio.run(run())
    assert [c for c in calls if c[0] == INGEST_HEALTH] == [(INGEST_HEALTH, NOT_SERVING), (INGEST_HEALTH, SERVING)]
    assert ("", NOT_SERVING) not in calls  # reads go on: the server as a whole stays SERVING


@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_log_object_damaged_after_it_was_written_is_refused_and_a_torn_one_skipped(tmp_path, uri, where):
    """trial57 #2, #3: a flipped byte in a log object (a ClearSession record in the middle; a session turn, the last)
    read as a torn object and was skipped: the cleared session's turns came back, the turn was dropped. A whole
    object whose CRC-32 does not match is now refused, naming it; one a crash cut short is still skipped."""
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.memory.promote(PromoteRequest("s", "q", "a", [], [], np.ones(DIM, np.float32), max_turns=5))
    a.memory.clear(MemoryClearRequest("s", 1e12))
    _commit(a, "t2", 2, ["d2"], committed)
    keys = a.storage.wal.list()
    key = keys[2] if where == "middle" else keys[-1]
    good = a.storage.wal.get(key)
    a.txns.wal.close()
    for damaged, refused in ((good[:len(good) // 2], False), (good[:-1], False),
                             (good[:-20] + bytes([good[-20] ^ 0x04]) + good[-19:], True),
                             (bytes([good[0] ^ 0x01]) + good[1:], True)):  # (the length field)
        (tmp_path / "bucket" / "oprag" / "shard-0" / "wal" / key).write_bytes(damaged)
        shutil.rmtree(tmp_path / "b", ignore_errors=True)
        if refused:
            with pytest.raises(LogGapError, match=rf"wal/{key}: this log object is damaged .*written whole"):
                _state(tmp_path / "b", uri, set(committed))
        else:  # torn (a put a crash cut short): skipped, the rest served
            b = _state(tmp_path / "b", uri, set(committed))
            assert sorted(b.store.doc_slots) == (["d1", "d2"] if where == "middle" else ["d1"])
            b.txns.wal.close()


def test_a_refused_start_keeps_the_local_snapshot_and_says_how_to_seed_from_it(tmp_path, uri, capfd):
    """trial57 #4: with the store's CURRENT gone (a wipe, a kill -9 a second later), the refused start had deleted the
    local snapshot and CURRENT first: the only full copy. Now the store's log is checked before anything local
    changes; the message names the local snapshot and the way to seed an empty prefix from it. The newest log object
    deleted from the store is no longer dropped without a word either."""
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    _commit(a, "t1", 1, ["d1"], committed)
    a.snapshot()
    _commit(a, "t2", 2, ["d2"], committed)
    _commit(a, "t3", 3, ["d3"], committed)
    a.txns.wal.close()
    shard = tmp_path / "a" / "shard-0"
    snap = (shard / "CURRENT").read_text().strip()
    store = a.storage.store
    store.delete(["CURRENT"])
    with pytest.raises(LogGapError, match=rf"log objects 0 are missing.*The local {shard} still holds snapshot "
                                          rf"{snap}, left as it is: .*move the store's prefix aside"):
        _state(tmp_path / "a", uri, set(committed))
    assert (shard / "CURRENT").read_text().strip() == snap and (shard / snap / "meta.json").is_file()
    store.put_atomic("CURRENT", json.dumps({"snapshot": snap, "wal_from": 1}).encode())
    newest = a.storage.wal.list()[-1]
    a.storage.wal.delete([newest])  # the last acknowledged write's prepare object lost by the store
    capfd.readouterr()
    b = _state(tmp_path / "a", uri, set(committed) - {"t3"})  # (one record more: a crash or a failed put leaves it)
    assert sorted(b.store.doc_slots) == ["d1", "d2"]
    err = capfd.readouterr().err  # (the shard's own log lines, "<level> shard 0: ...")
    assert "INFO shard 0: " in err and "its last record is not in the store" in err, err
    _commit(b, "t4", 3, ["d4"], committed)
    _commit(b, "t5", 4, ["d5"], committed)
    b.txns.wal.close()
    b.storage.wal.delete(b.storage.wal.list()[-2:])  # the two newest lost: more than a crash leaves
    local = (shard / "wal.log").read_bytes()
    with pytest.raises(LocalNewer, match="the file holds writes the store lacks .* Nothing was changed"):
        _state(tmp_path / "a", uri, set(committed) - {"t3", "t4", "t5"})  # (trial59c N1: the file was cut down)
    assert (shard / "wal.log").read_bytes() == local


def test_a_proof_failure_on_a_stored_log_does_not_advise_salvage_log():
    """trial57 #6-#8: with --storage-uri the refusal said to run `oprag salvage-log <data-dir>/commits.log`, whose
    result the next start rebuilt from the store again: a loop. It now names the store and the takeover case."""
    from oprag_server.shards.txn import check_against

    ops = [{"txn": "a", "seq": 1}, {"txn": "b", "seq": 2}, {"txn": "c", "seq": 3}]
    for committed, want in (({"c": 3}, "prepared sequence numbers"), ({"a": 1, "x": 2, "c": 3}, "committed transactions")):
        with pytest.raises(RuntimeError, match=want) as local:
            check_against("d/shard-0/wal.log", ops[:1] + ops[2:] if "x" in committed else ops, committed, 0)
        with pytest.raises(RuntimeError, match=want) as stored:
            check_against("d/shard-0/wal.log", ops[:1] + ops[2:] if "x" in committed else ops, committed, 0,
                          "file:///b/shard-0/wal")
        assert "salvage-log <data-dir>" not in str(stored.value) and "--storage-takeover" in str(stored.value)
        assert ("commits/ of --storage-uri" if want.startswith("prepared") else "file:///b/shard-0/wal") in str(stored.value)
    assert "oprag salvage-log <data-dir>/commits.log" in str(local.value) or "restore the log" in str(local.value)


def test_deleting_a_snapshot_s_objects_leaves_no_empty_folders_on_a_local_store(tmp_path, uri):
    """trial57 #12: a file:// store kept every deleted snapshot's empty snap/<name>/postings/ folders (31 in a run)."""
    committed: set[str] = set()
    a = _state(tmp_path / "a", uri)
    for i in range(3):
        _commit(a, f"t{i}", i + 1, [f"d{i}"], committed)
        a.snapshot()
    shard = tmp_path / "bucket" / "oprag" / "shard-0"
    assert [p.name for p in (shard / "snap").iterdir()] == [json.loads((shard / "CURRENT").read_text())["snapshot"]]
    assert (shard / "wal").is_dir()  # (a top folder stays, empty or not)
    a.txns.wal.close()


def test_a_lease_renewal_the_store_keeps_refusing_is_logged_once(caplog):
    """trial57b: on a read-only store every renewal's error named its own temporary object (owner.tmp-<uuid>), so the
    once-per-change rule logged an ERROR at every renewal."""
    import uuid

    from oprag_server.supervision import keep_lease

    stop = asyncio.Event()
    tries = []

    class Lease:
        renew_s = 0.005

        def renew(self):
            tries.append(1)
            if len(tries) >= 6:
                stop.set()
            raise OSError(f"[Errno 30] Read-only file system: '/b/oprag/owner.tmp-{uuid.uuid4().hex}'")

    async def run():
        await asyncio.wait_for(keep_lease(Lease(), None, stop), 5)

    with caplog.at_level(logging.ERROR, "oprag"):
        asyncio.run(run())
    assert len(tries) >= 6
    assert len([r for r in caplog.records if "renewing the --storage-uri owner lease failed" in r.getMessage()]) == 1
