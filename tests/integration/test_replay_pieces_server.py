"""A ``kill -9`` and a log replay link deferred HNSW vectors as the shard before did (index/ann.py
``insert_pending``'s pieces, trial47 #3): the shard inserted an ingest's deferred vectors between requests, in steps
cut by when requests came, and FAISS inserts each ``add`` call's batch in an order of its own, so the replay (other
steps) built another graph and 31 of 246 of the helper's probe queries answered otherwise. Real server, real shard
process, no snapshot (the replay rebuilds everything from the log); approximate settings, where a graph's
differences show in DENSE top-20s."""

from __future__ import annotations

import time

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)


def _settle(c, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while any(s.ann_pending or s.seeds_pending for s in c.stats().shards):
        assert time.monotonic() < deadline, "deferred HNSW inserts never settled"
        time.sleep(0.05)


def _answers(c, Q) -> list:
    return [[(h.chunk_id, round(h.score, 9)) for h in c.retrieve("x", mode="dense", top_k=20,
                                                               query_vector=q.tolist()).hits] for q in Q]


def test_replay_after_kill9_links_as_before(tmp_path):
    rng = np.random.default_rng(11)
    centers = rng.standard_normal((40, 384))
    V = (centers[rng.integers(0, 40, 1500)] + 0.7 * rng.standard_normal((1500, 384))).astype(np.float32)
    Q = (centers[rng.integers(0, 40, 60)] + 0.7 * rng.standard_normal((60, 384))).astype(np.float32)
    args = ("--generator", "none", "--shards", "1", "--dense-index", "hnsw", "--hnsw-m", "8", "--ef-construction",
            "16", "--ef-search", "40", "--ann-check", "0", "--snapshot-interval-s", "3600")
    srv = ServerProcess.on_free_ports(tmp_path, *args, log_path=tmp_path / "server.log")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            for a in range(0, 1500, 50):  # 30 writes, the shard catching up between them in steps of its own
                c.ingest([Doc(f"d{i}", f"w{i % 17} text", vector=V[i].tolist()) for i in range(a, a + 50)])
                time.sleep(0.03)
            _settle(c)
            before = _answers(c, Q)
    finally:
        srv.kill9()
    srv = ServerProcess.on_free_ports(tmp_path, *args, log_path=tmp_path / "server2.log")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            assert c.stats().chunks == 1500
            _settle(c)
            assert _answers(c, Q) == before
    finally:
        srv.stop()
