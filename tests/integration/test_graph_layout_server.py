"""An HNSW shard's graph renumbered for locality on a real server (index/graph_layout.py, session 47): once writes are
quiet the shard renumbers it between requests and logs it; every reply (hits, scores) is the same before and after,
and after a restart (the snapshot keeps ``laid_at``: not renumbered again at that size); a later ingest and delete
work on the renumbered graph."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)

LINE = "HNSW graph renumbered for locality"


def _replies(c, V, words) -> list:
    out = []
    for i, mode in ((3, "hybrid"), (40, "dense"), (41, "hybrid"), (900, "dense"), (1234, "hybrid"), (2500, "hybrid"),
                    (5, "full_hybrid"), (77, "lexical"), (1500, "full_hybrid")):  # (full_hybrid: trial47 #1)
        r = c.retrieve(words[i % len(words)], mode=mode, top_k=10, query_vector=V[i].tolist())
        out.append([(h.chunk_id, round(h.score, 9)) for h in r.hits])
    return out


def _wait_for(path, count: int, limit_s: float = 60.0) -> str:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        log = path.read_text()
        if log.count(LINE) >= count:
            return log
        time.sleep(0.1)
    raise AssertionError(f"no {count} x {LINE!r} in the log within {limit_s} s")


def test_graph_renumbered_between_requests(tmp_path):
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((30, 384))
    V = (centers[rng.integers(0, 30, 3000)] + 0.5 * rng.standard_normal((3000, 384))).astype(np.float32)
    words = [f"alpha{i % 13} beta{i % 29}" for i in range(3000)]
    docs = [Doc(f"d{i}", f"{words[i]} gamma", vector=V[i].tolist()) for i in range(len(V))]
    args = ("--generator", "none", "--shards", "2", "--dense-index", "hnsw", "--hnsw-m", "8", "--ef-construction", "32",
            "--ann-tail", "0", "--hnsw-layout-min", "1000")
    log = tmp_path / "server.log"
    srv = ServerProcess.on_free_ports(tmp_path, *args, log_path=log)
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            c.ingest(docs)
            before = _replies(c, V, words)  # (within the quiet time after the ingest: not renumbered yet)
            assert LINE not in log.read_text()
            text = _wait_for(log, 2)  # both shards, each ~1,500 vectors
            sizes = [int(n) for n in re.findall(LINE + r": (\d+) vectors", text)]
            assert len(sizes) == 2 and sum(sizes) == 3000, sizes  # (each shard its own graph, once)
            assert _replies(c, V, words) == before
    finally:
        srv.stop()
    saved = []  # the snapshots the stop wrote keep each graph's size at its renumbering
    for shard in sorted(tmp_path.glob("shard-*")):
        with np.load(max(shard.glob("snap-*")) / "dense.npz") as z:
            saved.append(int(z["laid_at"]))
    assert sorted(saved) == sorted(sizes)
    srv = ServerProcess.on_free_ports(tmp_path, *args, log_path=tmp_path / "server2.log")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            assert _replies(c, V, words) == before
            c.delete([f"d{i}" for i in range(0, 3000, 3)])
            more = [Doc(f"e{i}", f"alpha{i % 13} delta", vector=(V[i] + 0.1).tolist()) for i in range(500)]
            c.ingest(more)
            r = c.retrieve("alpha3 delta", mode="hybrid", top_k=50, query_vector=(V[3] + 0.1).tolist())
            ids = [h.doc_id for h in r.hits]
            assert ids[0] == "e3" and not any(d.startswith("d") and int(d[1:]) % 3 == 0 for d in ids)
    finally:
        srv.stop()
