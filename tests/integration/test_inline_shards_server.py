"""``--shard-workers inline`` served (shards/inline.py): a real server whose shard 0 lives in the
server process (its one-query reads on the event loop) and shard 1 in a process answers every
mode, a filter, concurrent requests (batched: shard 0's batches on its thread) and a restart with
the hits of a ``process`` server holding the same documents; writes (a replace, a delete) between
reads are seen by the next read."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)

WORDS = ("harbour lighthouse keeper storm tide vessel anchor rope gull cliff lantern fog signal wreck "
         "island current sail mast chart compass beacon pier net fisher").split()


def _docs(rng, n=40):
    out = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(8, 30))).tolist()
        out.append(Doc(f"d{i:02d}", " ".join(words).capitalize() + ".", title=f"T{i}", metadata={"part": i % 3}))
    return out


def _hits(r):
    return [(h.doc_id, h.chunk_id, h.score, h.dense_score, h.lexical_score, h.dense_rank, h.lexical_rank, h.text)
            for h in r.hits]


def _answers(c, questions):
    out = []
    for q in questions:
        for mode in ("hybrid", "dense", "lexical", "full_hybrid"):
            out.append(_hits(c.retrieve(q, mode=mode, top_k=8)))
        out.append(_hits(c.retrieve(q, mode="hybrid", top_k=5, filters={"part": [0, 2]})))
    return out


def test_inline_shards_answer_as_shard_processes(tmp_path):
    rng = np.random.default_rng(7)
    docs = _docs(rng)
    questions = [" ".join(rng.choice(WORDS, size=3).tolist()) for _ in range(6)] + ["storm", "zebra"]
    servers = {w: ServerProcess.on_free_ports(tmp_path / w, "--generator", "none", "--shards", "2",
                                              "--shard-workers", w) for w in ("process", "inline")}
    try:
        for s in servers.values():
            s.start()
        want, got = {}, {}
        for w, s in servers.items():
            with OpRAGClient(s.target, timeout=120) as c:
                c.ingest(docs)
                want[w] = _answers(c, questions)
        assert want["inline"] == want["process"]
        assert sum(map(len, want["inline"])) > 100  # (hits in every mode but the unknown word's)
        # faiss's loader logs each CPU-feature build it lacks at INFO ("No module named 'faiss.swigfaiss_avx512'"),
        # read as an error by a new user in inline mode's log (trial34): the server keeps it to warnings
        assert not [ln for ln in servers["inline"].lines if "faiss.loader" in ln], servers["inline"].lines[-20:]

        inl = servers["inline"]
        with OpRAGClient(inl.target, timeout=120) as c:
            # concurrent requests: the scheduler batches them, shard 0's batches run on its thread
            with ThreadPoolExecutor(6) as ex:
                par = list(ex.map(lambda q: _hits(c.retrieve(q, mode="hybrid", top_k=8)), questions * 3))
            assert par == [want["inline"][5 * (i % len(questions))] for i in range(len(par))]
            # a replace and a delete, then reads: the writes are seen
            c.ingest([Doc("d03", "Zebra crossing near the harbour.", metadata={"part": 0})])
            assert [h.doc_id for h in c.retrieve("zebra", mode="lexical", top_k=3).hits] == ["d03"]
            c.delete(["d03"])
            assert list(c.retrieve("zebra", mode="lexical", top_k=3).hits) == []
        inl.restart()
        with OpRAGClient(inl.target, timeout=120) as c:
            assert list(c.retrieve("zebra", mode="lexical", top_k=3).hits) == []
            c.ingest([d for d in docs if d.id == "d03"])  # back as before: every answer as the process server's
            got = _answers(c, questions)
        assert got == want["process"]
    finally:
        for s in servers.values():
            s.stop()
