"""Incremental exactness (hypothesis), metadata filters and rank fusion, over real ShardState
objects driven in-process (oprag_server.shards.inprocess)."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi
from test_retrieval import DIM, VOCAB

from oprag_server import records
from oprag_server.config import BM25Config, RetrievalConfig
from oprag_server.index.analyzer import Analyzer
from oprag_server.index.bm25 import CorpusStats
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.pool import route
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.state import ShardState


class Corpus:
    """Shards + frontend stats driven like the service does (upsert/delete + deltas)."""

    def __init__(self, n_shards: int = 2) -> None:
        self.shards = [ShardState(i, DIM, None) for i in range(n_shards)]
        self.stats = CorpusStats()
        self.live: dict[str, list[tuple[str, np.ndarray, dict]]] = {}
        self.gen = 0
        self.retriever = Retriever(in_process_pool(self.shards), self.stats, Analyzer(), BM25Config(), RetrievalConfig())

    def put(self, doc_id: str, chunks: list[str], vecs: np.ndarray, meta: dict | None = None) -> None:
        self.gen += 1
        meta = meta or {}
        batch = records.make_chunk_batch(
            chunk_ids=[f"{doc_id}#{i}" for i in range(len(chunks))], doc_ids=[doc_id] * len(chunks),
            titles=[""] * len(chunks), texts=chunks, metadata=[meta] * len(chunks), ordinals=list(range(len(chunks))),
            generations=[self.gen] * len(chunks), content_hashes=[hashlib.sha256(c.encode()).hexdigest() for c in chunks],
            vectors=vecs,
        )
        out = self.shards[route(doc_id, len(self.shards))].store.upsert(pa.Table.from_batches([batch]), self.gen)
        self.stats.apply_delta(*out.delta)
        self.live[doc_id] = [(c, v, meta) for c, v in zip(chunks, vecs)]

    def delete(self, doc_id: str) -> None:
        for s in self.shards:
            out = s.store.delete([doc_id], self.gen)
            self.stats.apply_delta(*out.delta)
        self.live.pop(doc_id, None)

    def rows(self):
        return [(f"{d}#{i}", c, v, m) for d in sorted(self.live) for i, (c, v, m) in enumerate(self.live[d])]

    def retrieve(self, q: str, qv: np.ndarray, **spec):
        hits, _, infos = asyncio.run(self.retriever.retrieve(qv[None, :], [q], [RetrieveSpec(**spec)]))
        return hits[0], infos[0]


def _vec(rng, n):
    v = rng.normal(size=(n, DIM))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "delete"]),
        st.integers(0, 5),
        st.lists(st.lists(st.sampled_from(VOCAB[:8]), min_size=0, max_size=6).map(" ".join), min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, query=st.lists(st.sampled_from(VOCAB[:8]), min_size=1, max_size=4), seed=st.integers(0, 2**16))
@example(ops=[("put", 0, ["alpha beta gamma delta", "alpha beta gamma delta epsilon"]),  # (rank_bm25's average idf
              ("put", 1, ["alpha zeta theta", "alpha delta epsilon eta", "beta gamma zeta eta"])],  # -2.8e-17, ours 0)
         query=["alpha"], seed=0)
def test_lexical_scores_equal_from_scratch_bm25_after_any_operations(ops, query, seed):
    rng = np.random.default_rng(seed)
    c = Corpus()
    for op, d, chunks in ops:
        if op == "put":
            c.put(f"d{d}", chunks, _vec(rng, len(chunks)))
        else:
            c.delete(f"d{d}")
    rows = c.rows()
    assert c.stats == CorpusStats.merge_full([s.store.postings.full_stats() for s in c.shards])
    assert sum(len(s.store.dense) for s in c.shards) == len(rows)
    q = " ".join(query)
    hits, _ = c.retrieve(q, _vec(rng, 1)[0], mode="lexical", top_k=100)
    if not rows:
        assert hits == []
        return
    an = Analyzer()
    toks = [an.tokens(t) for _, t, _, _ in rows]
    # rank_bm25 divides by zero when no chunk has a token; our defined result there is all zeros
    ref = BM25Okapi(toks).get_scores(an.tokens(q)) if any(toks) else np.zeros(len(rows))
    got = {h.chunk_id: h.lexical_score for h in hits}
    ids = [cid for cid, *_ in rows]
    for cid, score in zip(ids, ref):
        if cid in got:
            assert got[cid] == pytest.approx(score, abs=1e-9)
        else:
            # chunks scoring 0 are not in the lexical list; rank_bm25's running sum of idfs can leave a floored idf of
            # -6.9e-18 where ours (an exact fsum, corpus_stats.average_idf) is 0: within the tolerance above (CI, s34)
            assert score == pytest.approx(0.0, abs=1e-9)
    # exact hybrid after the same operations still equals the plain reference
    qv = _vec(rng, 1)[0]
    ex, _ = c.retrieve(q, qv, mode="full_hybrid", top_k=5)
    dense = np.stack([v for _, _, v, _ in rows]) @ qv
    from oprag_server.index.fusion import fuse_minmax, minmax_params

    # a BM25 span within the tolerance above is that rounding noise (every score 0 in exact arithmetic), which
    # min-max would stretch to [0, 1]: the reference then ranks by its dense scores, as the server does
    lex = ref if np.ptp(ref) > 1e-9 else np.zeros_like(ref)
    fused = fuse_minmax(dense.astype(np.float64), lex, dense_range=minmax_params(dense.astype(np.float64)),
                        lexical_range=minmax_params(lex), dense_weight=0.5, lexical_weight=0.5)
    order = sorted(range(len(ids)), key=lambda i: (-fused[i], ids[i]))[:5]
    assert [h.chunk_id for h in ex] == [ids[i] for i in order]


@pytest.mark.parametrize("mode", ["hybrid", "dense", "lexical", "full_hybrid"])
def test_metadata_filters_apply_before_top_k(mode):
    rng = np.random.default_rng(4)
    c = Corpus()
    for i in range(30):
        c.put(f"doc{i:02d}", ["alpha beta gamma"], _vec(rng, 1), {"lang": "en" if i % 10 else "de", "n": str(i % 3)})
    qv = _vec(rng, 1)[0]
    hits, info = c.retrieve("alpha", qv, mode=mode, top_k=3, candidates=5, filters=(("lang", ("de",)),))
    assert [h.doc_id for h in hits] and all(h.metadata["lang"] == "de" for h in hits)
    assert len(hits) == 3  # three German documents exist: top_k honoured although N=5 < 30
    assert info.chunks_searched == 3
    hits, _ = c.retrieve("alpha", qv, mode=mode, top_k=20, filters=(("n", ("0", "2")),))
    assert len(hits) == 20 and {h.metadata["n"] for h in hits} <= {"0", "2"}
    hits, _ = c.retrieve("alpha", qv, mode=mode, top_k=5, filters=(("lang", ("de",)), ("n", ("1",))))
    assert {h.doc_id for h in hits} == {"doc10"}  # i=10: de and 10 % 3 == 1
    hits, _ = c.retrieve("alpha", qv, mode=mode, top_k=5, filters=(("missing", ("x",)),))
    assert hits == []


def test_rrf_fusion_follows_the_formula():
    rng = np.random.default_rng(8)
    c = Corpus()
    words = VOCAB[:6]
    for i in range(40):
        c.put(f"doc{i:02d}", [" ".join(rng.choice(words, size=5).tolist())], _vec(rng, 1))
    qv = _vec(rng, 1)[0]
    for mode in ("hybrid", "full_hybrid"):
        hits, info = c.retrieve("alpha gamma", qv, mode=mode, top_k=10, candidates=20, fusion="rrf", rrf_k=60,
                                dense_weight=1.0, lexical_weight=2.0)
        assert info.fusion == "rrf" and info.rrf_k == 60
        for h in hits:
            want = (1.0 / (60 + h.dense_rank) if h.dense_rank else 0.0) + (2.0 / (60 + h.lexical_rank) if h.lexical_rank else 0.0)
            assert h.score == pytest.approx(want)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    # exact-mode ranks are positions in the corpus-wide lists
    rows = c.rows()
    dense = np.stack([v for _, _, v, _ in rows]) @ qv
    ids = [r[0] for r in rows]
    order = sorted(range(len(ids)), key=lambda i: (-dense[i], ids[i]))
    hits, _ = c.retrieve("alpha gamma", qv, mode="full_hybrid", top_k=10, candidates=40)
    for h in hits:
        if h.dense_rank:
            assert ids[order[h.dense_rank - 1]] == h.chunk_id


def test_weighted_minmax_weights_change_the_ranking():
    rng = np.random.default_rng(2)
    c = Corpus()
    for i in range(20):
        c.put(f"doc{i:02d}", [" ".join(rng.choice(VOCAB[:6], size=4).tolist())], _vec(rng, 1))
    qv = _vec(rng, 1)[0]
    dense_only, _ = c.retrieve("alpha", qv, mode="full_hybrid", top_k=5, dense_weight=1.0, lexical_weight=0.0)
    plain_dense, _ = c.retrieve("alpha", qv, mode="dense", top_k=5)
    assert [h.chunk_id for h in dense_only] == [h.chunk_id for h in plain_dense]


def test_negative_bm25_scores_keep_a_lexical_rank():
    """Issue 15 case 8: with a negative average idf rank_bm25 floors the idf of a term in more
    than half of the chunks to a negative value. Those chunks contain the query term: they rank
    in the lexical list by score (whatever its sign) and RRF counts them; a chunk without the
    term (score 0) stays unranked."""
    texts = ["alpha beta", "alpha beta beta", "alpha alpha beta", "alpha beta beta beta", "alpha gamma", "beta"]
    ref = BM25Okapi([t.split() for t in texts]).get_scores(["alpha"])
    assert (ref[:5] < 0).all() and ref[5] == 0
    rng = np.random.default_rng(3)
    c = Corpus()
    for i, t in enumerate(texts):
        c.put(f"doc{i}", [t], _vec(rng, 1))
    qv = _vec(rng, 1)[0]
    ids = [f"doc{i}#0" for i in range(6)]
    order = sorted(range(5), key=lambda i: (-ref[i], ids[i]))  # score desc, ties by chunk id
    want = {ids[i]: r + 1 for r, i in enumerate(order)} | {ids[5]: 0}
    for mode, fusion in [("hybrid", "rrf"), ("full_hybrid", "rrf"), ("hybrid", "minmax"), ("full_hybrid", "minmax")]:
        hits, _ = c.retrieve("alpha", qv, mode=mode, fusion=fusion, top_k=6, candidates=6)
        assert {h.chunk_id: h.lexical_rank for h in hits} == want, (mode, fusion)
        for h in hits:
            assert h.lexical_score == pytest.approx(ref[ids.index(h.chunk_id)])
            if fusion == "rrf":
                assert h.score == pytest.approx(0.5 / (60 + h.dense_rank) + (0.5 / (60 + h.lexical_rank)
                                                                            if h.lexical_rank else 0.0))
    # a term in exactly half the chunks has idf 0: scored like a chunk without it, unranked
    c2 = Corpus()
    c2.put("x", ["omega"], _vec(rng, 1))
    c2.put("y", ["sigma"], _vec(rng, 1))
    hits, _ = c2.retrieve("omega", qv, mode="full_hybrid", fusion="rrf", top_k=2, candidates=2)
    assert [h.lexical_rank for h in hits] == [0, 0] and all(h.lexical_score == 0 for h in hits)
