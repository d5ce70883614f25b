"""The HNSW beam of a hybrid request on a real server (``--hybrid-ef-search``, shards/beams.py): a query whose
terms occur in the shards searches with the hybrid beam, one whose terms occur nowhere (its ranking is the dense
side's alone) and a dense request with ``--ef-search``, and a request's own ``ef_search`` wins."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = pytest.mark.integration


def test_hybrid_beam_follows_the_lexical_evidence(tmp_path):
    rng = np.random.default_rng(11)
    V = rng.standard_normal((400, 384))
    words = ["harbour", "lantern", "meadow", "quarry"]
    docs = [Doc(f"b{i}", f"{words[i % 4]} note {i}", vector=V[i].tolist()) for i in range(400)]
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2", "--dense-index", "hnsw",
                                      "--ann-check", "0", "--ef-search", "500", "--hybrid-ef-search", "400")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            q = (V[9] + 0.1 * rng.standard_normal(384)).tolist()
            hyb = c.retrieve("lantern", mode="hybrid", top_k=5, query_vector=q)
            assert (hyb.retrieval.dense_index, hyb.retrieval.ef_search) == ("hnsw", 400)
            none = c.retrieve("zqxwv", mode="hybrid", top_k=5, query_vector=q)  # no shard holds the term
            assert none.retrieval.ef_search == 500
            assert c.retrieve("lantern", mode="dense", top_k=5, query_vector=q).retrieval.ef_search == 500
            assert c.retrieve("lantern", mode="hybrid", top_k=5, query_vector=q, ef_search=450).retrieval.ef_search == 450
            exact = c.retrieve("lantern", mode="full_hybrid", top_k=5, query_vector=q)
            assert [h.chunk_id for h in hyb.hits] == [h.chunk_id for h in exact.hits]
            assert [h.chunk_id for h in none.hits] == [h.chunk_id for h in
                                                        c.retrieve("zqxwv", mode="full_hybrid", top_k=5, query_vector=q).hits]
    finally:
        srv.stop()
