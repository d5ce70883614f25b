"""Identical content, identical score (issue 15): the same chunk (same text, same vector) gets
bit-identical dense and lexical scores whatever shard holds it, however many queries are scored
together, with or without filters and in every mode, so ties break by chunk id. Real shard
states driven in-process (oprag_server.shards.inprocess)."""

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
from oprag_server.index.dense import DenseIndex, fixed_order_dot
from oprag_server.index.fusion import refine_top
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.pool import route
from oprag_server.shards.state import ShardState

D = 384
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
DUP_TEXT = "alpha beta gamma delta"
N_DUP = 8


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _corpus(n_shards: int = 4, seed: int = 0):
    """Shards holding 400 filler chunks and N_DUP documents with the same text and vector."""
    rng = np.random.default_rng(seed)
    shards = [ShardState(i, D, None) for i in range(n_shards)]
    stats = CorpusStats()
    dup = _unit(rng.normal(size=D))
    docs = [(f"filler-{i:03d}", " ".join(rng.choice(WORDS, 6)), _unit(rng.normal(size=D)) if i % 3 else
             _unit(dup + rng.normal(size=D) / np.sqrt(D))) for i in range(400)]
    docs += [(f"dup-{i}", DUP_TEXT, dup) for i in range(N_DUP)]
    per: dict[int, list] = {}
    for d in docs:
        per.setdefault(route(d[0], n_shards), []).append(d)
    for sid, ds in per.items():  # one batch per shard: the duplicates sit at different rows
        batch = records.make_chunk_batch(
            chunk_ids=[f"{d}#0" for d, _, _ in ds], doc_ids=[d for d, _, _ in ds], titles=[""] * len(ds),
            texts=[t for _, t, _ in ds], metadata=[{"grp": i % 2, "dup": d.startswith("dup")} for i, (d, _, _) in enumerate(ds)],
            ordinals=[0] * len(ds), generations=[1] * len(ds),
            content_hashes=[hashlib.sha256(t.encode()).hexdigest() for _, t, _ in ds], vectors=np.stack([v for *_, v in ds]))
        stats.apply_delta(*shards[sid].store.upsert(pa.Table.from_batches([batch]), 1).delta)
    assert len({route(f"dup-{i}", n_shards) for i in range(N_DUP)}) > 1
    retriever = Retriever(in_process_pool(shards), stats, Analyzer(), BM25Config(), RetrievalConfig())
    queries = _unit(dup + 0.6 * rng.normal(size=(8, D)) / np.sqrt(D))
    return retriever, queries, dup


def _run(retriever, queries, texts, spec):
    hits, _, _ = asyncio.run(retriever.retrieve(queries, texts, [spec] * len(texts)))
    return hits


def _key(h):
    return (h.chunk_id, h.score, h.dense_score, h.lexical_score, h.dense_rank, h.lexical_rank)


SPECS = [dict(mode=m, fusion=f) for m in ("hybrid", "full_hybrid") for f in ("minmax", "rrf")] + \
        [dict(mode="dense"), dict(mode="lexical")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(s.values()))
def test_duplicates_score_bit_identically_across_shards_batches_and_filters(spec):
    retriever, queries, dup = _corpus()
    text = "alpha beta gamma delta"
    base = RetrieveSpec(top_k=30, candidates=64, **spec)
    batched = _run(retriever, queries, [text] * 8, base)
    singles = [_run(retriever, queries[j : j + 1], [text], base)[0] for j in range(8)]
    # every eligible chunk passes this filter, through the filtered code path
    everything = RetrieveSpec(top_k=30, candidates=64, filters=(("grp", (0, 1)),), **spec)
    filtered = _run(retriever, queries, [text] * 8, everything)
    only_dups = _run(retriever, queries, [text] * 8, RetrieveSpec(top_k=30, candidates=64, filters=(("dup", (True,)),), **spec))
    for j in range(8):
        assert [_key(h) for h in batched[j]] == [_key(h) for h in singles[j]]  # batch of 8 == batch of 1
        assert [_key(h) for h in batched[j]] == [_key(h) for h in filtered[j]]  # filter path == plain path
        dups = [h for h in batched[j] if h.doc_id.startswith("dup-")]
        assert len(dups) == N_DUP, "the duplicates rank near the top"
        assert len({(h.dense_score, h.lexical_score) for h in dups}) == 1
        assert len({h.shard for h in dups}) > 1
        if spec.get("fusion") == "rrf":  # tied in both lists, so ranked there by chunk id: RRF decreases
            assert [h.score for h in dups] == sorted((h.score for h in dups), reverse=True)
            assert len({h.score for h in dups}) == N_DUP
        else:
            assert len({h.score for h in dups}) == 1
            pos = [i for i, h in enumerate(batched[j]) if h.doc_id.startswith("dup-")]
            assert pos == list(range(pos[0], pos[0] + N_DUP)), "equal scores are adjacent"
        assert [h.chunk_id for h in dups] == sorted(h.chunk_id for h in dups), "ties by chunk id"
        assert dups[0].dense_score == fixed_order_dot(dup[None, :], queries[j])[0]  # canonical, every mode
        assert {(h.dense_score, h.lexical_score) for h in only_dups[j]} == {(dups[0].dense_score, dups[0].lexical_score)}


def test_fixed_order_dot_is_independent_of_the_batch_and_the_row():
    rng = np.random.default_rng(3)
    v = _unit(rng.normal(size=(257, D)))
    q = _unit(rng.normal(size=D))
    full = fixed_order_dot(v, q)
    assert all(fixed_order_dot(v[i : i + 1], q)[0] == full[i] for i in range(0, 257, 17))
    assert np.array_equal(fixed_order_dot(v[::-1], q), full[::-1])
    assert np.abs(full - v.astype(np.float64) @ q.astype(np.float64)).max() < 1e-12


def test_blas_error_stays_within_the_bound_refine_uses():
    rng = np.random.default_rng(5)
    idx = DenseIndex(D)
    v = _unit(rng.normal(size=(3000, D)))
    idx.add(np.arange(3000), v)
    q = _unit(rng.normal(size=(20, D)))  # 20 queries: FAISS's BLAS path
    ids, scores = idx.search(q, 3000)
    for i in range(20):
        err = np.abs(scores[i].astype(np.float64) - idx.exact_slots(q[i], ids[i])).max()
        assert err <= idx.score_error(q[i]) / 2
    assert np.abs(idx.score_all(q) - np.stack([idx.exact_rows(x, np.arange(3000)) for x in q])).max() <= idx.score_error(q[0])


def test_refine_top_equals_exact_ranking_and_asks_for_more_when_the_cut_is_close():
    rng = np.random.default_rng(9)
    exact = np.round(rng.normal(size=500), 2)  # many exact ties
    approx = exact + rng.uniform(-1e-3, 1e-3, size=500)
    ids = [f"c{i:04d}" for i in range(500)]
    pos, ex = refine_top(approx, 1e-3, lambda p: exact[p], ids, 20)
    want = sorted(range(500), key=lambda i: (-exact[i], ids[i]))[:20]
    assert pos.tolist() == want and ex.tolist() == exact[want].tolist()
    assert refine_top(np.array([3.0, 2.0, 1.0]), 0.1, lambda p: np.array([3.0, 2.0, 1.0])[p], ["a", "b", "c"], 1,
                      complete=False)[0].tolist() == [0]
    assert refine_top(np.array([3.0, 2.95]), 0.1, lambda p: p, ["a", "b"], 1, complete=False) is None


def test_refine_top_ranked_by_the_compiled_rank_top_equals_the_chunk_id_order():
    """The shard's refine (session 44) ranks its shortlist with ``kernels_refine.rank_top`` over the slot-indexed id
    array instead of ``top_k_order`` over the ids of every fetched slot: the same positions and scores, ties included
    (slots whose order differs from their chunk ids' order)."""
    from oprag_server.index.kernels_refine import rank_top

    rng = np.random.default_rng(44)
    for trial in range(30):
        m = int(rng.integers(1, 400))
        exact = np.round(rng.normal(size=m), int(rng.integers(1, 4)))  # ties at the cut
        approx = exact + rng.uniform(-1e-3, 1e-3, size=m)
        slots = rng.permutation(5000)[:m].astype(np.int64)  # fetched slots, in the index's order
        slot_ids = np.empty(5000, dtype=object)
        slot_ids[:] = [f"c{(7919 * i) % 5000:05d}" for i in range(5000)]  # ids not in slot order
        k = int(rng.integers(1, m + 5))
        want = refine_top(approx, 1e-3, lambda p: exact[p], [slot_ids[s] for s in slots], k)
        got = refine_top(approx, 1e-3, lambda p: exact[p], None, k,
                         rank=lambda ex, sh, kk: rank_top(ex, slot_ids, kk, rows=slots[sh]))
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), trial
        order = sorted(range(m), key=lambda i: (-exact[i], slot_ids[slots[i]]))[:k]
        assert got[0].tolist() == order


def _fold_by_columns(v: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The documented order, spelled out on the (M, D) layout."""
    p = v.astype(np.float64) * q.astype(np.float64)
    w = p.shape[1]
    while w > 1:
        h = w // 2
        p[:, :h] = p[:, :h] + p[:, w - h : w]
        w -= h
    return p[:, 0]


@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 64, 100, 383, 384])
def test_fixed_order_dot_is_the_documented_pairwise_fold(d):
    rng = np.random.default_rng(d)
    for m in (1, 2, 37):
        v, q = rng.standard_normal((m, d)).astype(np.float32), rng.standard_normal(d).astype(np.float32)
        assert np.array_equal(fixed_order_dot(v, q), _fold_by_columns(v, q))
    assert fixed_order_dot(np.zeros((3, 0), np.float32), np.zeros(0, np.float32)).tolist() == [0.0, 0.0, 0.0]
