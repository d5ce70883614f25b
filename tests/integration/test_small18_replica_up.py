"""``oprag_shard_replica_up{shard, replica}`` on a real ``--shards 2 --replicas 2`` server: 1 for
every replica once it serves; a SIGKILLed replica process reads 0 (while ``oprag_shards_up``
still counts its shard: the sibling serves), and 1 again once the supervisor has caught it up.
Before small18 only ``oprag_shards_up`` existed, which cannot tell a degraded shard from a whole one."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oprag_client.client import OpRAGClient
from oprag_client.testing import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))
from test_replicas_server import _replicas, start_replicated  # noqa: E402

pytestmark = pytest.mark.integration


def _scrape(srv: ServerProcess) -> dict[str, dict[tuple, float]]:
    """``{metric name: {sorted label items: value}}`` of the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    return {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples} for f in text_string_to_metric_families(text)}


def _replica_up(srv: ServerProcess) -> tuple[dict[tuple[int, int], float], float]:
    m = _scrape(srv)
    up = {(int(dict(k)["shard"]), int(dict(k)["replica"])): v for k, v in m.get("oprag_shard_replica_up", {}).items()}
    return up, m["oprag_shards_up"][()]


def _until(srv: ServerProcess, want: dict[tuple[int, int], float], timeout: float = 120.0) -> float:
    """Poll /metrics every 50 ms until the replica gauges read ``want``. :returns: oprag_shards_up then."""
    t, got = time.monotonic(), None
    while time.monotonic() - t < timeout:
        got, shards_up = _replica_up(srv)
        if got == want:
            return shards_up
        time.sleep(0.05)
    raise AssertionError(f"oprag_shard_replica_up never read {want}; last {got}")


def test_replica_gauge_follows_a_killed_replica(tmp_path):
    srv, data, pids = start_replicated(tmp_path, 8)
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            every = {(s, r): 1.0 for s in range(2) for r in range(2)}
            assert _until(srv, every) == 2
            os.kill(pids[(1, 1)], signal.SIGKILL)
            # down: 0 for that replica alone, and the shard still counts as up (its sibling serves)
            assert _until(srv, {**every, (1, 1): 0.0}, timeout=30) == 2
            assert len(c.retrieve("harbour high water", mode="full_hybrid", top_k=8).hits) == 8
            # revived by the supervisor (snapshot of the sibling, replay): 1 again, in a new process
            assert _until(srv, every) == 2
            assert _replicas(srv.proc.pid, data)[(1, 1)] != pids[(1, 1)]
            assert any("shard 1 replica 1 caught up" in line for line in srv.lines)
    finally:
        srv.stop()

