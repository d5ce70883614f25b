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


@pytest.mark.parametrize("build,index", [(_random_corpus, "flat"), (_topic_corpus, "flat"), (_topic_corpus, "hnsw")])
def test_default_hybrid_first_round_equals_wider_and_exact(tmp_path, build, index):
    """(HNSW: a corpus of at most shards x --ann-check chunks starts at flat's N too, session 43.)"""
    docs, queries = build(np.random.default_rng(33), 500)
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2", "--dense-index", index).start()
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


def test_negative_bm25_scores_below_a_short_list_keep_the_certified_top_k_exact(tmp_path):
    """trial33: every word in ~80% of the documents makes rank_bm25's idf floor negative, so a
    chunk holding the query term scores below one without it; the lowest scores sat below the
    shards' truncated BM25 lists and the BM25 range's minimum was taken too high (certified top-k
    != FULL_HYBRID's for 10 of 40 requests at N 64). Each shard now reports its exact minimum."""
    rng = np.random.default_rng(0)
    docs = []
    for i in range(700):
        ws = [w for w in ("alpha", "beta", "gamma") if rng.random() < 0.8] or ["alpha"]
        docs.append(Doc(f"n{i}", " ".join(ws * int(rng.integers(1, 4))), vector=rng.standard_normal(D).astype(np.float32)))
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2").start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            checked = negative = 0
            for d in [x for x in docs if "gamma" in x.text][:12]:
                for k in (1, 5):
                    a = c.retrieve("gamma", top_k=k, query_vector=d.vector.tolist())
                    x = c.retrieve("gamma", top_k=k, mode="full_hybrid", query_vector=d.vector.tolist())
                    assert a.retrieval.certified
                    assert _key(a) == _key(x), (d.id, k)
                    negative += any(h.lexical_score < 0 for h in x.hits)
                    checked += 1
            assert checked == 24 and negative > 0  # the case is there: negative BM25 scores among the hits
    finally:
        srv.stop()


def test_dense_weight_zero_ties_widen_to_full_hybrid_order(tmp_path):
    """trial33: with dense weight 0 and a question no chunk holds, every chunk fuses to 0; the
    dense list holds the chunks by dense score, not by id, so stopping on the tie left a top-k
    of higher ids. Such a query keeps widening, as N 256 did, to FULL_HYBRID's order."""
    rng = np.random.default_rng(5)
    same = rng.standard_normal(D).astype(np.float32)
    docs = [Doc(f"d{i:04d}", f"text {i % 7}", vector=(same if i >= 300 else rng.standard_normal(D).astype(np.float32)))
            for i in range(900)]
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "1").start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            kw = dict(top_k=33, dense_weight=0.0, lexical_weight=1.0, query_vector=same.tolist())
            a = c.retrieve("zzz", **kw)
            x = c.retrieve("zzz", mode="full_hybrid", **kw)
            assert [h.chunk_id for h in a.hits] == [h.chunk_id for h in x.hits] == [f"d{i:04d}#0" for i in range(33)]
    finally:
        srv.stop()
