"""A start that replayed write-ahead log records snapshots them on its first periodic round (trial50 #9: a replay
was not "a change", so no snapshot came, and each later crash replayed the whole, growing log again: 40 MB, then
110 MB per shard). Real server, kill -9 twice: the first restart recovers the acknowledged writes from the log, the
second has nothing left to replay, and every document is there both times. Also: a periodic snapshot that fails
because a shard is down logs one WARNING line, not an ERROR with a traceback (trial50 #7)."""

from __future__ import annotations

import logging
import re
import time
import types

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = pytest.mark.integration
ARGS = ("--generator", "none", "--shards", "1", "--snapshot-interval-s", "1")
DOCS = [Doc(f"lamp{i}", f"Oil lamp {i} lit the lighthouse gallery on stormy nights.") for i in range(6)]


def _recovered(lines: list[str]) -> int:
    got = [int(m[1]) for ln in lines if (m := re.search(r"recovered (\d+) write-ahead log records", ln))]
    return got[0] if got else 0


def test_records_replayed_at_a_start_are_snapshotted_and_not_replayed_again(tmp_path):
    quiet = ServerProcess.on_free_ports(tmp_path / "data", *ARGS[:-1], "3600")  # (no periodic snapshot)
    quiet.start()
    try:
        with OpRAGClient(quiet.target, timeout=60) as c:
            c.ingest(DOCS)
    finally:
        quiet.kill9()  # the ingest is in the write-ahead log only
    srv = ServerProcess.on_free_ports(tmp_path / "data", *ARGS)
    srv.start()
    try:
        first = _recovered(srv.lines)
        time.sleep(3.5)  # the first periodic rounds (every 1 s)
        with OpRAGClient(srv.target, timeout=60) as c:
            assert c.stats().documents == len(DOCS)
    finally:
        srv.kill9()
    srv.start()
    try:
        again = _recovered(srv.lines)
        with OpRAGClient(srv.target, timeout=60) as c:
            assert c.stats().documents == len(DOCS)
            assert {h.doc_id for h in c.retrieve("lighthouse lamp", mode="lexical", top_k=10).hits} == \
                {d.id for d in DOCS}
    finally:
        srv.stop()
    assert first > 0 and again == 0, (first, again)  # the first restart's snapshot holds what it replayed


def test_a_periodic_snapshot_failing_on_a_down_shard_is_one_warning_line(caplog):
    from oprag_server.shards.transport import ShardError, StorageUnavailable
    from oprag_server.supervision import periodic_snapshot_failed

    down = types.SimpleNamespace(down_shards=lambda: [1])
    up = types.SimpleNamespace(down_shards=lambda: [])
    cases = [(down, ShardError("shard 1 is not running"), logging.WARNING, False),
             (up, ShardError("shard 1: disk full"), logging.ERROR, True),  # a running shard's failure
             (down, StorageUnavailable("lease lost"), logging.ERROR, True),
             (down, OSError(28, "No space left on device"), logging.ERROR, True)]
    for pool, exc, level, trace in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="oprag"):
            periodic_snapshot_failed(pool, exc, 30.0)
        (rec,) = caplog.records
        assert rec.levelno == level and (rec.exc_info is not None) == trace, (exc, rec.levelname, rec.exc_info)
        assert str(exc) in rec.getMessage() or trace
