"""Write-ahead log framing: fsync'ed appends, torn tails and corrupt records are dropped."""

from __future__ import annotations

from oprag_server.index.wal import WriteAheadLog, read_records


def test_append_and_reopen(tmp_path):
    w = WriteAheadLog(tmp_path / "wal.log")
    assert w.open() == []
    for i in range(5):
        w.append({"txn": f"t{i}", "seq": i, "blob": bytes(range(i))})
    w.close()
    recs = WriteAheadLog(tmp_path / "wal.log").open()
    assert [r["seq"] for r in recs] == list(range(5)) and recs[3]["blob"] == bytes(range(3))


def test_torn_tail_is_truncated_and_appends_continue(tmp_path):
    p = tmp_path / "wal.log"
    w = WriteAheadLog(p)
    w.open()
    w.append({"txn": "a", "seq": 1})
    w.append({"txn": "b", "seq": 2})
    w.close()
    good = p.stat().st_size
    with open(p, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # a crash in the middle of the next append
    w = WriteAheadLog(p)
    assert [r["txn"] for r in w.open()] == ["a", "b"]
    assert p.stat().st_size == good
    w.append({"txn": "c", "seq": 3})
    w.close()
    assert [r["txn"] for r in read_records(p)[0]] == ["a", "b", "c"]


def test_corrupt_record_ends_the_intact_prefix(tmp_path):
    p = tmp_path / "wal.log"
    w = WriteAheadLog(p)
    w.open()
    w.append({"txn": "a", "seq": 1})
    w.append({"txn": "b", "seq": 2})
    w.close()
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the last payload: its crc32 no longer matches
    p.write_bytes(bytes(data))
    assert [r["txn"] for r in read_records(p)[0]] == ["a"]


def test_reset_keeps_only_given_records(tmp_path):
    w = WriteAheadLog(tmp_path / "wal.log")
    w.open()
    for i in range(3):
        w.append({"txn": f"t{i}", "seq": i})
    w.reset([{"txn": "t2", "seq": 2}])
    w.append({"txn": "t3", "seq": 3})
    w.close()
    assert [r["txn"] for r in read_records(tmp_path / "wal.log")[0]] == ["t2", "t3"]


def test_fsync_write_with_streams_the_file_and_leaves_nothing_on_failure(tmp_path):
    import pytest

    from oprag_server.index.wal import fsync_write_with

    p = tmp_path / "sub" / "f.bin"
    fsync_write_with(p, lambda f: [f.write(bytes([i]) * 1000) for i in range(3)])
    assert p.read_bytes() == b"\x00" * 1000 + b"\x01" * 1000 + b"\x02" * 1000

    def fail(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fsync_write_with(p, fail)
    assert p.read_bytes()[:1000] == b"\x00" * 1000  # the old file stays; no temporary is left
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.bin"]
