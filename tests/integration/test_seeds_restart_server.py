"""trial45 #1 on a real server (2 shard processes, HNSW, a check sample far smaller than a shard, so
HYBRID's dense minimum comes from the seeds' walk): the seeds are built by the first queries, the
corpus then grows (less than 2x) and loses some documents, and a SIGTERM restart on the same data
dir must give every HYBRID reply as before it, fused scores included; the seeds come back from the
snapshot (index/low_seeds_state.py) instead of being built anew over the whole graph."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)

D = 384


def _key(r):
    return [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in r.hits]


def test_hybrid_replies_survive_a_restart_after_writes(tmp_path):
    rng = np.random.default_rng(45)
    axis = rng.standard_normal(D).astype(np.float32)
    vecs = axis + 2.5 * rng.standard_normal((7000, D)).astype(np.float32)  # a cone: the minimum is an outlier's
    out = rng.random(7000) < 0.02
    vecs[out] = rng.standard_normal((int(out.sum()), D)).astype(np.float32) * 3
    words = [f"w{i}" for i in range(400)]
    docs = [Doc(f"d{i:05d}", " ".join(rng.choice(words, 8)), vector=vecs[i]) for i in range(7000)]
    queries = [(" ".join(rng.choice(words, 2)), (axis + 2.0 * rng.standard_normal(D)).astype(np.float32))
               for _ in range(40)] + [(" ".join(rng.choice(words, 2)), rng.standard_normal(D).astype(np.float32))
                                      for _ in range(40)]
    args = ("--generator", "none", "--shards", "2", "--dense-index", "hnsw", "--ann-check", "300", "--ann-tail", "0")
    srv = ServerProcess.on_free_ports(tmp_path, *args).start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs[:4000])
            for text, q in queries[:4]:  # the seeds: built here, at ~2,000 vectors a shard
                c.retrieve(text, top_k=10, query_vector=q.tolist())
            c.ingest(docs[4000:])  # (< 2x: the seeds are extended, not rebuilt)
            c.delete([f"d{i:05d}" for i in range(0, 3000, 9)])
            before = [_key(c.retrieve(t, top_k=10, query_vector=q.tolist())) for t, q in queries]
    finally:
        srv.stop()  # SIGTERM: a final snapshot
    srv = ServerProcess.on_free_ports(tmp_path, *args).start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            after = [_key(c.retrieve(t, top_k=10, query_vector=q.tolist())) for t, q in queries]
    finally:
        srv.stop()
    assert sum(a != b for a, b in zip(after, before)) == 0
