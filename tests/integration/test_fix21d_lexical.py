"""fix21d: LEXICAL mode lists only chunks whose BM25 score is not 0, in both shard modes.

A new user ingested two documents and asked ``retrieve("FOXES", mode="lexical")``: "fox" is in
one of the two chunks, so its idf is log((2 - 1 + 0.5) / (1 + 0.5)) = 0 exactly (rank_bm25
floors only a *negative* idf at epsilon x the average), the chunk's BM25 score is 0, and the
README (lexical ranks) says such a chunk "is not in the list". LEXICAL mode returned it as its
one hit (``lexical_score`` 0.0, ``lexical_rank`` 0): the shard's LEXICAL candidates were every
chunk containing a query term, score 0 included.
"""

from __future__ import annotations

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration]

F1 = "The fox runs quickly through the forest. Foxes eat berries and mice."
F2 = "Rabbits are running in fields of clover near the river."


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_lexical_mode_leaves_out_chunks_whose_bm25_score_is_zero(tmp_path, workers):
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "2",
                                      "--shard-workers", workers, "--stem")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest([Doc("f1", F1), Doc("f2", F2)])
            # "fox": in 1 of 2 chunks, idf exactly 0: no chunk is in the BM25 list
            assert [h.doc_id for h in c.retrieve("FOXES", mode="lexical", top_k=5).hits] == []
            # a term of neither chunk: nothing either
            assert list(c.retrieve("zebra", mode="lexical", top_k=5).hits) == []
            c.ingest([Doc("f3", "Owls hunt at night over the meadow."), Doc("f4", "Bees make honey in hives.")])
            # 1 of 4 chunks: idf log(3.5 / 1.5) > 0, the one chunk is listed, rank 1
            hits = c.retrieve("FOXES", mode="lexical", top_k=5).hits
            assert [h.doc_id for h in hits] == ["f1"]
            assert hits[0].lexical_score > 0 and hits[0].lexical_rank == 1
    finally:
        srv.stop()
