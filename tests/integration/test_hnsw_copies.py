"""trial26: an HNSW server whose corpus holds many identical chunks (boilerplate) returned `DENSE`
top-10s made only of the boilerplate, whatever ``ef_search`` (index/ann_copies.py,
index/ann_escape.py). A real server with the HNSW index, supplied vectors (150 clustered
documents, then 300 copies of one boilerplate document with one vector): hits checked by score
against the exact inner products, and tied copies against exact mode's order (chunk id)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = pytest.mark.integration


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def test_dense_hits_are_not_trapped_in_boilerplate(tmp_path) -> None:
    rng = np.random.default_rng(26)
    centers = _unit(rng.standard_normal((10, 384)))
    real = _unit(centers[rng.integers(0, 10, 150)] + 0.15 * rng.standard_normal((150, 384)))
    boiler = _unit(rng.standard_normal(384))
    queries = _unit(real[:30] + 0.25 * rng.standard_normal((30, 384)))
    vecs = np.concatenate([real, np.repeat(boiler[None], 300, axis=0)]).astype(np.float64)
    srv = ServerProcess.on_free_ports(tmp_path / "d", "--generator", "none", "--dense-index", "hnsw",
                                      "--ann-tail", "0").start()
    try:
        with OpRAGClient(srv.target) as c:
            c.ingest([Doc(f"r{i:03d}", f"paper {i} on topic {i % 10}", vector=real[i]) for i in range(150)])
            order = rng.permutation(300)  # (not in id order: the lowest ids are not the first inserted)
            c.ingest([Doc(f"b{i:03d}", "This site uses cookies. Accept to continue.", vector=boiler) for i in order])
            got = []
            for q in queries:
                for ef in (0, 4096):  # the default beam and a wide one: neither escaped the group before
                    hits = c.retrieve("topic", mode="dense", top_k=10, query_vector=q.tolist(), ef_search=ef).hits
                    kth = np.sort(vecs @ q.astype(np.float64))[-10]
                    got.append(sum(h.score >= kth - 1e-6 for h in hits) / 10)
            # the boilerplate's own vector: ten of its 300 tied copies, the ones exact mode ranks first
            want = c.retrieve("cookies", mode="full_hybrid", dense_weight=1.0, lexical_weight=0.0, top_k=10,
                              query_vector=boiler.tolist()).hits
            hits = c.retrieve("cookies", mode="dense", top_k=10, query_vector=boiler.tolist()).hits
            assert [h.chunk_id for h in hits] == [h.chunk_id for h in want]
            c.delete([h.doc_id for h in want[:3]])  # the first three gone: the next three copies come up
            want = c.retrieve("cookies", mode="full_hybrid", dense_weight=1.0, lexical_weight=0.0, top_k=10,
                              query_vector=boiler.tolist()).hits
            hits = c.retrieve("cookies", mode="dense", top_k=10, query_vector=boiler.tolist()).hits
            assert [h.chunk_id for h in hits] == [h.chunk_id for h in want]
    finally:
        srv.stop()
    assert np.mean(got) >= 0.95, np.mean(got)


def test_a_shard_of_copies_only_restarts(tmp_path) -> None:
    """A shard whose chunks all share one text (one linked vector, the rest copies) is saved and
    served again after a restart, every copy still found."""
    v = _unit(np.random.default_rng(7).standard_normal(384))
    srv = ServerProcess.on_free_ports(tmp_path / "d", "--generator", "none", "--dense-index", "hnsw", "--shards", "1",
                                      "--ann-tail", "0").start()
    try:
        with OpRAGClient(srv.target) as c:
            c.ingest([Doc(f"c{i:02d}", "Cookie notice.", vector=v) for i in range(20)])
        srv.stop()
        srv.start()
        with OpRAGClient(srv.target) as c:
            hits = c.retrieve("cookie", mode="dense", top_k=20, query_vector=v.tolist()).hits
            assert sorted(h.doc_id for h in hits) == [f"c{i:02d}" for i in range(20)]
    finally:
        srv.stop()
