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
    assert p.stat().st_size == good + 6  # (cut by the first append: a start refused meanwhile changes nothing)
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


# --- an append that fails while the process lives (issue 13 follow-up, trial15's finding #1) ---

_FULL_DISK = r"""
import errno, os, resource, signal, sys
from pathlib import Path
from oprag_server.index.wal import WriteAheadLog
p = Path(sys.argv[1]); extra, big = int(sys.argv[2]), int(sys.argv[3])
w = WriteAheadLog(p); w.open(); w.append({"seq": 1, "x": "a" * 100})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit stands in for a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (p.stat().st_size + extra, resource.RLIM_INFINITY))
try:
    w.append({"seq": 2, "x": "b" * big})  # fails: not acknowledged
    print("appended")
except OSError as exc:
    print("refused", errno.errorcode.get(exc.errno))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
w.append({"seq": 3, "x": "c"})  # the disk has room again: acknowledged
w.close()
print([r["seq"] for r in WriteAheadLog(p).open()])
"""


def _full_disk(tmp_path, extra: int, big: int) -> list[str]:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "wal.log"), str(extra), str(big)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_failed_append_leaves_nothing_before_later_acknowledged_records(tmp_path):
    """Part of a record is written before the disk fills: the bytes are cut back, so the record
    appended once the disk has room is read back (a torn record in front of it hid it)."""
    assert _full_disk(tmp_path, 50, 1000) == ["refused EFBIG", "[1, 3]"]


def test_failed_append_of_a_record_that_fits_nothing(tmp_path):
    """Not a byte fits: nothing is written, and the later record follows the first."""
    assert _full_disk(tmp_path, 0, 1000) == ["refused EFBIG", "[1, 3]"]


def test_failed_fsync_cuts_the_record_back(tmp_path, monkeypatch):
    """The write succeeds but fsync fails (EIO): the record is not durable, so it is removed
    and the caller gets the error; the log goes on."""
    import errno
    import os

    from oprag_server.index import wal as wal_mod

    p = tmp_path / "wal.log"
    w = WriteAheadLog(p)
    w.open()
    w.append({"seq": 1})
    size = p.stat().st_size
    real, calls = os.fsync, []

    def failing(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "fsync failed")
        return real(fd)

    monkeypatch.setattr(wal_mod.os, "fsync", failing)
    try:
        w.append({"seq": 2})
    except OSError as exc:
        assert exc.errno == errno.EIO
    else:
        raise AssertionError("the failed fsync was not reported")
    monkeypatch.setattr(wal_mod.os, "fsync", real)
    assert p.stat().st_size == size
    w.append({"seq": 3})
    w.close()
    assert [r["seq"] for r in WriteAheadLog(p).open()] == [1, 3]


def test_a_log_that_cannot_undo_a_failed_append_refuses_appends_until_reopened(tmp_path, monkeypatch):
    import errno

    import pytest

    from oprag_server.index import wal as wal_mod

    p = tmp_path / "wal.log"
    w = WriteAheadLog(p)
    w.open()
    w.append({"seq": 1})

    real_write = wal_mod.os.write

    def torn(fd, data):  # 7 bytes reach the file, then the disk is full
        real_write(fd, bytes(data)[:7])
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_truncate(fd, n):
        raise OSError(errno.EIO, "ftruncate failed")

    monkeypatch.setattr(wal_mod.os, "write", torn)
    monkeypatch.setattr(wal_mod.os, "ftruncate", no_truncate)
    with pytest.raises(OSError, match="No space"):
        w.append({"seq": 2})
    monkeypatch.undo()
    with pytest.raises(OSError, match="refuses appends") as info:
        w.append({"seq": 3})
    assert info.value.errno == errno.EIO
    w2 = WriteAheadLog(p)
    assert [r["seq"] for r in w2.open()] == [1]  # the reopen drops the 7 torn bytes
    w2.append({"seq": 3})
    w2.close()
    assert [r["seq"] for r in read_records(p)[0]] == [1, 3]


# --- damage after the write (trial55b): refused untouched, salvaged on request ---


def _log(p, n=6):
    """A log of ``n`` records as WriteAheadLog.append frames them (written at once: no fsync per record)."""
    from oprag_server.index.wal import encode_record

    p.parent.mkdir(parents=True, exist_ok=True)  # (0x80 bytes inside the blobs: false candidates for a resync)
    p.write_bytes(b"".join(encode_record({"txn": f"t{i}", "seq": i, "blob": bytes(range(256)) * i}) for i in range(n)))


def _offsets(p):
    import struct

    data, out, pos = p.read_bytes(), [], 0
    while pos < len(data):
        out.append(pos)
        pos += 8 + struct.unpack_from("<I", data, pos)[0]
    return out


def test_damage_before_intact_records_is_refused_and_the_file_left_as_it_is(tmp_path):
    import pytest

    from oprag_server.index.wal import LogDamaged

    p = tmp_path / "wal.log"
    _log(p)
    offs = _offsets(p)
    data = bytearray(p.read_bytes())
    data[offs[2] + 20] ^= 0x01  # one bit inside record 2's payload
    p.write_bytes(bytes(data))
    with pytest.raises(LogDamaged, match=rf"bytes {offs[2]}-{offs[3]} of {len(data)} are damaged .* 3 intact records"):
        WriteAheadLog(p).open()
    assert p.read_bytes() == bytes(data)
    data[offs[2]: offs[2] + 4] = b"\xff\xff\xff\x7f"  # a length past the end of the file: the same
    p.write_bytes(bytes(data))
    with pytest.raises(LogDamaged, match="3 intact records"):
        WriteAheadLog(p).open()


def test_a_last_record_cut_short_is_a_torn_tail_and_a_whole_damaged_one_is_refused(tmp_path, caplog):
    import logging

    import pytest

    from oprag_server.index.wal import LogDamaged

    p = tmp_path / "wal.log"
    _log(p)
    offs = _offsets(p)
    clean = p.read_bytes()
    data = bytearray(clean)
    data[-5] ^= 0x10  # the last record, whole (its length reaches the end, it ends in STOP): damaged after the write
    p.write_bytes(bytes(data))
    with pytest.raises(LogDamaged, match=r"are damaged .* and they are the last record, whole"):
        WriteAheadLog(p).open()  # (trial56b F2: a session turn dropped as a crash's torn tail)
    assert p.read_bytes() == bytes(data)
    for cut in (clean[:-7], clean[:offs[5]] + bytes(len(clean) - offs[5])):  # cut short; its data never written
        p.write_bytes(cut)
        w = WriteAheadLog(p)
        with caplog.at_level(logging.WARNING, logger="oprag"):
            assert [r["seq"] for r in w.open()] == [0, 1, 2, 3, 4]
        assert p.read_bytes() == cut and f"torn tail of {len(cut) - offs[5]} bytes" in caplog.text
        w.append({"seq": 9})  # the first append cuts the tail, then appends
        assert [r["seq"] for r in read_records(p)[0]] == [0, 1, 2, 3, 4, 9] and read_records(p)[1] == p.stat().st_size
        w.close()


def test_a_refused_start_does_not_cut_a_torn_tail(tmp_path):
    p = tmp_path / "wal.log"
    _log(p)
    before = p.read_bytes()
    p.write_bytes(before[:-7])
    assert len(WriteAheadLog(p).open()) == 5 and p.read_bytes() == before[:-7]


def test_salvage_keeps_every_intact_record_byte_for_byte_and_the_original(tmp_path):
    from oprag_server.index.wal import parse_spans, salvage

    p = tmp_path / "wal.log"
    _log(p)
    offs, clean = _offsets(p), p.read_bytes()
    data = bytearray(clean)
    data[offs[1] + 9] ^= 0xFF
    data[offs[4] + 30] ^= 0xFF
    p.write_bytes(bytes(data))
    assert parse_spans(bytes(data))[1] == [(offs[1], offs[2]), (offs[4], offs[5])]
    kept, spans, orig = salvage(p)
    assert (kept, orig.read_bytes()) == (4, bytes(data))
    assert p.read_bytes() == clean[:offs[1]] + clean[offs[2]:offs[4]] + clean[offs[5]:]
    assert [r["seq"] for r in WriteAheadLog(p).open()] == [0, 2, 3, 5]
    assert salvage(p)[1:] == ([], None)  # intact now: not changed, no copy


def test_random_damage_never_loses_an_intact_record_silently(tmp_path):
    """Whatever bytes are hit, open() either returns every record before the damage and truncates only a tail with no
    intact record after it, or refuses and leaves the file; salvage then keeps every record not hit."""
    import random

    from oprag_server.index.wal import LogDamaged, parse_spans, salvage

    rng = random.Random(7)
    for trial in range(300):
        p = tmp_path / f"w{trial}.log"
        _log(p, n=rng.randint(2, 8))
        offs, clean = _offsets(p), p.read_bytes()
        data = bytearray(clean)
        hit = set()
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            data[at] ^= rng.randrange(1, 256)
            hit.add(max(i for i, o in enumerate(offs) if o <= at))
        p.write_bytes(bytes(data))
        try:
            got = [r["seq"] for r in WriteAheadLog(p).open()]
            assert got == list(range(min(hit))) and set(range(min(hit), len(offs))) <= hit  # nothing intact after
        except LogDamaged:
            assert p.read_bytes() == bytes(data)
            assert [r["seq"] for r in parse_spans(bytes(data))[0]] == [i for i in range(len(offs)) if i not in hit]
            salvage(p)
            assert [r["seq"] for r in WriteAheadLog(p).open()] == [i for i in range(len(offs)) if i not in hit]


def test_a_second_salvage_keeps_the_first_original(tmp_path):
    import pytest

    from oprag_server.index.wal import LogDamaged, salvage

    p = tmp_path / "wal.log"
    _log(p)
    for k in range(2):
        offs = _offsets(p)
        data = bytearray(p.read_bytes())
        data[offs[1] + 12] ^= 0xFF
        p.write_bytes(bytes(data))
        with pytest.raises(LogDamaged, match=["wal.log.damaged;", "wal.log.damaged.1;"][k]):  # (the copy it will make)
            WriteAheadLog(p).open()
        assert salvage(p)[2].name == ["wal.log.damaged", "wal.log.damaged.1"][k]
        assert (tmp_path / ["wal.log.damaged", "wal.log.damaged.1"][k]).read_bytes() == bytes(data)
    assert [r["seq"] for r in WriteAheadLog(p).open()] == [0, 3, 4, 5]


def test_salvage_log_refuses_a_data_directory_in_use_and_says_what_it_did(tmp_path, capsys):
    from oprag_server.salvage import main
    from oprag_server.startup import lock_data_dir

    d = tmp_path / "data"
    p = d / "shard-0" / "wal.log"
    _log(p)
    offs = _offsets(p)
    data = bytearray(p.read_bytes())
    data[offs[2] + 10] ^= 0xFF
    p.write_bytes(bytes(data))
    held = lock_data_dir(d)  # a server on it
    assert main([str(p)]) == 2 and "in use by another OpRAG server" in capsys.readouterr().err
    assert p.read_bytes() == bytes(data)
    held.close()
    assert main([str(p), str(d / "nope.log")]) == 2
    out = capsys.readouterr()
    assert f"kept 5 intact records; dropped 1 damaged spans ({offs[3] - offs[2]} bytes" in out.out
    assert "nope.log: no such log file" in out.err
    assert main([str(p)]) == 0 and "intact (5 records); not changed" in capsys.readouterr().out
