"""Damaged, deleted and rolled-back logs at a start (trial55b's open findings): a real server on loopback ports,
real shard processes. Each refusal must leave the files as it found them and name what to do; the operator's way
past a damaged span (``oprag salvage-log``) must not let a committed write go missing silently."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess
from oprag_server.index.wal import read_records

ARGS = ("--generator", "none", "--shards", "2", "--snapshot-interval-s", "3600")


def _three_writes(d):
    """Three committed ingests (sequence numbers 1, 2, 3) held only by the logs (the server is killed)."""
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    with OpRAGClient(srv.target) as c:
        for k in "abc":
            c.ingest([Doc(id=f"{k}{i}", text=f"note {k} about lobster {i} and kelp") for i in range(6)])
    srv.kill9()


def _flip_in_first_record(p):
    data = bytearray(p.read_bytes())
    n = struct.unpack_from("<I", data, 0)[0]
    assert len(data) > 8 + n + 8  # records follow the first one
    data[8 + n // 2] ^= 0x5A
    p.write_bytes(bytes(data))
    return bytes(data)


def _docs(d) -> int:
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    try:
        with OpRAGClient(srv.target) as c:
            return c.stats().documents
    finally:
        srv.stop()


def test_a_damaged_shard_log_is_refused_untouched_and_salvage_does_not_hide_a_lost_write(tmp_path):
    d = tmp_path / "data"
    _three_writes(d)
    wal = d / "shard-0" / "wal.log"
    damaged = _flip_in_first_record(wal)  # the prepare record of the first write
    with pytest.raises(RuntimeError, match=r"wal\.log: bytes 0-\d+ of \d+ are damaged .* 2 intact records follow"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    assert wal.read_bytes() == damaged  # (before: truncated to 0 bytes, and the later writes were gone)
    out = subprocess.run([sys.executable, "-c", "import sys; from oprag_server.salvage import main; "
                          "sys.exit(main(sys.argv[1:]))", str(wal)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kept 2 intact records" in out.stdout and (d / "shard-0" / "wal.log.damaged").read_bytes() == damaged
    # the lost record was a committed write: the start says so instead of serving without it
    with pytest.raises(RuntimeError, match=r"committed transactions \[1\] \(1\) are not in this log"):
        ServerProcess.on_free_ports(d, *ARGS).start()


def _salvage(*args) -> str:
    out = subprocess.run([sys.executable, "-c", "import sys; from oprag_server.salvage import main; "
                          "sys.exit(main(sys.argv[1:]))", *map(str, args)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout



def test_a_damaged_emptied_or_deleted_commit_log_is_refused_and_salvage_restores_what_the_shard_logs_prove(tmp_path):
    """trial55b, trial56 F1-F3: a commit log damaged mid-file was cut there, a damaged last record was dropped as a
    crash's torn tail, and an emptied, deleted or salvaged one served without the writes the shards' logs held."""
    d = tmp_path / "data"
    _three_writes(d)
    log = d / "commits.log"
    good = log.read_bytes()
    damaged = _flip_in_first_record(log)
    with pytest.raises(RuntimeError, match=r"commits\.log: bytes 0-\d+ of \d+ are damaged"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    assert log.read_bytes() == damaged
    data = bytearray(good)
    data[-5] ^= 0x22  # inside the last commit record (sequence 3): written whole, damaged after
    log.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"commits\.log: its last record \(\d+ bytes\) is damaged, and it is the whole "
                                           r"commit record of transaction \w+ \(sequence 3\)"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    assert log.read_bytes() == bytes(data)
    out = _salvage(log)
    assert "restored the commit record of the last prepared transaction" in out and log.read_bytes() == good
    log.write_bytes(b"")  # emptied: the shards prepared 1 and 2 before 3, so their records were lost
    with pytest.raises(RuntimeError, match=r"wal\.log: this log prepared sequence numbers \[1, 2\] \(2\) before later "
                                           r"ones \(up to 3\), but the commit log holds no commit record for them"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    out = _salvage(log)  # 1 and 2 are proven; 3, the last, is not (a crash may have cut it short): left out, said
    assert "restored 2 commit records" in out and "left out the last prepared transaction" in out
    assert [r["seq"] for r in read_records(log)[0]] == [1, 2]
    log.unlink()  # (before: an empty log was created and the three writes were dropped as uncommitted)
    with pytest.raises(RuntimeError, match=r"commits\.log is missing, but the shards' write-ahead logs hold prepared"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    assert not log.exists()
    assert "restored the commit record of the last prepared transaction" in _salvage(log, "--with-last")
    assert [r["seq"] for r in read_records(log)[0]] == [1, 2, 3]
    assert _docs(d) == 18


@pytest.mark.slow  # (5 starts, ~25 s: in `make test-all`; the rule's unit test, test_commit.py, is in the default suite)
def test_an_older_shard_directory_put_back_is_refused(tmp_path):
    d, old = tmp_path / "data", tmp_path / "backup"
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    with OpRAGClient(srv.target) as c:
        c.ingest([Doc(id=f"a{i}", text=f"first kelp note {i}") for i in range(8)])
    assert srv.stop() == 0  # a snapshot of each shard at sequence 1; the commit log keeps that as its base
    shutil.copytree(d, old)
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    with OpRAGClient(srv.target) as c:
        c.ingest([Doc(id=f"b{i}", text=f"second kelp note {i}") for i in range(8)])
    assert srv.stop() == 0  # sequence 2
    live = tmp_path / "live"
    shutil.copytree(d, live)
    for i in (0, 1):  # both shards rolled back, the commit log kept: every shard agrees, only the base tells
        shutil.rmtree(d / f"shard-{i}")
        shutil.copytree(old / f"shard-{i}", d / f"shard-{i}")
    with pytest.raises(RuntimeError, match=r"shard 0 recovered up to sequence 1; shard 1 recovered up to sequence 1, "
                                           r"but the commit log holds committed transactions up to 2 .*older snapshot"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    shutil.rmtree(d / "shard-1")  # one shard rolled back: the other one tells
    shutil.copytree(live / "shard-1", d / "shard-1")
    with pytest.raises(RuntimeError, match=r"shard 0 recovered up to sequence 1"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    shutil.rmtree(d)  # the whole backup put back, commit log included: a consistent older corpus, served
    shutil.copytree(old, d)
    assert _docs(d) == 8
