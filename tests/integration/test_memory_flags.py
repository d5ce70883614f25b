"""Session-memory retention set from the command line (trial52b: the record budget and the idle TTL had no
flag, so eviction could only be watched in process): ``--memory-max-turns``, ``--memory-max-records`` and
``--memory-ttl-s`` on a real server (one shard process, no generator), read back through ``Stats`` and
``ClearSession``; and the checks that refuse a bad value before the server starts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port
from oprag_server.cli import build_parser, config_from_args
from oprag_server.config import MemoryConfig

pytestmark = pytest.mark.integration
DOCS = [Doc(f"d{i}", f"Report {i} on the migration of arctic terns along coast number {i}.") for i in range(6)]
TTL_S = 6.0


def test_the_flags_reach_the_config_and_bad_values_are_named():
    cfg = config_from_args(build_parser().parse_args(
        ["--memory-max-turns", "3", "--memory-ttl-s", "0", "--memory-max-records", "10"]))
    assert (cfg.memory.max_turns_per_session, cfg.memory.ttl_s, cfg.memory.max_records_total) == (3, 0.0, 10)
    assert (MemoryConfig().max_turns_per_session, MemoryConfig().ttl_s, MemoryConfig().max_records_total) == (
        32, 86400.0, 200_000)
    for kw, words in (({"max_turns_per_session": 0}, "--memory-max-turns must be between 1 and 2147483647, got 0"),
                      ({"max_turns_per_session": 10**23}, "--memory-max-turns must be between 1 and 2147483647"),
                      ({"ttl_s": -1.0}, "--memory-ttl-s must be between 0 and 10000000000, got -1.0"),
                      ({"ttl_s": float("nan")}, "--memory-ttl-s must be between 0 and 10000000000, got nan"),
                      ({"ttl_s": float("inf")}, "--memory-ttl-s must be between 0 and 10000000000, got inf"),
                      ({"ttl_s": 1e-300}, "--memory-ttl-s must be 0 (never) or at least 1 second"),  # (trial53 #4)
                      ({"max_records_total": 0}, "--memory-max-records must be between 1 and 2147483647, got 0"),
                      ({"condense_tokens": 0}, "--memory-condense-tokens must be between 1"),
                      ({"condense_timeout_s": 0.0}, "--memory-condense-timeout-s must be between 0.001")):
        with pytest.raises(ValueError) as ei:
            MemoryConfig(**kw)
        assert words in str(ei.value), (kw, str(ei.value))
    # the serve command refuses it with the message and exit status 2, before it loads anything
    out = subprocess.run([sys.executable, "-m", "oprag_server", "--generator", "none", "--memory-max-records", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--memory-max-records must be between 1 and 2147483647, got 0" in out.stderr, out.stderr


def _turns(c: OpRAGClient) -> None:
    """Three turns in session "a" (with ``--memory-max-turns 2`` the third drops its oldest), then two each in "b"
    and "c"."""
    for i in range(3):
        c.retrieve(f"arctic tern migration {i}", session_id="a")
    assert c.stats().memory_records == 2
    for sid in ("b", "c"):
        for i in range(2):
            c.retrieve(f"coast number {i}", session_id=sid)


def test_turns_budget_and_idle_ttl_from_the_flags(tmp_path):
    srv = ServerProcess(tmp_path / "data", free_port(), free_port(), "--generator", "none", "--shards", "1",
                        "--memory-max-turns", "2", "--memory-max-records", "5", "--memory-ttl-s", f"{TTL_S:g}").start()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest(DOCS)
            t0 = time.monotonic()
            _turns(c)  # 6 records over a budget of 5: "a", the least recently active, loses its oldest
            assert c.stats().memory_records == 5
            assert c.clear_session("a").records_removed == 1
            assert time.monotonic() - t0 < TTL_S, "too slow a machine for the TTL below"
            time.sleep(TTL_S + 0.5)
            # the next recorded turn drops the idle sessions, its own session's expired turns too (trial53 #1)
            c.retrieve("tern report", session_id="b")
            assert c.stats().memory_records == 1
            assert [c.clear_session(s).records_removed for s in ("a", "b", "c")] == [0, 1, 0]
    finally:
        srv.stop()


def test_without_the_budget_flag_the_same_turns_are_all_kept(tmp_path):
    """The control: the same seven turns at the default budget keep every record but the one the per-session limit
    drops, so the figures above come from the flags."""
    srv = ServerProcess(tmp_path / "data", free_port(), free_port(), "--generator", "none", "--shards", "1",
                        "--memory-max-turns", "2").start()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest(DOCS)
            _turns(c)
            assert c.stats().memory_records == 6
            assert [c.clear_session(s).records_removed for s in ("a", "b", "c")] == [2, 2, 2]
    finally:
        srv.stop()
