"""Document-level retrieval (operators/group.py): MaxP grouping, the window rule, exactness
against a brute-force MaxP over every chunk, and the evaluator's document metrics."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from test_retrieval import DIM, VOCAB
from test_retrieval_ops import Corpus, _vec

from oprag_client.evaluate import doc_ranking, metrics, mrr_at_k, ndcg_at_k, recall_at_k
from oprag_server.domain import Hit, RetrievalInfo, RetrieveSpec
from oprag_server.operators import group
from oprag_server.operators.group import MAX_WINDOW, flatten, group_hits, retrieve_documents, window


def _hit(chunk_id: str, score: float) -> Hit:
    doc = chunk_id.rpartition("#")[0]
    return Hit(chunk_id, doc, f"title {doc}", "", score, 0.0, 0.0, 0)


def test_group_hits_maxp_ties_by_doc_id_and_chunks_per_document():
    hits = [_hit("b#0", 0.9), _hit("a#3", 0.9), _hit("c#0", 0.5), _hit("a#1", 0.7), _hit("b#1", 0.95),
            _hit("a#2", 0.7), _hit("d#0", 0.1)]
    docs = group_hits(hits, top_k=3, chunks_per_document=2)
    assert [(d.doc_id, d.score, d.title) for d in docs] == [("b", 0.95, "title b"), ("a", 0.9, "title a"),
                                                           ("c", 0.5, "title c")]
    # best chunks by (score desc, chunk id asc), at most chunks_per_document
    assert [[h.chunk_id for h in d.hits] for d in docs] == [["b#1", "b#0"], ["a#3", "a#1"], ["c#0"]]
    assert [h.chunk_id for h in flatten(docs)] == ["b#1", "b#0", "a#3", "a#1", "c#0"]
    # equal best scores: ascending doc id
    tied = group_hits([_hit("z#0", 1.0), _hit("y#5", 1.0), _hit("x#0", 0.2)], top_k=5, chunks_per_document=1)
    assert [d.doc_id for d in tied] == ["y", "z", "x"]
    assert group_hits([], 3, 1) == []


def test_window_rule():
    assert window(RetrieveSpec(mode="hybrid", top_k=10, candidates=256, chunks_per_document=50)) == 256
    for mode in ("dense", "lexical", "full_hybrid"):
        assert window(RetrieveSpec(mode=mode, top_k=10, candidates=256, chunks_per_document=3)) == 256
        assert window(RetrieveSpec(mode=mode, top_k=100, candidates=256, chunks_per_document=3)) == 300


class FakeRetriever:
    """Chunk-level stand-in: every query ranks the same fixed chunk list; records the windows."""

    def __init__(self, hits: list[Hit]) -> None:
        self.hits = hits
        self.calls: list[list[int]] = []

    async def retrieve(self, qvecs, texts, specs):
        assert qvecs.shape[0] == len(texts) == len(specs)
        self.calls.append([s.top_k for s in specs])
        n = len(self.hits)
        return ([self.hits[: s.top_k] for s in specs], {"retrieve": 1.0, "fusion": 0.5},
                [RetrievalInfo(s.mode, "none", 0.5, 0.5, 0, s.candidates, chunks_searched=n) for s in specs])


def test_exact_modes_grow_the_window_until_top_k_documents_hybrid_does_not():
    # one long document fills the first 1000 chunks, then 50 one-chunk documents
    hits = [_hit(f"long#{i:04d}", 2.0 - i * 1e-4) for i in range(1000)] + \
        [_hit(f"d{i:02d}#0", 1.0 - i * 1e-3) for i in range(50)]
    fake = FakeRetriever(hits)
    specs = [RetrieveSpec(mode="full_hybrid", top_k=5, candidates=64, group_by_document=True),
             RetrieveSpec(mode="hybrid", top_k=5, candidates=64, group_by_document=True),
             RetrieveSpec(mode="dense", top_k=7)]
    out, times, infos, docs = asyncio.run(retrieve_documents(fake.retrieve, np.zeros((3, DIM), np.float32),
                                                             ["q"] * 3, specs))
    # exact: 64 -> 256 -> 1024 chunks, then it holds five documents
    assert [c[0] for c in fake.calls] == [64, 256, 1024] and fake.calls[0][1:] == [64, 7]
    assert [d.doc_id for d in docs[0]] == ["long", "d00", "d01", "d02", "d03"]
    assert out[0] == flatten(docs[0]) and out[0][0].chunk_id == "long#0000"
    # hybrid: the dense-first window only (raise candidates for more documents)
    assert [d.doc_id for d in docs[1]] == ["long"]
    # chunk-level requests are untouched
    assert docs[2] is None and [h.chunk_id for h in out[2]] == [h.chunk_id for h in hits[:7]]
    assert times == {"retrieve": 3.0, "fusion": 1.5} and len(infos) == 3


def test_window_stops_at_the_eligible_chunks_and_the_cap():
    fake = FakeRetriever([_hit(f"only#{i}", 1.0 - i * 1e-3) for i in range(300)])
    spec = RetrieveSpec(mode="lexical", top_k=3, candidates=100, group_by_document=True)
    _, _, _, docs = asyncio.run(retrieve_documents(fake.retrieve, np.zeros((1, DIM), np.float32), ["q"], [spec]))
    assert [c[0] for c in fake.calls] == [100, 300] and [d.doc_id for d in docs[0]] == ["only"]
    assert MAX_WINDOW >= 4096 and group.GROWTH > 1


def _brute_maxp(corpus: Corpus, q: str, qv: np.ndarray, candidates: int, **spec) -> list[tuple[str, float]]:
    """Every chunk scored (chunk-level retrieval with top_k = all chunks), then MaxP."""
    n = len(corpus.rows())
    hits, _ = corpus.retrieve(q, qv, top_k=n, candidates=candidates, **spec)
    best: dict[str, float] = {}
    for h in hits:
        best[h.doc_id] = max(best.get(h.doc_id, -math.inf), h.score)
    return sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))


@pytest.mark.parametrize("mode,fusion", [("full_hybrid", "minmax"), ("full_hybrid", "rrf"), ("dense", "minmax"),
                                         ("lexical", "minmax")])
def test_grouped_exact_modes_equal_brute_force_maxp(mode, fusion):
    rng = np.random.default_rng(5)
    c = Corpus(n_shards=3)
    for d in range(30):  # some long documents: many chunks each
        n = 40 if d < 3 else int(rng.integers(1, 4))
        c.put(f"doc{d:02d}", [" ".join(rng.choice(VOCAB[:8], size=6).tolist()) for _ in range(n)], _vec(rng, n))
    qv = _vec(rng, 1)[0]
    spec = RetrieveSpec(mode=mode, fusion=fusion, top_k=8, candidates=8, group_by_document=True,
                        chunks_per_document=2)
    hits, _, infos, docs = asyncio.run(retrieve_documents(c.retriever.retrieve, qv[None, :], ["alpha beta"], [spec]))
    # RRF scores are defined over lists of `candidates` chunks: same lists for the reference;
    # the other modes' scores do not depend on the window: the reference scores every chunk
    n = 8 if fusion == "rrf" else len(c.rows())
    want = _brute_maxp(c, "alpha beta", qv, n, mode=mode, fusion=fusion)[:8]
    assert [(d.doc_id, pytest.approx(d.score)) for d in docs[0]] == want and len(want) >= 4
    for d in docs[0]:
        assert d.score == d.hits[0].score and len(d.hits) <= 2 and all(h.doc_id == d.doc_id for h in d.hits)
    assert hits[0] == flatten(docs[0])


# ----------------------------------------------------------------------------- evaluator metrics
def test_issue_case_metrics_over_documents():
    """Issue 15 case 3: D1-D4 (long, their chunks fill the first 100) outrank D5, the only
    relevant document. By document (MaxP) D5 is 5th; by the documents of the top-100 chunks it
    is never seen."""
    rels = {"D5": 1}
    by_document = ["D1", "D2", "D3", "D4", "D5"] + [f"F{i:03d}" for i in range(95)]
    m = metrics(by_document, rels)
    assert round(m["ndcg@10"], 5) == 0.38685 and m["ndcg@10"] == pytest.approx(1 / math.log2(6))
    assert m["recall@100"] == 1.0 and m["mrr@10"] == 0.2
    top_100_chunks = [f"D{1 + i // 25}" for i in range(100)]
    assert metrics(doc_ranking(top_100_chunks), rels) == {"ndcg@10": 0.0, "recall@100": 0.0, "mrr@10": 0.0}


def test_metric_definitions():
    rels = {"a": 2, "b": 1, "c": 0}
    assert ndcg_at_k(["a", "b"], rels, 10) == 1.0
    assert ndcg_at_k(["b", "a"], rels, 10) == pytest.approx((1 + 2 / math.log2(3)) / (2 + 1 / math.log2(3)))
    assert ndcg_at_k(["x"] * 10 + ["a"], rels, 10) == 0.0  # beyond k
    assert ndcg_at_k(["a"], {"a": 0}, 10) == 0.0  # nothing relevant: 0, not NaN
    assert recall_at_k(["c", "a", "x"], rels, 2) == 0.5 and recall_at_k(["a"], {}, 100) == 0.0
    assert mrr_at_k(["c", "x", "b"], rels, 10) == pytest.approx(1 / 3) and mrr_at_k(["c"], rels, 10) == 0.0
