"""The shard's BM25 list ordered by (BM25 desc, canonical dense desc, chunk id asc)
(index/lexical_list.py) and what it is for: a BM25 tie larger than the list, whose members only
their dense scores tell apart, with an HNSW / IVF dense list that misses them (trial38b #1: an
IVF hybrid reply certified with 5 of the exact top-10).

The order is checked against a sort of every candidate by the same key, on scores drawn three
ways (few distinct values, copies equal in both scores, NaN dense scores); the served path on real shards
(ShardState in process, FAISS IVF / HNSW) against exact mode (``full_hybrid``) on two corpus
families, and the shard's list against the reference order of its exact BM25 and canonical
dense scores on both BM25 paths (every posting read; the pruned MaxScore pass).
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import BM25Config, DenseConfig, RetrievalConfig
from oprag_server.index.analyzer import Analyzer
from oprag_server.index.bm25 import CorpusStats
from oprag_server.index.lexical_list import order_lexical_list
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.pool import route
from oprag_server.shards.state import ShardState

DIM = 24


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _reference(lex, dense, ids, m):
    """Every candidate sorted by (BM25 desc, dense desc, id asc), NaN last; the first m."""
    def key(p):
        lx, d = lex[p], dense[p]
        return (lx != lx, -lx if lx == lx else 0.0, d != d, -d if d == d else 0.0, ids[p])
    return sorted(range(lex.size), key=key)[:m]


def _rank_top(lex, ids, m):
    """The (score desc, id asc) top-m the shard hands the function (kernels_refine.rank_top's order)."""
    from oprag_server.index.kernels_refine import rank_top

    return rank_top(lex, np.asarray(ids, dtype=object), m)


@pytest.mark.parametrize("draw", ["few_values", "copies", "nan"])
@pytest.mark.parametrize("seed", range(6))
def test_order_equals_a_sort_of_every_candidate(draw, seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        c = int(rng.integers(1, 60))
        m = int(rng.integers(1, c + 1))
        ids = [f"c{i:03d}" for i in rng.permutation(c).tolist()]
        lex = rng.integers(1, 4, size=c).astype(np.float64)
        dense = rng.normal(size=c).round(1)
        if draw == "copies":  # groups equal in both scores
            g = rng.integers(0, 5, size=c)
            lex, dense = (g % 2 + 1).astype(np.float64), (g * 0.1).astype(np.float64)
        elif draw == "nan":
            dense[rng.random(c) < 0.2] = np.nan  # (BM25 is never NaN: listed_top's scores are finite)
        top = _rank_top(lex, ids, m)
        # the candidates hold every chunk scoring at least the m-th BM25 score (listed_top's contract)
        keep = np.flatnonzero(lex >= lex[top[-1]])
        lex2, dense2, ids2 = lex[keep], dense[keep], [ids[i] for i in keep]
        top2 = _rank_top(lex2, ids2, m)
        calls = []
        got, d, tied = order_lexical_list(lex2, top2, lambda p: (calls.append(len(p)), dense2[p])[1],
                                          lambda p: ids2[p])
        want = _reference(lex2, dense2, ids2, m)
        assert [ids2[p] for p in got] == [ids2[p] for p in want], (draw, seed, m)
        np.testing.assert_array_equal(d, dense2[got])
        kth2 = lex2[top2[-1]]
        assert tied == bool(kth2 == kth2 and (lex2 == kth2).sum() > (lex2[got] == kth2).sum())
        if tied:  # no unlisted member of the tie scores above the last listed one's dense
            rest = np.setdiff1d(np.flatnonzero(lex2 == kth2), got)
            assert not (dense2[rest] > d[-1]).any()


@pytest.mark.parametrize("seed", range(4))
def test_a_large_tie_screened_by_approximate_scores_gives_the_same_list(seed, monkeypatch):
    """A tie larger than ``SCREEN`` is first screened by approximate dense scores within a bound (a flat shard's
    int8 copy); only the members that can be among the best are scored canonically: the list is the same."""
    from oprag_server.index import lexical_list

    monkeypatch.setattr(lexical_list, "SCREEN", 4)
    rng = np.random.default_rng(seed)
    for _ in range(30):
        c = int(rng.integers(10, 80))
        m = int(rng.integers(1, c))
        ids = [f"c{i:03d}" for i in rng.permutation(c).tolist()]
        lex = rng.integers(1, 3, size=c).astype(np.float64)
        dense = rng.normal(size=c).round(2)
        err = 0.05
        noisy = dense + rng.uniform(-err, err, size=c)
        top = _rank_top(lex, ids, m)
        keep = np.flatnonzero(lex >= lex[top[-1]])
        lex2, dense2, noisy2, ids2 = lex[keep], dense[keep], noisy[keep], [ids[i] for i in keep]
        top2 = _rank_top(lex2, ids2, m)
        scored = []
        got, d, tied = order_lexical_list(lex2, top2, lambda p: (scored.append(len(p)), dense2[p])[1],
                                          lambda p: ids2[p], lambda p: (noisy2[p], err))
        assert [ids2[p] for p in got] == [ids2[p] for p in _reference(lex2, dense2, ids2, m)]
        np.testing.assert_array_equal(d, dense2[got])


# ---------------------------------------------------------------- served: real shards, FAISS indexes

def background_tie(rng, n=1600):
    """30 clusters; the query's cluster (12 chunks, words the query lacks) and the rest, whose
    chunks all read "synthetic vector sample" (one BM25 score: a tie of ~1,600), told apart by
    dense scores far below the query cluster's."""
    centres = _unit(rng.normal(size=(30, DIM)))
    docs = [(f"near{i:03d}", "alpha beta gamma delta", _unit(centres[0] + 0.15 * rng.normal(size=DIM)))
            for i in range(12)]
    for i in range(n):
        c = 1 + int(rng.integers(29))
        docs.append((f"bg{i:05d}", "synthetic vector sample", _unit(centres[c] + 0.6 * rng.normal(size=DIM))))
    return docs, centres[0]


def boilerplate_tie(rng, n=1600):
    """Vectors along a few directions at graded angles (no clusters); most chunks end with one
    boilerplate sentence that holds the query's words once, with a body of varied words and a
    fixed length, so BM25 ties across them; a few hold the words twice (above the tie)."""
    basis = _unit(rng.normal(size=(4, DIM)))
    docs = []
    for i in range(n):
        w = rng.dirichlet(np.ones(4) * 0.3)
        v = _unit(w @ basis + 0.2 * rng.normal(size=DIM))
        body = " ".join(f"b{int(x)}" for x in rng.integers(0, 500, size=5))
        text = f"{body} terms of service apply" if i % 40 else f"{body} terms of service service"
        docs.append((f"d{i:05d}", text, v))
    return docs, basis[0]


def _build(docs, n_shards, kind):
    shards = [ShardState(i, DIM, None, dense=DenseConfig(kind=kind, hnsw_m=8, train_min=100, ann_check=0))
              for i in range(n_shards)]
    stats = CorpusStats()
    per: dict[int, list] = {}
    for row in docs:
        per.setdefault(route(row[0], n_shards), []).append(row)
    for s, rows in per.items():
        batch = records.make_chunk_batch(
            chunk_ids=[f"{d}#0" for d, *_ in rows], doc_ids=[r[0] for r in rows], titles=["" for _ in rows],
            texts=[r[1] for r in rows], metadata=[{} for _ in rows], ordinals=[0] * len(rows),
            generations=[1] * len(rows), content_hashes=[hashlib.sha256(r[0].encode()).hexdigest() for r in rows],
            vectors=np.stack([r[2] for r in rows]))
        stats.apply_delta(*shards[s].store.upsert(pa.Table.from_batches([batch]), 1).delta)
    return shards, stats


def _key(hits):
    return [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in hits]


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "flat"])
@pytest.mark.parametrize("family,text", [("background", "synthetic vector"), ("boilerplate", "terms of service")])
def test_hybrid_equals_exact_mode_through_a_large_bm25_tie(kind, family, text):
    """IVF at nprobe 1 (ef_search 16 for HNSW), N = 128 and no sample check (as a shard far larger
    than its sample): the IVF's dense lists hold the query's neighbours and whatever else the probed
    lists hold, not the tie's best; the BM25 lists (M = 4) cut the tie. Every certified reply equals
    full_hybrid's top-k (listed by id, IVF certified 0-4 of the exact top-10 in both families)."""
    rng = np.random.default_rng(3 if family == "background" else 4)
    docs, centre = background_tie(rng) if family == "background" else boilerplate_tie(rng)
    shards, stats = _build(docs, 2, kind)
    r = Retriever(in_process_pool(shards, copy=True), stats, Analyzer(), BM25Config(),
                  RetrievalConfig(lexical_candidates=4))
    qv = _unit(centre + 0.2 * rng.normal(size=(12, DIM)))
    certified = 0
    for i, x in enumerate(qv):
        for wd in (0.5, 0.7):
            specs = [RetrieveSpec(mode="hybrid", top_k=10, candidates=128, nprobe=1, ef_search=16, dense_weight=wd,
                                  lexical_weight=1 - wd),
                     RetrieveSpec(mode="full_hybrid", top_k=10, candidates=128, dense_weight=wd, lexical_weight=1 - wd)]
            hits, _, infos = asyncio.run(r.retrieve(np.stack([x, x]), [text] * 2, specs))
            assert kind == "flat" or max(infos[0].ef_search, infos[0].nprobe) > 0  # (an index searched: reported)
            if infos[0].certified:
                certified += 1
                # (HNSW / IVF: the dense range's minimum is the lowest the index finds, so fused scores may
                # differ from exact mode's in the last bits; the chunks, their order and scores may not)
                key = _key if kind == "flat" else lambda hs: [(h.chunk_id, h.dense_score, h.lexical_score) for h in hs]
                assert key(hits[0]) == key(hits[1]), (kind, family, i, wd)
    assert certified >= 12, certified


@pytest.mark.parametrize("kind", ["ivf", "flat"])
@pytest.mark.parametrize("pruned", [False, True])
def test_shard_list_is_the_reference_order_on_both_bm25_paths(pruned, kind, monkeypatch):
    """The shard's BM25 list for a query whose cut falls in a tie of ~800: the first m by (exact
    BM25 desc, canonical dense desc, chunk id asc) over every chunk with the query's terms, on the
    path that reads every posting and on the pruned (MaxScore) pass; a wider request's list
    starts with the narrower one (prefix-closed, what the frontend's cut relies on)."""
    from oprag_server.index.bm25 import listed_top
    from oprag_server.index.bm25.listed_top import scores_at
    from oprag_server.index.dense import fixed_order_dot
    from oprag_server.shards.protocol import QueryBatch, SearchRequest

    if pruned:
        monkeypatch.setattr(listed_top, "_FULL_BELOW", 0)
    from oprag_server.index import lexical_list

    monkeypatch.setattr(lexical_list, "SCREEN", 64)  # (flat: the tie of ~1,600 screened by the int8 copy first)
    rng = np.random.default_rng(9)
    docs, centre = background_tie(rng)
    shards, stats = _build(docs, 1, kind)
    st = shards[0].store
    terms = Analyzer().tokens("synthetic vector")
    idf, avgdl = stats.query_idf(terms), stats.avgdl
    q = _unit(centre + 0.2 * rng.normal(size=DIM))
    every = np.arange(len(st.dense), dtype=np.int64)  # (no chunk removed: every slot is live)
    lex_all = scores_at(st.postings, terms, idf, avgdl, 1.5, 0.75, every)
    dense_all = fixed_order_dot(st.dense.vectors[st.dense.rows(every)], q).astype(np.float64)
    on = np.flatnonzero(lex_all != 0)
    ids = [st.ids(every)[i] for i in on]
    assert (lex_all[on] == lex_all[on].max()).sum() > 500  # the tie
    lists = []
    for m in (4, 16, 64):
        rep = shards[0].search.search(SearchRequest(QueryBatch(q[None], [terms], [idf], avgdl, 1.5, 0.75),
                                                    "hybrid", 16, 0, 1, 0, m))
        got = rep.lexical[0]
        want = _reference(lex_all[on], dense_all[on], ids, m)
        assert list(got.chunk_ids) == [ids[p] for p in want], m
        np.testing.assert_array_equal(got.lexical, lex_all[on][want])
        np.testing.assert_array_equal(got.dense, dense_all[on][want])
        assert rep.tied[0] is True
        lists.append(list(got.chunk_ids))
    assert lists[1][:4] == lists[0] and lists[2][:16] == lists[1]
