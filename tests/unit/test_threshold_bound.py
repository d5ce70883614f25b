"""Dense-first hybrid with the threshold bound (operators/hybrid.py) against exact mode.

With a flat index the certified top-k of ``hybrid`` must be ``full_hybrid``'s top-k, chunk for
chunk and bit for bit (scores, both component scores), whatever the window N: the shards' exact
BM25 top-M joins the dense top-N and the bound widens both until it proves the result. Two
corpus families: clustered vectors with Zipf-distributed text, and an adversarial one where the
chunks holding the query terms have low dense scores (the old dense window of N never scored
them). Shards are real ShardState objects in process (shards.inprocess).
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import BM25Config, RetrievalConfig
from oprag_server.index.analyzer import Analyzer
from oprag_server.index.bm25 import CorpusStats
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.pool import route
from oprag_server.shards.state import ShardState

DIM = 24
WORDS = [f"w{i:03d}" for i in range(400)]


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _zipf_text(rng, n):
    p = 1.0 / np.arange(1, len(WORDS) + 1) ** 1.1
    return " ".join(rng.choice(WORDS, size=n, p=p / p.sum()).tolist())


def clustered(rng, n_docs=220):
    """Chunks around 12 cluster centres; Zipf text (a few common words, a long tail)."""
    centres = _unit(rng.normal(size=(12, DIM)))
    docs = []
    for d in range(n_docs):
        c = int(rng.integers(12))
        for k in range(int(rng.integers(1, 4))):
            docs.append((f"doc{d:04d}", k, _zipf_text(rng, int(rng.integers(0, 30))),
                         _unit(centres[c] + 0.35 * rng.normal(size=DIM)), d % 3))
    return docs


def adversarial(rng, n_docs=200):
    """A direction ``a`` most chunks point near, with common words only; a few chunks hold the
    rare query words (top BM25) and point away from ``a`` (low dense): the queries are near
    ``a`` and ask for those words."""
    a = _unit(rng.normal(size=DIM))
    docs = []
    for d in range(n_docs):
        if d % 25 == 0:  # the needles: rare words, vector far from a
            text = " ".join(["w390", "w391", "w392"][: 1 + d % 3] + [_zipf_text(rng, 3)])
            v = _unit(-a + 0.8 * rng.normal(size=DIM))
        else:
            text, v = _zipf_text(rng, int(rng.integers(5, 20))), _unit(a + 0.4 * rng.normal(size=DIM))
        docs.append((f"doc{d:04d}", 0, text, v, d % 3))
    return docs, a


def _build(docs, n_shards):
    shards = [ShardState(i, DIM, None) for i in range(n_shards)]
    stats = CorpusStats()
    per: dict[int, list] = {}
    for row in docs:
        per.setdefault(route(row[0], n_shards), []).append(row)
    for s, rows in per.items():
        batch = records.make_chunk_batch(
            chunk_ids=[f"{d}#{c}" for d, c, *_ in rows], doc_ids=[r[0] for r in rows], titles=["" for _ in rows],
            texts=[r[2] for r in rows], metadata=[{"g": r[4]} for r in rows], ordinals=[r[1] for r in rows],
            generations=[1 for _ in rows], content_hashes=[hashlib.sha256(r[2].encode()).hexdigest() for r in rows],
            vectors=np.stack([r[3] for r in rows]))
        stats.apply_delta(*shards[s].store.upsert(pa.Table.from_batches([batch]), 1).delta)
    return shards, stats


def _retriever(shards, stats, **cfg):
    return Retriever(in_process_pool(shards, copy=True), stats, Analyzer(), BM25Config(), RetrievalConfig(**cfg))


def _key(hits):
    return [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in hits]


def _run(r, qv, texts, specs):
    return asyncio.run(r.retrieve(qv, texts, specs))


FILTERS = [(), (("g", (0,)),), (("g", (1, 2)),)]


@pytest.mark.parametrize("family,seed,n_shards", [("clustered", 0, 2), ("clustered", 1, 3), ("adversarial", 2, 2),
                                                  ("adversarial", 3, 3)])
def test_certified_hybrid_equals_full_hybrid(family, seed, n_shards):
    rng = np.random.default_rng(seed)
    if family == "clustered":
        docs = clustered(rng)
        qv = _unit(np.stack([d[3] for d in docs])[rng.integers(len(docs), size=24)] + 0.3 * rng.normal(size=(24, DIM)))
        texts = [_zipf_text(rng, int(rng.integers(1, 6))) for _ in range(24)]
    else:
        docs, a = adversarial(rng)
        qv = _unit(a + 0.2 * rng.normal(size=(24, DIM)))
        texts = [" ".join(rng.choice(["w390", "w391", "w392", "w001", "w002"], size=int(rng.integers(1, 4))))
                 for _ in range(24)]
    shards, stats = _build(docs, n_shards)
    r = _retriever(shards, stats, lexical_candidates=4)
    widened = []
    r.on_widen = lambda w, u: widened.append((w, u))
    for i in range(len(texts)):
        f, k, n = FILTERS[i % 3], (10, 5, 3)[i % 3], (8, 16, 256)[i % 3]
        specs = [RetrieveSpec(mode="hybrid", top_k=k, candidates=n, filters=f, dense_weight=wd, lexical_weight=1 - wd)
                 for wd in (0.5, 0.8, 0.2)]
        specs += [RetrieveSpec(mode="full_hybrid", top_k=k, candidates=n, filters=f, dense_weight=s.dense_weight,
                               lexical_weight=s.lexical_weight) for s in list(specs)]
        hits, _, infos = _run(r, np.repeat(qv[i:i + 1], 6, axis=0), [texts[i]] * 6, specs)
        for j in range(3):
            assert infos[j].certified, (i, j)
            assert _key(hits[j]) == _key(hits[j + 3]), (i, j)
            assert [h.dense_rank for h in hits[j]] == [h.dense_rank for h in hits[j + 3]]
    assert sum(w for w, _ in widened) > 0  # the window of N (and M = 4) was too short somewhere
    assert sum(u for _, u in widened) == 0


@pytest.mark.parametrize("seed", [5, 6])
def test_a_certificate_is_never_wrong_without_widening(seed):
    """widen_rounds 0: whenever the bound certifies the first round, the top-k is exact mode's;
    the adversarial needles make the first round fail on some queries (reported, not hidden)."""
    rng = np.random.default_rng(seed)
    docs, a = adversarial(rng)
    shards, stats = _build(docs, 2)
    qv = _unit(a + 0.2 * rng.normal(size=(40, DIM)))
    texts = [" ".join(rng.choice(["w390", "w391", "w392", "w001", "w050"], size=int(rng.integers(1, 4))))
             for _ in range(40)]
    certified = 0
    for m in (1, 3, 30):
        r = _retriever(shards, stats, lexical_candidates=m, widen_rounds=0)
        specs = [RetrieveSpec(mode="hybrid", top_k=5, candidates=8)] * 40 + \
            [RetrieveSpec(mode="full_hybrid", top_k=5, candidates=8)] * 40
        hits, _, infos = _run(r, np.concatenate([qv, qv]), texts + texts, specs)
        for i in range(40):
            assert infos[i].widen_rounds == 0 and infos[i].lexical_candidates == m
            if infos[i].certified:
                certified += 1
                assert _key(hits[i]) == _key(hits[i + 40]), (m, i)
    assert 0 < certified < 120


def test_old_window_misses_the_needles_the_bound_finds():
    """The adversarial case in one query: the chunk with the best BM25 is far outside the dense
    top-N; with the BM25 list it is scored (and, being certified, ranked as in exact mode)."""
    rng = np.random.default_rng(9)
    docs, a = adversarial(rng)
    shards, stats = _build(docs, 2)
    r = _retriever(shards, stats)
    spec = RetrieveSpec(mode="hybrid", top_k=5, candidates=16, dense_weight=0.3, lexical_weight=0.7)
    hits, _, infos = _run(r, a[None, :], ["w390 w391 w392"], [spec])
    exact, _, _ = _run(r, a[None, :], ["w390 w391 w392"], [RetrieveSpec(mode="full_hybrid", top_k=5, candidates=16,
                                                                         dense_weight=0.3, lexical_weight=0.7)])
    assert _key(hits[0]) == _key(exact[0])
    assert "w390" in hits[0][0].text and hits[0][0].dense_rank == 0  # a needle, not dense-ranked
    assert infos[0].certified and infos[0].lexical_candidates == 64


def test_rrf_and_single_retriever_modes_report_no_bound():
    rng = np.random.default_rng(4)
    docs = clustered(rng, 60)
    shards, stats = _build(docs, 2)
    r = _retriever(shards, stats)
    qv = _unit(rng.normal(size=(3, DIM)))
    specs = [RetrieveSpec(mode="hybrid", fusion="rrf", top_k=5), RetrieveSpec(mode="dense", top_k=5),
             RetrieveSpec(mode="lexical", top_k=5)]
    _, _, infos = _run(r, qv, ["w001 w002"] * 3, specs)
    assert [(i.certified, i.lexical_candidates, i.widen_rounds) for i in infos] == [(False, 0, 0)] * 3


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_index_dense_minimum_comes_from_the_index(kind):
    """HNSW / IVF: the dense minimum a hybrid search reports is the canonical score of the chunk
    the index finds nearest to -q (a 512-vector sample rarely holds the minimum of 1,500); a
    filtered query's is exact over its allowed chunks. Then hybrid equals full_hybrid here."""
    from oprag_server.config import DenseConfig
    from oprag_server.index.dense import fixed_order_dot
    from oprag_server.shards.protocol import QueryBatch, SearchRequest

    rng = np.random.default_rng(21)
    docs = [(f"doc{d:04d}", 0, _zipf_text(rng, 8), _unit(rng.normal(size=DIM)), d % 3) for d in range(1500)]
    sh = ShardState(0, DIM, None, dense=DenseConfig(kind=kind, hnsw_m=16, train_min=200, ann_check=0))  # (the
    # index's own minimum: with a check sample holding every chunk the minimum is read from it, test_ann_check.py)
    shards, stats = [sh], CorpusStats()
    batch = records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d, *_ in docs], doc_ids=[d[0] for d in docs], titles=[""] * len(docs),
        texts=[d[2] for d in docs], metadata=[{"g": d[4]} for d in docs], ordinals=[0] * len(docs),
        generations=[1] * len(docs), content_hashes=[hashlib.sha256(d[0].encode()).hexdigest() for d in docs],
        vectors=np.stack([d[3] for d in docs]))
    stats.apply_delta(*sh.store.upsert(pa.Table.from_batches([batch]), 1).delta)
    V = sh.store.dense.vectors
    qv = _unit(rng.normal(size=(8, DIM)))
    exact = [float(fixed_order_dot(V, x).min()) for x in qv]
    rep = sh.search.search(SearchRequest(QueryBatch(qv, [["w001"]] * 8, [np.ones(1)] * 8, 8.0, 1.5, 0.75), "hybrid",
                                         16, 400, 64, 0, 8))
    assert rep.dense_min == exact
    sample = sh.search._dense_min_estimate(qv).tolist()
    assert sum(s > e for s, e in zip(sample, exact)) >= 4  # what the sample alone gave
    rep = sh.search.search(SearchRequest(QueryBatch(qv[:2], [["w001"]] * 2, [np.ones(1)] * 2, 8.0, 1.5, 0.75,
                                                    [[("g", [1])]] * 2), "hybrid", 16, 0, 0, 0, 8))
    allowed = sh.store.allowed([("g", [1])])
    assert rep.dense_min == [float(fixed_order_dot(V[sh.store.dense.rows(allowed)], x).min()) for x in qv[:2]]
    r = _retriever(shards, stats)
    spec = RetrieveSpec(mode="hybrid", top_k=5, candidates=8, ef_search=400, nprobe=64)
    for x in qv:
        hits, _, infos = _run(r, np.stack([x, x]), ["w001 w003"] * 2,
                              [spec, RetrieveSpec(mode="full_hybrid", top_k=5, candidates=8)])
        assert infos[0].certified and _key(hits[0]) == _key(hits[1])


@pytest.mark.parametrize("family,seed,either", [("clustered", 7, "both"), ("adversarial", 8, "both"),
                                                ("clustered", 9, "lexical"), ("adversarial", 10, "dense")])
def test_one_sided_widening_rounds_stay_exact(family, seed, either, monkeypatch):
    """Widening grows only the list whose side of the bound failed (a round with N = 0 asks for
    the BM25 list alone, M = 0 for the dense list alone) and joins it with the kept lists: the
    certified top-k is still full_hybrid's, and both kinds of one-sided rounds occur here."""
    from oprag_server.operators import hybrid
    from oprag_server.operators.hybrid import Widening

    monkeypatch.setattr(hybrid, "EITHER", either)  # the side grown when either alone could certify
    asked = []
    real = Widening.next_round

    def spy(self, req):
        got = real(self, req)
        if got is not None:
            asked.append((got[1].n, got[1].m))
        return got
    monkeypatch.setattr(Widening, "next_round", spy)
    rng = np.random.default_rng(seed)
    if family == "clustered":
        docs = clustered(rng)
        qv = _unit(np.stack([d[3] for d in docs])[rng.integers(len(docs), size=30)] + 0.3 * rng.normal(size=(30, DIM)))
        texts = [_zipf_text(rng, int(rng.integers(1, 6))) for _ in range(30)]
    else:
        docs, a = adversarial(rng)
        qv = _unit(a + 0.2 * rng.normal(size=(30, DIM)))
        texts = [" ".join(rng.choice(["w390", "w391", "w392", "w001", "w002"], size=int(rng.integers(1, 4))))
                 for _ in range(30)]
    shards, stats = _build(docs, 2)
    r = _retriever(shards, stats, lexical_candidates=2)
    for i in range(len(texts)):
        for wd in (0.9, 0.5, 0.1):
            specs = [RetrieveSpec(mode="hybrid", top_k=5, candidates=4, dense_weight=wd, lexical_weight=1 - wd),
                     RetrieveSpec(mode="full_hybrid", top_k=5, candidates=4, dense_weight=wd, lexical_weight=1 - wd)]
            hits, _, infos = _run(r, np.repeat(qv[i:i + 1], 2, axis=0), [texts[i]] * 2, specs)
            assert infos[0].certified, (i, wd)
            assert _key(hits[0]) == _key(hits[1]), (i, wd)
    assert any(n == 0 for n, _ in asked) and any(m == 0 for _, m in asked), asked


def _with_copies(rng, copies: int):
    """The clustered corpus plus ``copies`` documents of one text and one vector (boilerplate):
    every copy ties every other in both scores."""
    docs = clustered(rng, 120)
    v = _unit(rng.normal(size=DIM))
    docs += [(f"zz{i:04d}", 0, "w390 w391 w001 w002", v, i % 3) for i in rng.permutation(copies).tolist()]
    return docs, v


@pytest.mark.parametrize("seed", [21, 22])
def test_a_tie_group_larger_than_the_lists_stops_widening(seed, monkeypatch):
    """Queries near a group of 120 copies (~60 a shard; N = 8 and M = 4 grow to 32 and 16 in the
    first round) or sharing its words: where the bound fails by a tie only and a round changes no
    top-k the query stops, uncertified, with exact mode's top-k (scores included): the lists hold
    the group's lowest chunk ids. With the rule off, the rounds go on until the lists hold the
    whole group and certify the same top-k."""
    rng = np.random.default_rng(seed)
    docs, v = _with_copies(rng, 120)
    shards, stats = _build(docs, 2)
    near = _unit(v + 0.05 * rng.normal(size=(8, DIM)))
    far = _unit(np.stack([d[3] for d in docs[:40]])[rng.integers(40, size=8)] + 0.3 * rng.normal(size=(8, DIM)))
    texts = ["w390 w001", "w391", "w001 w002 w003", "w390 w391 w392", "w005", "w002", "w390", "w001"]
    seen = {}
    for stop in (True, False):
        monkeypatch.setattr("oprag_server.operators.hybrid.Widening.STOP_ON_TIE", stop)
        r = _retriever(shards, stats, lexical_candidates=4)
        for name, qv in (("near", near), ("far", far)):
            specs = [RetrieveSpec(mode="hybrid", top_k=5, candidates=8, dense_weight=wd, lexical_weight=1 - wd)
                     for wd in (0.5, 0.8)]
            specs += [RetrieveSpec(mode="full_hybrid", top_k=5, candidates=8, dense_weight=s.dense_weight,
                                   lexical_weight=s.lexical_weight) for s in list(specs)]
            for i in range(8):
                hits, _, infos = _run(r, np.repeat(qv[i:i + 1], 4, axis=0), [texts[i]] * 4, specs)
                for j in range(2):
                    assert _key(hits[j]) == _key(hits[j + 2]), (stop, name, i, j)
                    seen.setdefault((stop, name), []).append((infos[j].certified, infos[j].widen_rounds))
    on = seen[(True, "near")] + seen[(True, "far")]
    off = seen[(False, "near")] + seen[(False, "far")]
    assert all(c for c, _ in off)  # with the rule off the rounds go on until the lists hold the group
    stopped = [r for c, r in on if not c]
    assert stopped and max(stopped) < 3  # stopped before the rounds ran out, the top-k exact mode's
    assert sum(r for _, r in on) < sum(r for _, r in off)


@pytest.mark.parametrize("seed", [7, 8])
def test_a_query_batched_with_a_larger_top_k_answers_as_alone(seed):
    """trial31: a top_k 5 query batched with a top_k 20 one was merged with (and reported) the batch's
    BM25 list length, 80, instead of its own 64. Each query of a mixed batch now answers exactly as
    it does alone: hits, scores, ranks, lexical_candidates, certified, widen_rounds."""
    rng = np.random.default_rng(seed)
    docs = clustered(rng)
    shards, stats = _build(docs, 2)
    r = _retriever(shards, stats)
    qv = _unit(np.stack([d[3] for d in docs])[rng.integers(len(docs), size=8)] + 0.3 * rng.normal(size=(8, DIM)))
    texts = [_zipf_text(rng, int(rng.integers(2, 6))) for _ in range(8)]
    specs = [RetrieveSpec(mode="hybrid", top_k=k, candidates=n) for k, n in ((5, 16), (20, 16), (3, 8), (40, 64))]
    cut = 0
    for i in range(0, 8, 2):
        q, t = np.repeat(qv[i:i + 2], 2, axis=0), [texts[i], texts[i + 1]] * 2
        hits, _, infos = _run(r, q, t, specs)
        for j, sp in enumerate(specs):
            h1, _, i1 = _run(r, q[j:j + 1], [t[j]], [sp])
            full = lambda hs: [(h.chunk_id, h.score, h.dense_score, h.lexical_score, h.dense_rank, h.lexical_rank)
                               for h in hs]  # noqa: E731
            assert full(hits[j]) == full(h1[0]), (i, j)
            assert (infos[j].lexical_candidates, infos[j].certified, infos[j].widen_rounds) == \
                (i1[0].lexical_candidates, i1[0].certified, i1[0].widen_rounds), (i, j)
            cut += infos[j].lexical_candidates < 4 * 40
    assert cut  # (queries whose own M was below the batch's)
