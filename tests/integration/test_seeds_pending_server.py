"""``Stats``' ``seeds_pending`` on a real server: after an HNSW shard's graph doubled (from 8,192 vectors) the shard
starts a thread that makes new dense-minimum seeds and takes them, both between requests, so ``seeds_pending`` reads
the graph's size and returns to 0 with no query (trial46 #1: it read 0 until a query came), and the shard logs the
seeds "by a thread"."""

from __future__ import annotations

import time

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)


def test_seeds_pending_settles_without_a_query(tmp_path):
    rng = np.random.default_rng(5)
    V = rng.standard_normal((17000, 384)).astype(np.float32)
    docs = [Doc(f"s{i}", f"word{i % 7} note", vector=V[i].tolist()) for i in range(len(V))]
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "1", "--dense-index", "hnsw",
                                      "--hnsw-m", "8", "--ef-construction", "16", "--ann-tail", "0",
                                      "--ann-check", "1000", log_path=tmp_path / "server.log")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            c.ingest(docs[:8300])
            c.retrieve("word1", mode="hybrid", top_k=3, query_vector=V[1].tolist())  # (seeds for 8,300: a thread)
            first = _settled(c)
            c.ingest(docs[8300:])  # (the graph doubled: the shard starts the thread between requests, no query)
            second = _settled(c)
    finally:
        srv.stop()
    assert set(first) <= {0, 8300} and set(second) <= {0, 17000}, (first, second)
    log = (tmp_path / "server.log").read_text()
    for n in (8300, 17000):
        assert f"seeds built for a graph of {n} vectors (deleted ones included)" in log


def _settled(c, limit_s: float = 60.0) -> list[int]:
    """``seeds_pending`` polled with no query until it reads 0 (asserted within ``limit_s``): every value seen."""
    seen, deadline = [], time.monotonic() + limit_s
    while time.monotonic() < deadline:
        seen.append(c.stats().shards[0].seeds_pending)
        if seen[-1] == 0:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"seeds_pending never settled: {seen[:3]} ... {seen[-3:]}")
