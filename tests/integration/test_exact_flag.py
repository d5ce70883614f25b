"""trial41 #2: a certified HYBRID reply from an IVF / HNSW shard searched through its index is the bound's verdict over
approximate lists, not a proof (9 of 40 IVF replies differed from FULL_HYBRID's at the default nprobe), and users read
`certified` as "exact". `RetrievalInfo.exact` says whether the hits are the mode's exact ranking: false whenever a
shard's dense list came from the index, true for FULL_HYBRID, LEXICAL, and a certified top-k no index produced (here a
filtered query: the shard scans the chunks the filter allows). A real server (HNSW, --ann-check 0: every unfiltered
list from the graph) over gRPC; its exact replies are checked against FULL_HYBRID's."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient

from tests.integration.test_dense_index import graph_server

pytestmark = pytest.mark.integration


def test_exact_says_whether_an_index_picked_the_dense_candidates(tmp_path):
    rng = np.random.default_rng(41)
    V = rng.standard_normal((240, 384)).astype(np.float32)
    docs = [Doc(f"x{i}", f"note {i} about topic {i % 4} and more", metadata={"grp": i % 3}, vector=V[i].tolist())
            for i in range(240)]
    with graph_server(tmp_path) as srv:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            q = V[5].tolist()
            hyb = c.retrieve("topic 1", top_k=5, query_vector=q)
            assert hyb.retrieval.ef_search > 0 and not hyb.retrieval.exact  # the graph picked them: not a proof
            dense = c.retrieve("topic 1", mode="dense", top_k=5, query_vector=q)
            assert dense.retrieval.ef_search > 0 and not dense.retrieval.exact
            for mode in ("full_hybrid", "lexical"):
                assert c.retrieve("topic 1", mode=mode, top_k=5, query_vector=q).retrieval.exact
            flt = {"grp": [0, 2]}
            fh = c.retrieve("topic 1", top_k=5, query_vector=q, filters=flt)
            full = c.retrieve("topic 1", mode="full_hybrid", top_k=5, query_vector=q, filters=flt)
            assert fh.retrieval.ef_search == 0 and fh.retrieval.certified and fh.retrieval.exact
            assert [(h.chunk_id, h.score) for h in fh.hits] == [(h.chunk_id, h.score) for h in full.hits]
