"""The commit protocol (engine/commit.py) over in-process shards: sequence numbers only grow,
wait_applied wakes when a commit lands, a failed prepare aborts everywhere, deletes are counted,
and the commit log decides what recovery replays."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from oprag_server import records
from oprag_server.engine.commit import CommitProtocol
from oprag_server.engine.rwlock import RWLock
from oprag_server.index.bm25 import CorpusStats
from oprag_server.index.wal import WriteAheadLog, encode_record
from oprag_server.shards.inprocess import InProcessTransport, in_process_pool
from oprag_server.shards.pool import ShardError, ShardPool
from oprag_server.shards.protocol import Op, StageRequest
from oprag_server.shards.state import ShardState

DIM = 4


def _protocol(n: int = 2) -> CommitProtocol:
    return CommitProtocol(in_process_pool([ShardState(i, DIM, None) for i in range(n)]), CorpusStats(), RWLock())


async def _stage(cp: CommitProtocol, txn: str, docs: dict[str, list[str]]) -> None:
    """Stage each document's chunks on the shard that owns it."""
    pool = cp.pool
    for doc_id, texts in docs.items():
        n = len(texts)
        batch = records.make_chunk_batch(
            chunk_ids=[f"{doc_id}#{i}" for i in range(n)], doc_ids=[doc_id] * n, titles=[""] * n, texts=texts,
            metadata=[{}] * n, ordinals=list(range(n)), generations=[1] * n, content_hashes=texts,
            vectors=np.ones((n, DIM), np.float32))
        await pool.call(pool.owner(doc_id), Op.STAGE, StageRequest(txn, records.to_ipc(batch)))


def _shard_stats(cp: CommitProtocol) -> CorpusStats:
    return CorpusStats.merge_full([c.state.store.postings.full_stats() for c in cp.pool.clients])


def test_sequence_numbers_only_grow_and_stats_follow_the_shards():
    async def go():
        cp = _protocol()
        seqs = []
        for k in range(4):
            await _stage(cp, f"t{k}", {f"d{k}": ["alpha beta", "gamma"], f"e{k}": ["delta"]})
            seq, replies = await cp.commit(f"t{k}", "upsert")
            seqs.append(seq)
            assert sum(len(r.doc_ids) for r in replies) == 2 and sum(r.added for r in replies) == 3
        seqs.append((await cp.delete(["d0"]))[2])
        assert seqs == sorted(set(seqs)) and cp.seq == cp.applied_seq == seqs[-1]
        assert cp.stats == _shard_stats(cp) and cp.stats.n_docs == 4 * 3 - 2

    asyncio.run(go())


def test_wait_applied_wakes_when_the_commit_lands():
    async def go():
        cp = _protocol()
        gate = asyncio.Event()
        shard0 = cp.pool.clients[0]
        real_call = shard0.call

        async def slow_apply(op, req):
            if op is Op.APPLY:
                await gate.wait()
            return await real_call(op, req)

        shard0.call = slow_apply
        await cp.wait_applied(0, timeout=0)  # nothing to wait for
        with pytest.raises(LookupError, match="never issued"):
            await cp.wait_applied(1, timeout=0.1)
        commit = asyncio.create_task(cp.commit("t1", "delete", ["nothing"]))
        while cp.seq < 1:
            await asyncio.sleep(0)
        waiter = asyncio.create_task(cp.wait_applied(1, timeout=5))
        with pytest.raises(asyncio.TimeoutError):
            await cp.wait_applied(1, timeout=0.05)
        assert not waiter.done() and cp.applied_seq == 0
        gate.set()
        await waiter
        assert (await commit)[0] == 1 and cp.applied_seq == 1

    asyncio.run(go())


def test_failed_prepare_aborts_on_every_live_shard():
    async def go():
        cp = _protocol(3)
        docs = {f"doc{i}": ["alpha"] for i in range(12)}
        await _stage(cp, "t1", docs)
        cp.pool.clients[1].kill()
        with pytest.raises(ShardError, match="shard 1"):
            await cp.commit("t1", "upsert")
        for i in (0, 2):
            txns = cp.pool.clients[i].state.txns
            assert "t1" not in txns.staged and "t1" not in txns.prepared
            assert cp.pool.clients[i].state.store.chunks == {}
        assert cp.applied_seq == 0 and cp.stats.n_docs == 0
        # the aborted transaction gave its number back (issue 17: numbers follow what was applied);
        # shards replay committed transaction ids only, so a stale prepare record with it is skipped
        assert cp.seq == 0
        cp.pool.clients[1] = InProcessTransport.of(ShardState(1, DIM, None))
        assert (await cp.delete(["doc0"]))[2] == 1

    asyncio.run(go())


def test_delete_counts_documents_and_chunks_over_all_shards():
    async def go():
        cp = _protocol(3)
        await _stage(cp, "t1", {"a": ["one", "two", "three"], "b": ["four"], "c": ["five", "six"]})
        await cp.commit("t1", "upsert")
        docs, chunks, seq = await cp.delete(["a", "c", "missing"])
        assert (docs, chunks, seq) == (2, 5, 2)
        assert await cp.delete(["a"]) == (0, 0, 3)
        assert cp.stats == _shard_stats(cp) and cp.stats.n_docs == 1

    asyncio.run(go())


def test_commit_log_decides_what_a_restart_replays(tmp_path):
    async def go():
        loop = asyncio.get_running_loop()
        pool = ShardPool(2, DIM, tmp_path, transport=InProcessTransport)
        cp = CommitProtocol(pool, CorpusStats(), RWLock())
        committed = cp.open_log(tmp_path / "commits.log")
        cp.recover(r.applied_seq for r in pool.start(loop, committed=committed))
        await _stage(cp, "t1", {"a": ["one"], "b": ["two"], "c": ["three"]})
        await cp.commit("t1", "upsert")
        assert cp.committed_txns() == {"t1"}
        # restart from the logs alone (no snapshot): the committed transaction comes back
        cp2 = CommitProtocol(ShardPool(2, DIM, tmp_path, transport=InProcessTransport), CorpusStats(), RWLock())
        ready = cp2.pool.start(loop, committed=cp2.open_log(tmp_path / "commits.log"))
        cp2.recover(r.applied_seq for r in ready)
        assert sum(r.replayed for r in ready) == 2 and sum(r.chunks for r in ready) == 3 and cp2.seq == 1
        assert cp2.next_seq() == 2
        cp2.reset_log()
        assert cp2.committed_txns() == set()

    asyncio.run(go())


def test_queries_wait_for_the_apply_only_not_for_the_prepare():
    """Session 41: the write lock covered the whole commit, so a query waited for both shards' write-ahead log fsyncs
    and the commit log's (trial40b: ~125 ms of a 182 ms p50 during a replacement). Only the apply changes what a
    query reads: a reader enters while a prepare is held, and waits while an apply is; the write lands whole."""
    async def go():
        cp = _protocol()
        await _stage(cp, "t1", {"d1": ["alpha beta"], "e1": ["gamma"]})
        held = {Op.PREPARE: asyncio.Event(), Op.APPLY: asyncio.Event()}
        entered = {Op.PREPARE: asyncio.Event(), Op.APPLY: asyncio.Event()}
        shard0 = cp.pool.clients[0]
        real_call = shard0.call

        async def slow(op, req):
            if op in held:
                entered[op].set()
                await held[op].wait()
            return await real_call(op, req)

        shard0.call = slow
        commit = asyncio.create_task(cp.commit("t1", "upsert"))
        await asyncio.wait_for(entered[Op.PREPARE].wait(), 5)
        async with asyncio.timeout(1):  # the prepare is held: a reader still enters at once
            async with cp.lock.read():
                assert cp.applied_seq == 0 and cp.stats.n_docs == 0
        held[Op.PREPARE].set()
        await asyncio.wait_for(entered[Op.APPLY].wait(), 5)
        reader = asyncio.create_task(_read_stats(cp))
        await asyncio.sleep(0.05)
        assert not reader.done()  # the apply is held: a reader waits for it
        held[Op.APPLY].set()
        assert await asyncio.wait_for(reader, 5) == (1, 2)  # and then sees the write whole
        assert (await commit)[0] == 1

    asyncio.run(go())


async def _read_stats(cp: CommitProtocol) -> tuple[int, int]:
    async with cp.lock.read():
        return cp.applied_seq, cp.stats.n_docs


def test_a_missing_commit_log_is_refused_only_when_a_shard_log_holds_prepared_transactions(tmp_path):
    import pytest

    from oprag_server.engine.commit import missing_log
    from oprag_server.index.wal import WriteAheadLog

    missing_log(tmp_path / "commits.log")  # a new data directory
    w = WriteAheadLog(tmp_path / "replica-1" / "shard-0" / "wal.log")
    w.open()
    w.append({"kind": "turn", "session": "s"})  # memory records alone: nothing a commit log decides
    w.close()
    missing_log(tmp_path / "commits.log")
    w.open()
    w.append({"txn": "t9", "seq": 9, "kind": "delete", "doc_ids": ["a"]})
    w.close()
    with pytest.raises(RuntimeError, match=r"commits\.log is missing, .*replica-1/shard-0/wal\.log \(1\)"):
        missing_log(tmp_path / "commits.log")
    (tmp_path / "commits.log").touch()  # the operator's choice to go on without it
    missing_log(tmp_path / "commits.log")


def test_the_base_record_and_the_shards_sequence_numbers_tell_an_older_copy(tmp_path):
    import pytest

    cp = CommitProtocol(pool=None, stats=None, lock=None)
    cp.open_log(tmp_path / "commits.log")
    cp.recover([7, 7])
    cp.reset_log()  # after a full snapshot at 7
    cp2 = CommitProtocol(pool=None, stats=None, lock=None)
    assert cp2.open_log(tmp_path / "commits.log") == {} and cp2.committed_txns() == set()
    cp2.check_recovered({0: 7, 1: 7})
    with pytest.raises(RuntimeError, match=r"up to 7 \(every shard's snapshot had reached 7 .*older snapshot"):
        cp2.check_recovered({0: 5, 1: 5})
    with pytest.raises(RuntimeError, match="shard 1 recovered up to sequence 8, but another shard recovered up to 9"):
        cp2.check_recovered({0: 9, 1: 8})
    cp2.check_recovered({1: 7}, committed=set())  # a restart: one shard, nothing else to compare
    cp2.recover([7, 7])
    assert cp2.next_seq() == 8


def test_what_the_shard_logs_prove_about_missing_commit_records():
    from pathlib import Path

    from oprag_server.engine.commit_repair import prove, tail_is
    from oprag_server.index.wal import encode_record

    a, b = Path("shard-0/wal.log"), Path("shard-1/wal.log")
    # 5 was aborted (x5) and taken again (y5); 6 was skipped by a failed append; 8 is the last one prepared
    ops = [("t4", 4), ("x5", 5), ("y5", 5), ("s6", 6), ("t7", 7), ("t8", 8)]
    logs = {a: ops, b: [o for o in ops if o[0] != "x5"]}  # (x5 failed on shard 1 before its record)
    recs = [{"txn": "", "seq": 3, "kind": "base"}, {"txn": "t7", "seq": 7}, {"txn": "", "seq": 7, "kind": "skip", "skipped": [6]}]
    p = prove(recs, logs)
    assert p.restore == {4: "t4", 5: "y5"} and p.last == (8, "t8") and p.unclear == []
    logs[b] = [("t4", 4), ("z5", 5)]  # the logs disagree on 5: not restored
    assert prove(recs, logs).unclear == [5]
    t8, other = "9f" * 16, "9e" * 16  # (uuid4 hex ids, as the server's; another id differs in many bytes)
    whole = encode_record({"txn": t8, "seq": 8})
    hit = bytearray(whole)
    hit[-3] ^= 1
    hit[20] ^= 0x40
    assert tail_is(bytes(hit), 8, t8) and not tail_is(whole[:-2], 8, t8) and not tail_is(bytes(hit), 8, other)
    assert not tail_is(bytes(hit), 9, t8)  # (the stored CRC-32 is that of the record at 8)
    crc_hit = bytearray(whole)
    crc_hit[5] ^= 0xFF  # the damage in the stored CRC-32: the payload is the record's
    assert tail_is(bytes(crc_hit), 8, t8) and not tail_is(bytes(crc_hit), 8, other)


def test_a_start_refuses_prepared_numbers_without_commit_records_below_later_ones():
    import pytest

    from oprag_server.shards.txn import check_against

    ops = [{"txn": t, "seq": n} for t, n in [("t4", 4), ("x5", 5), ("y5", 5), ("s6", 6), ("t7", 7), ("t8", 8)]]
    committed = {"t4": 4, "y5": 5, "t7": 7, "skipped:6": 6}
    check_against("wal.log", ops, committed, applied=3)  # 8: the last, in flight at the crash
    with pytest.raises(RuntimeError, match=r"prepared sequence numbers \[6\] \(1\) before later ones \(up to 8\)"):
        check_against("wal.log", ops, {k: v for k, v in committed.items() if k != "skipped:6"}, applied=3)
    with pytest.raises(RuntimeError, match=r"committed transactions \[5\] \(1\) are not in this log"):
        check_against("wal.log", [o for o in ops if o["txn"] != "y5"], committed, applied=3)
    check_against("wal.log", ops, {"t7": 7, "skipped:6": 6}, applied=5)  # (numbers the snapshot covers: not asked)


def test_a_failed_commit_record_append_gives_its_number_back_unless_its_bytes_may_be_in_the_log(tmp_path,
                                                                                               monkeypatch):
    """trial56b: a full disk failed commit-record appends (ENOSPC, the file cut back), the numbers were kept, and
    after a crash the shards' logs held prepared numbers below later ones with no commit record: a refused start.
    Now a number is kept (and written as skipped) only when the append could not be undone, and no transaction is
    prepared while the log refuses appends."""
    import errno
    import os

    from oprag_server.index import wal as wal_mod
    from oprag_server.shards.txn import check_against

    async def go():
        pool = ShardPool(2, DIM, tmp_path, transport=InProcessTransport)
        cp = CommitProtocol(pool, CorpusStats(), RWLock())
        cp.recover(r.applied_seq for r in pool.start(asyncio.get_running_loop(), committed=cp.open_log(
            tmp_path / "commits.log")))
        real_write = os.write

        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        await _stage(cp, "t1", {"a": ["one"]})
        monkeypatch.setattr(wal_mod.os, "write", lambda fd, data: full(fd, data) if fd == cp.log._f.fileno()
                            else real_write(fd, data))
        with pytest.raises(OSError, match="No space"):
            await cp.commit("t1", "upsert")
        assert cp.seq == 0 and cp._skipped == []  # cut back: given back
        monkeypatch.setattr(wal_mod.os, "write", real_write)
        await _stage(cp, "t2", {"b": ["two"]})
        assert (await cp.commit("t2", "upsert"))[0] == 1
        # the cut-back fails too: the number is kept, the log refuses appends, nothing more is prepared
        await _stage(cp, "t3", {"c": ["three"]})
        monkeypatch.setattr(wal_mod.os, "write", lambda fd, data: full(fd, data) if fd == cp.log._f.fileno()
                            else real_write(fd, data))
        monkeypatch.setattr(wal_mod.os, "ftruncate", lambda fd, n: full(fd, b""))
        with pytest.raises(OSError):
            await cp.commit("t3", "upsert")
        assert cp.seq == 2 and cp._skipped == [2] and not cp.log.usable
        await _stage(cp, "t4", {"d": ["four"]})
        with pytest.raises(OSError, match="refuses appends"):
            await cp.commit("t4", "upsert")
        assert cp.seq == 2  # (given back: nothing prepared)
        for c in pool.clients:
            ops = [r for r in c.state.txns.wal if r.get("kind") in ("upsert", "delete")]
            assert [(r["txn"], r["seq"]) for r in ops] == [("t1", 1), ("t2", 1), ("t3", 2)]
            check_against("wal.log", ops, {"t2": 1}, applied=0)  # a start after a crash here: 2 is the top

    asyncio.run(go())


def test_a_full_disk_under_the_commit_log_is_unavailable_not_internal():
    import errno

    import grpc

    from oprag_server.service.interceptors import status_for

    code, msg, _ = status_for(OSError(errno.ENOSPC, "No space left on device"), "Ingest")
    assert code == grpc.StatusCode.UNAVAILABLE and "commit log" in msg and "the disk is full" in msg
    assert status_for(OSError(errno.EBADF, "bad"), "Ingest")[0] == grpc.StatusCode.INTERNAL  # (not a disk's state)


def test_a_kept_number_is_written_as_a_skip_record_before_the_next_prepare(tmp_path, monkeypatch):
    """A number kept by a failed append whose record may be in the log (a mirrored log's put failed after the local
    append): a skip record goes to the commit log before any later number is prepared, so a crash right after the
    next prepare leaves nothing a start would take for a lost commit record (trial56b's window)."""
    from oprag_server.shards.txn import check_against

    async def go():
        pool = ShardPool(2, DIM, tmp_path, transport=InProcessTransport)
        cp = CommitProtocol(pool, CorpusStats(), RWLock())
        cp.recover(r.applied_seq for r in pool.start(asyncio.get_running_loop(), committed=cp.open_log(
            tmp_path / "commits.log")))
        real = cp.log.append

        def put_failed(rec):
            real(rec)
            cp.log.left = True
            raise OSError("object storage write failed: simulated")

        await _stage(cp, "t1", {"a": ["one"]})
        monkeypatch.setattr(cp.log, "append", put_failed)
        with pytest.raises(Exception, match="object storage write failed") as failed:  # (StorageUnavailable)
            await cp.commit("t1", "upsert")
        assert getattr(failed.value, "nothing_stored", False)  # (trailer oprag-stored: none; trial57 #10)
        monkeypatch.setattr(cp.log, "append", real)
        assert cp._skipped == [1]
        # t1's record is in the file, but t1 was aborted on every shard: a shard restarted now does not replay it
        assert [r["txn"] for r in cp.log] == ["t1"] and cp.committed_txns() == set()
        await _stage(cp, "t2", {"b": ["two"]})
        prepared = []
        orig = cp.pool.broadcast

        async def spy(op, req, *a, **k):  # the skip record is in the log when the next number is prepared
            if op == Op.PREPARE:
                prepared.append([r.get("kind") for r in cp.log])
            return await orig(op, req, *a, **k)

        monkeypatch.setattr(cp.pool, "broadcast", spy)
        assert (await cp.commit("t2", "upsert"))[0] == 2
        assert prepared == [[None, "skip"]] and cp._skipped == []
        assert cp.committed_txns() == {"t2"}
        again = CommitProtocol(pool=None, stats=None, lock=None)
        committed = again.open_log(tmp_path / "commits.log")
        assert committed == {"t2": 2, "skipped:1": 1}  # (t1's record left in the file is not a commit)
        again.check_recovered({0: 2, 1: 2})
        docs = []
        for c in pool.clients:
            ops = [r for r in c.state.txns.wal if r.get("kind") in ("upsert", "delete")]
            assert [(r["txn"], r["seq"]) for r in ops] == [("t1", 1), ("t2", 2)]
            check_against("wal.log", ops + [{"txn": "t3", "seq": 3}], committed, applied=0)
            fresh = ShardState(c.state.shard_id, DIM, None)  # a replay of this shard's log applies t2 alone
            assert fresh.txns.replay(WriteAheadLog(c.state.txns.wal.path), committed) == 1
            assert fresh.store.applied_seq == 2
            docs += list(fresh.store.doc_slots)
        assert docs == ["b"]

    asyncio.run(go())


def test_a_record_a_failed_append_left_behind_its_skip_record_is_not_a_commit(tmp_path):
    """A commit record whose append failed after its bytes reached the file (the cut-back failed too), then the skip
    record of its number, then nothing more committed (the next transaction failed at a shard): the shards never
    applied number 1 and a start serves them at 0, where counting the left record refused them as behind."""
    log = WriteAheadLog(tmp_path / "commits.log")
    log.open()
    log.append({"txn": "t1", "seq": 1})
    log.append({"txn": "", "seq": 0, "kind": "skip", "skipped": [1]})
    log.close()
    cp = CommitProtocol(pool=None, stats=None, lock=None)
    assert cp.open_log(tmp_path / "commits.log") == {"skipped:1": 1}
    cp.check_recovered({0: 0, 1: 0})
    cp.recover([0, 0])
    assert cp.next_seq() == 2  # (the kept number is never issued again)


def test_a_damaged_length_field_of_the_last_commit_record_is_refused_without_a_torn_tail_warning(tmp_path, caplog):
    """The last commit record written whole, its length field hit afterwards: it parses as a torn tail, but its payload
    is the commit record of the transaction every shard prepared, so the start refuses. It used to log "a torn tail
    ... is dropped" first, a WARNING the refusal then contradicted; a real torn tail still gets it, once."""
    import logging

    async def write_two():
        pool = ShardPool(2, DIM, tmp_path, transport=InProcessTransport)
        cp = CommitProtocol(pool, CorpusStats(), RWLock())
        cp.recover(r.applied_seq for r in pool.start(asyncio.get_running_loop(), committed=cp.open_log(
            tmp_path / "commits.log")))
        for i, txn in enumerate(("t1", "t2")):
            await _stage(cp, txn, {f"d{i}": ["text"]})
            await cp.commit(txn, "upsert")
        cp.log.close()
        for c in pool.clients:
            c.state.txns.wal.close()

    asyncio.run(write_two())
    log = tmp_path / "commits.log"
    good = log.read_bytes()
    last = len(good) - len(encode_record({"txn": "t2", "seq": 2}))
    data = bytearray(good)
    data[last] ^= 0x40  # the length field: the record now seems to run past the end of the file
    log.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="oprag")
    with pytest.raises(RuntimeError, match=r"its last record \(\d+ bytes\) is damaged, and it is the whole commit "
                                           r"record of transaction t2 \(sequence 2\)"):
        CommitProtocol(pool=None, stats=None, lock=None).open_log(log)
    assert "torn tail" not in caplog.text and log.read_bytes() == bytes(data)
    log.write_bytes(good[:-3])  # cut short by a crash: dropped, with its WARNING
    assert CommitProtocol(pool=None, stats=None, lock=None).open_log(log) == {"t1": 1}
    assert caplog.text.count("torn tail") == 1
