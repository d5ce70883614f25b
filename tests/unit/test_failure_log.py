"""A repeated best-effort failure (a memory promotion while the store refuses writes) logs a few lines, not one per
request (trial57: 480 WARNINGs in a few minutes)."""

from __future__ import annotations

import logging

from oprag_server.engine import failures
from oprag_server.engine.failures import FailureLog


def test_one_warning_a_period_with_the_count_left_out_and_one_line_when_it_works_again(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.INFO, logger="oprag")
    f = FailureLog("memory promotion", period_s=60.0)
    for i in range(250):  # 250 failures over 125 s
        f.failed(OSError(f"disk full {i}"))
        now[0] += 0.5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["memory promotion failed: disk full 0", "memory promotion failed: disk full 120 (119 more since "
                     "the last such line)", "memory promotion failed: disk full 240 (119 more since the last such line)"]
    f.ok()
    f.ok()  # (nothing more: it was already working)
    assert [r.getMessage() for r in caplog.records][3:] == ["memory promotion succeeds again (after 250 failures)"]
    f.failed(OSError("again"))  # a new failure after a success: logged at once
    assert caplog.records[-1].getMessage() == "memory promotion failed: again"


def test_a_shard_s_failed_object_storage_write_is_not_called_a_restart():
    """trial57: ClearSession while the store refused writes got "a shard is unavailable (it is being restarted)"."""
    import grpc

    from oprag_server.service.interceptors import status_for
    from oprag_server.shards.transport import ShardError

    code, msg, _ = status_for(ShardError("shard 0: StorageWriteError: object storage write failed: file:///s/wal/"
                                         "00000000000000000971.rec: [Errno 28] No space left on device"), "ClearSession")
    assert code == grpc.StatusCode.UNAVAILABLE and "being restarted" not in msg
    assert msg.startswith("a shard could not write to the --storage-uri object storage: shard 0:")
    assert "being restarted" in status_for(ShardError("shard 1: down"), "ClearSession")[1]
