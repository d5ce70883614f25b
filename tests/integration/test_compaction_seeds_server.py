"""A background HNSW compaction's dense-minimum seeds are taken between requests and kept in the snapshot (trial47c):
before, they waited for the next query, so a snapshot taken with no query after the compaction kept none for the new
graph, and the restarted shard built other seeds over its final graph at start (HYBRID's min-max scores moved). Real
server, one shard, ``--ann-check 0`` (no check sample: the seeds give the dense minimum), no query before the stop."""

from __future__ import annotations

import time

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)


def _settle(c, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while any(s.ann_pending or s.seeds_pending or s.merge_pending for s in c.stats().shards):
        assert time.monotonic() < deadline, "never settled"
        time.sleep(0.05)


def test_compaction_seeds_survive_a_restart(tmp_path):
    rng = np.random.default_rng(13)
    V = rng.standard_normal((3200, 384)).astype(np.float32)
    args = ("--generator", "none", "--shards", "1", "--dense-index", "hnsw", "--hnsw-m", "8", "--ef-construction",
            "16", "--ann-check", "0", "--hnsw-layout-min", "0")
    log = tmp_path / "server.log"
    srv = ServerProcess.on_free_ports(tmp_path, *args, log_path=log)
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            c.ingest([Doc(f"d{i}", f"w{i % 23} text", vector=V[i].tolist()) for i in range(3200)])
            c.delete([f"d{i}" for i in range(0, 3200, 3)])  # (a third dead: a compaction in the background)
            deadline = time.monotonic() + 60
            while "HNSW graph compacted" not in log.read_text():
                assert time.monotonic() < deadline, "no compaction"
                time.sleep(0.1)
            _settle(c)
            time.sleep(0.5)  # (the idle step that takes the seeds)
    finally:
        srv.stop()  # (SIGTERM: a snapshot, no query since the compaction)
    log2 = tmp_path / "server2.log"
    srv = ServerProcess.on_free_ports(tmp_path, *args, log_path=log2)
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            r = c.retrieve("w3 text", mode="hybrid", top_k=5, query_vector=V[3].tolist())
            assert r.hits and all(int(h.doc_id[1:]) % 3 for h in r.hits)  # (no deleted document)
    finally:
        srv.stop()
    seeds = [ln for ln in log2.read_text().splitlines() if "dense-minimum seeds" in ln]
    assert seeds and all("seeds restored from the snapshot" in ln for ln in seeds), seeds  # (none built anew)
