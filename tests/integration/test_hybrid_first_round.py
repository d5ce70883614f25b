"""A min-max HYBRID request that leaves ``candidates`` 0 starts from N = max(64, 4 top_k)
(``--hybrid-candidates``) on a real server (2 shard processes, flat): the threshold bound makes
N a cost knob only, so its hits and scores equal those of N 256 and of FULL_HYBRID, on corpora
built two ways (random words with random vectors; topic clusters whose vectors and words agree),
each with far more than 64 chunks per shard; ``retrieval`` reports the N used."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = pytest.mark.integration

D = 384


def _random_corpus(rng, n):
    words = [f"w{i}" for i in range(300)]
    V = rng.standard_normal((n, D)).astype(np.float32)
    docs = [Doc(f"r{i}", " ".join(rng.choice(words, size=int(rng.integers(3, 12)))), vector=V[i]) for i in range(n)]
    queries = [(" ".join(rng.choice(words, size=3)), rng.standard_normal(D).astype(np.float32)) for _ in range(12)]
    return docs, queries


def _topic_corpus(rng, n, topics=8):
    centres = rng.standard_normal((topics, D)).astype(np.float32)
    vocab = [[f"t{t}x{j}" for j in range(20)] for t in range(topics)]
    docs, queries = [], []
    for i in range(n):
        t = int(rng.integers(topics))
        v = centres[t] + 0.6 * rng.standard_normal(D).astype(np.float32)
        docs.append(Doc(f"c{i}", " ".join(rng.choice(vocab[t], size=6)) + f" shared{i % 5}", vector=v))
    for t in range(topics):
        q = centres[t] + 0.3 * rng.standard_normal(D).astype(np.float32)
        queries.append((" ".join(rng.choice(vocab[t], size=2)) + " shared1", q))
    return docs, queries


def _key(r):
    return [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in r.hits]


@pytest.mark.parametrize("build", [_random_corpus, _topic_corpus])
def test_default_hybrid_first_round_equals_wider_and_exact(tmp_path, build):
    docs, queries = build(np.random.default_rng(33), 500)
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2").start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            assert c.stats().chunks == len(docs)
            for text, q in queries:
                for k in (10, 25):
                    first = c.retrieve(text, top_k=k, query_vector=q.tolist())
                    wide = c.retrieve(text, top_k=k, candidates=256, query_vector=q.tolist())
                    exact = c.retrieve(text, top_k=k, mode="full_hybrid", query_vector=q.tolist())
                    assert first.retrieval.candidates == max(64, 4 * k) and wide.retrieval.candidates == 256
                    assert first.retrieval.certified and wide.retrieval.certified
                    assert _key(first) == _key(wide) == _key(exact), (text, k)
                    # the hits' ranks are over the first round's window (the top N of each list)
                    assert all(h.dense_rank <= first.retrieval.candidates for h in first.hits)
            # rank fusion keeps the window of --candidates (its scores are defined over it)
            rrf = c.retrieve(queries[0][0], top_k=10, fusion="rrf", query_vector=queries[0][1].tolist())
            assert rrf.retrieval.candidates == 256
    finally:
        srv.stop()
