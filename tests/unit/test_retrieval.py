"""Retrieval against a plain reference: rank_bm25 BM25Okapi over every chunk, dense inner product
over every chunk, weighted min-max fusion, full sort with ties broken by chunk id.

Shards are real ShardState objects driven in-process through shards.inprocess (the same state
and op table the shard processes run);
the process boundary is covered by the integration tests.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pyarrow as pa
import pytest
from rank_bm25 import BM25Okapi

from oprag_server import records
from oprag_server.config import BM25Config, RetrievalConfig
from oprag_server.index.analyzer import Analyzer
from oprag_server.index.bm25 import CorpusStats
from oprag_server.index.dense import DenseIndex
from oprag_server.index.fusion import fuse_minmax, minmax_params, normalise
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.pool import route
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.state import ShardState

DIM = 16
VOCAB = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _corpus(rng: np.random.Generator, n_docs: int):
    docs = []
    for d in range(n_docs):
        n_chunks = int(rng.integers(1, 4))
        for c in range(n_chunks):
            words = rng.choice(VOCAB, size=int(rng.integers(0, 12))).tolist()
            v = rng.normal(size=DIM)
            docs.append((f"doc{d:03d}", c, " ".join(words), v / np.linalg.norm(v)))
    return docs


def _build(docs, n_shards=2):
    shards = [ShardState(i, DIM, None) for i in range(n_shards)]
    stats = CorpusStats()
    per: dict[int, list] = {}
    for doc_id, c, text, v in docs:
        per.setdefault(route(doc_id, n_shards), []).append((doc_id, c, text, v))
    for s, rows in per.items():
        batch = records.make_chunk_batch(
            chunk_ids=[f"{d}#{c}" for d, c, _, _ in rows],
            doc_ids=[d for d, _, _, _ in rows],
            titles=["" for _ in rows],
            texts=[t for _, _, t, _ in rows],
            metadata=[{} for _ in rows],
            ordinals=[c for _, c, _, _ in rows],
            generations=[1 for _ in rows],
            content_hashes=[hashlib.sha256(t.encode()).hexdigest() for _, _, t, _ in rows],
            vectors=np.stack([v for *_, v in rows]),
        )
        out = shards[s].store.upsert(pa.Table.from_batches([batch]), 1)
        stats.apply_delta(*out.delta)
    return shards, stats


def _reference(docs, question_terms, qvec, k, wd=0.5, wl=0.5):
    analyzer = Analyzer()
    ids = [f"{d}#{c}" for d, c, _, _ in docs]
    bm = BM25Okapi([analyzer.tokens(t) for _, _, t, _ in docs])
    lex = bm.get_scores(question_terms)
    dense = np.stack([v for *_, v in docs]).astype(np.float32) @ qvec.astype(np.float32)
    fused = fuse_minmax(dense.astype(np.float64), lex, dense_range=minmax_params(dense.astype(np.float64)),
                        lexical_range=minmax_params(lex), dense_weight=wd, lexical_weight=wl)
    order = sorted(range(len(ids)), key=lambda i: (-fused[i], ids[i]))[:k]
    return [ids[i] for i in order], fused[order], dense, lex, ids


def _retriever(shards, stats):
    return Retriever(in_process_pool(shards, copy=True), stats, Analyzer(), BM25Config(), RetrievalConfig())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_full_hybrid_equals_reference(seed):
    rng = np.random.default_rng(seed)
    docs = _corpus(rng, 40)
    shards, stats = _build(docs)
    r = _retriever(shards, stats)
    for _ in range(5):
        q = " ".join(rng.choice(VOCAB, size=3).tolist())
        qv = rng.normal(size=DIM)
        qv = (qv / np.linalg.norm(qv)).astype(np.float32)
        hits, _, _ = asyncio.run(r.retrieve(qv[None, :], [q], [RetrieveSpec(mode="full_hybrid", top_k=10)]))
        ref_ids, ref_scores, *_ = _reference(docs, Analyzer().tokens(q), qv, 10)
        assert [h.chunk_id for h in hits[0]] == ref_ids
        np.testing.assert_allclose([h.score for h in hits[0]], ref_scores, atol=1e-6)


def test_lexical_and_dense_modes_equal_reference():
    rng = np.random.default_rng(7)
    docs = _corpus(rng, 30)
    shards, stats = _build(docs)
    r = _retriever(shards, stats)
    q = "alpha beta beta kappa"
    qv = rng.normal(size=DIM).astype(np.float32)
    qv /= np.linalg.norm(qv)
    _, _, dense, lex, ids = _reference(docs, Analyzer().tokens(q), qv, 10)
    specs = [RetrieveSpec(mode="lexical", top_k=7), RetrieveSpec(mode="dense", top_k=7)]
    hits, _, _ = asyncio.run(r.retrieve(np.stack([qv, qv]), [q, q], specs))
    lex_ref = [ids[i] for i in sorted(range(len(ids)), key=lambda i: (-lex[i], ids[i])) if lex[i] != 0][:7]
    assert [h.chunk_id for h in hits[0]] == lex_ref
    for h in hits[0]:
        assert h.lexical_score == pytest.approx(lex[ids.index(h.chunk_id)], abs=1e-9)
        assert h.dense_score == pytest.approx(dense[ids.index(h.chunk_id)], abs=1e-6)
    dense_ref = [ids[i] for i in sorted(range(len(ids)), key=lambda i: (-dense[i], ids[i]))][:7]
    assert [h.chunk_id for h in hits[1]] == dense_ref


def test_dense_first_hybrid_with_all_candidates_equals_exact():
    """With N >= corpus size the candidate set is the whole corpus, so dense-first == exact."""
    rng = np.random.default_rng(11)
    docs = _corpus(rng, 25)
    shards, stats = _build(docs)
    r = _retriever(shards, stats)
    q = "gamma delta pi"
    qv = rng.normal(size=DIM).astype(np.float32)
    qv /= np.linalg.norm(qv)
    specs = [RetrieveSpec(mode="hybrid", top_k=8, candidates=1000), RetrieveSpec(mode="full_hybrid", top_k=8)]
    hits, _, _ = asyncio.run(r.retrieve(np.stack([qv, qv]), [q, q], specs))
    assert [h.chunk_id for h in hits[0]] == [h.chunk_id for h in hits[1]]
    np.testing.assert_allclose([h.score for h in hits[0]], [h.score for h in hits[1]], atol=1e-9)


def test_k_larger_than_corpus_and_empty_shard_leak_no_placeholders():
    rng = np.random.default_rng(5)
    docs = _corpus(rng, 1)  # one document: one shard stays empty
    shards, stats = _build(docs, n_shards=3)
    assert any(len(s.store.chunks) == 0 for s in shards)
    r = _retriever(shards, stats)
    qv = np.ones(DIM, np.float32) / np.sqrt(DIM)
    for mode in ("hybrid", "dense", "lexical", "full_hybrid"):
        hits, _, _ = asyncio.run(r.retrieve(qv[None, :], ["alpha"], [RetrieveSpec(mode=mode, top_k=50)]))
        assert len(hits[0]) <= len(docs)
        for h in hits[0]:
            assert h.chunk_id.startswith("doc000#")
            assert np.isfinite(h.score) and np.isfinite(h.dense_score) and np.isfinite(h.lexical_score)


def test_empty_corpus_returns_nothing():
    shards, stats = _build([], n_shards=2)
    r = _retriever(shards, stats)
    qv = np.ones(DIM, np.float32) / np.sqrt(DIM)
    for mode in ("hybrid", "dense", "lexical", "full_hybrid"):
        hits, _, _ = asyncio.run(r.retrieve(qv[None, :], ["alpha"], [RetrieveSpec(mode=mode, top_k=5)]))
        assert hits == [[]]


def test_replacement_removes_old_chunks_from_dense_and_bm25():
    rng = np.random.default_rng(3)
    docs = _corpus(rng, 10)
    shards, stats = _build(docs)
    # rewrite doc000 with a new generation and a unique word
    v = rng.normal(size=DIM)
    v /= np.linalg.norm(v)
    s = route("doc000", 2)
    batch = records.make_chunk_batch(chunk_ids=["doc000#0"], doc_ids=["doc000"], titles=[""], texts=["omega omega"],
                                     metadata=[{}], ordinals=[0], generations=[2], content_hashes=["x"],
                                     vectors=v[None, :])
    out = shards[s].store.upsert(pa.Table.from_batches([batch]), 2)
    stats.apply_delta(*out.delta)
    assert out.replaced_docs == 1
    live = [d for d in docs if d[0] != "doc000"] + [("doc000", 0, "omega omega", v)]
    assert sum(len(x.store.chunks) for x in shards) == len(live)
    assert sum(len(x.store.dense) for x in shards) == len(live)
    ref = CorpusStats.merge_full([x.store.postings.full_stats() for x in shards])
    assert ref == stats
    bm = BM25Okapi([Analyzer().tokens(t) for _, _, t, _ in live])
    assert stats.n_docs == bm.corpus_size
    assert stats.avgdl == pytest.approx(bm.avgdl)


def test_constant_scores_do_not_produce_nan():
    x = np.array([0.3, 0.3, 0.3])
    assert normalise(x, *minmax_params(x)).tolist() == [0.0, 0.0, 0.0]
    f = fuse_minmax(x, np.zeros(3), dense_range=minmax_params(x), lexical_range=(0.0, 0.0), dense_weight=0.5,
                    lexical_weight=0.5)
    assert np.isfinite(f).all()


def test_dense_input_forms_give_same_ids_and_scores():
    rng = np.random.default_rng(9)
    idx = DenseIndex(DIM)
    vecs = rng.normal(size=(50, DIM)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx.add(np.arange(50, dtype=np.int64), vecs)
    q32 = rng.normal(size=(3, DIM)).astype(np.float32)
    base_ids, base_scores = idx.search(q32, 5)
    wide = np.zeros((3, DIM * 2), dtype=np.float32)
    wide[:, ::2] = q32
    forms = {
        "float64": q32.astype(np.float64),
        "strided": wide[:, ::2],
        "fortran": np.asfortranarray(q32),
        "arrow": pa.array(q32.tolist(), type=pa.list_(pa.float32())),
        "arrow_fixed": pa.FixedSizeListArray.from_arrays(pa.array(q32.reshape(-1)), DIM),
    }
    for name, q in forms.items():
        ids, scores = idx.search(q, 5)
        for a, b in zip(ids, base_ids):
            assert a.tolist() == b.tolist(), name
        for a, b in zip(scores, base_scores):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=name)
    with pytest.raises(ValueError):
        idx.search(np.full((1, DIM), np.nan), 3)
    with pytest.raises(ValueError):
        idx.search(np.zeros((1, DIM + 1)), 3)


def test_dense_remove_keeps_search_consistent():
    rng = np.random.default_rng(1)
    idx = DenseIndex(DIM)
    vecs = rng.normal(size=(20, DIM)).astype(np.float32)
    idx.add(np.arange(20), vecs)
    idx.remove(np.array([0, 5, 19]))
    live = [i for i in range(20) if i not in (0, 5, 19)]
    q = rng.normal(size=DIM).astype(np.float32)
    ids, scores = idx.search(q, 100)
    expect = sorted(live, key=lambda i: -float(vecs[i] @ q))
    assert ids[0].tolist() == expect
    assert len(idx) == 17
    np.testing.assert_allclose(idx.score_all(q)[0], vecs[idx.slots] @ q, atol=1e-6)
