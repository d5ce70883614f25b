"""A start refused over a damaged snapshot file leaves the commit log as it found it (trial55b #1): the frontend's
close() snapshotted the shards that had started and emptied ``commits.log``, so the start after the operator's repair
dropped committed transactions that only the write-ahead logs held."""

from __future__ import annotations

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

ARGS = ("--generator", "none", "--shards", "2", "--snapshot-interval-s", "3600")


def test_a_refused_start_keeps_the_commit_log_and_the_repaired_start_has_every_write(tmp_path):
    d = tmp_path / "data"
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    with OpRAGClient(srv.target) as c:
        c.ingest([Doc(id=f"a{i}", text=f"first lobster note {i}") for i in range(12)])
    assert srv.stop() == 0  # (a snapshot of each shard; the commit log emptied: nothing left to recover)
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    with OpRAGClient(srv.target) as c:
        c.ingest([Doc(id=f"b{i}", text=f"second lobster note {i}") for i in range(6)])  # only in the logs
    srv.kill9()
    commits = (d / "commits.log").read_bytes()
    assert commits
    shard = d / "shard-0"
    snap = shard / (shard / "CURRENT").read_text().strip()
    (snap / "chunks.arrow").rename(tmp_path / "aside.arrow")
    with pytest.raises(RuntimeError, match="chunks.arrow"):
        ServerProcess.on_free_ports(d, *ARGS).start()
    assert (d / "commits.log").read_bytes() == commits
    (tmp_path / "aside.arrow").rename(snap / "chunks.arrow")
    srv = ServerProcess.on_free_ports(d, *ARGS).start()
    try:
        with OpRAGClient(srv.target) as c:
            assert c.stats().documents == 18
    finally:
        srv.stop()
