"""The compiled candidate step (``index/kernels.py``, issue 13) against its numpy references, bit
for bit: canonical dot products (``fixed_order_dot``), selection and stable ordering, the exact
dense top-n (``refine_top`` over FAISS / BLAS scores), BM25 of candidates from the CSR segment
(the numpy loop it replaced, kept below) and the k-skyband (``skyband_reference``); then whole
shard searches, kernels vs the numpy path, on real shard states with random vectors, duplicate
vectors (ties), scores of exactly +-0, filters, deleted chunks, a merged segment plus a delta,
and shards smaller than n."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.index import kernels, kernels_low
from oprag_server.index.bm25 import listed_top as listed_top_mod
from oprag_server.index.bm25.listed_top import listed_top, listed_top_reference, listed_top_scored
from oprag_server.index.bm25.merging import _SEG
from oprag_server.index.fusion import top_k_order
from oprag_server.index.dense import fixed_order_dot
from oprag_server.index.fusion import skyband, skyband_reference
from oprag_server.shards import search as search_mod
from oprag_server.shards.protocol import QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _vectors(rng, kind: str, m: int, d: int) -> np.ndarray:
    if kind == "random":
        return _unit(rng.normal(size=(m, d)))
    if kind == "dups":  # few distinct vectors: many equal canonical scores
        return _unit(rng.normal(size=(4, d)))[rng.integers(0, 4, m)]
    # sparse, one-hot-like rows: many scores exactly 0.0 or -0.0 for a sparse query
    v = np.zeros((m, d), np.float32)
    v[np.arange(m), rng.integers(0, d, m)] = rng.choice([-1.0, 1.0], m)
    return v


@pytest.mark.parametrize("d", [0, 1, 2, 3, 5, 37, 64, 384, 385])
def test_canonical_rows_is_fixed_order_dot(d):
    rng = np.random.default_rng(d)
    v = rng.normal(size=(50, d)).astype(np.float32)
    v[3] = -0.0
    v[4] = v[5]
    v[6, : d // 2] = 1e-40  # subnormal float32
    q = rng.normal(size=d).astype(np.float32)
    rows = rng.integers(0, 50, 70).astype(np.int64)
    assert kernels_low.canonical_rows(v, rows, q).tobytes() == fixed_order_dot(v[rows], q).tobytes()


@pytest.mark.parametrize("seed", range(12))
def test_selection_and_stable_order_match_numpy(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 3000))
    a = rng.choice([0.0, -0.0, 1.0, 2.0], m) if seed % 2 else rng.normal(size=m)
    a = a.astype(np.float32 if seed % 3 else np.float64)
    for k in {1, 2, m // 3 + 1, m // 8 + 1, m}:
        assert kernels._kth_largest(a, k) == np.partition(a, m - k)[m - k]
    idx = np.sort(rng.choice(m, min(m, 300), replace=False)).astype(np.int64)
    keys = a.astype(np.float64)
    assert kernels._argsort_desc(keys, idx).tolist() == idx[np.argsort(-keys[idx], kind="stable")].tolist()


@pytest.mark.parametrize("seed", range(12))
def test_argsort_desc_is_the_stable_order_and_the_merge_sort(seed):
    """numba's merge sort of the negated keys (the fast path), the bottom-up merge it replaced
    (NaN keys) and numpy's stable argsort agree: ties in ``idx`` order, integer keys, any idx."""
    rng = np.random.default_rng(100 + seed)
    m = int(rng.integers(0, 700))
    keys = rng.choice([0.0, -0.0, 1.0, 2.5], m) if seed % 2 else np.round(rng.normal(size=m), 1)
    idx = rng.permutation(m)[: int(rng.integers(0, m + 1))].astype(np.int64)
    want = idx[np.argsort(-keys[idx], kind="stable")].tolist()
    assert kernels._argsort_desc(keys, idx).tolist() == want == kernels._merge_desc(keys, idx).tolist()
    ik = rng.integers(0, 50, m).astype(np.int64)
    assert kernels._argsort_desc(ik, idx).tolist() == idx[np.argsort(-ik[idx], kind="stable")].tolist()
    if m:
        keys[rng.integers(m)] = np.nan  # the merge: a NaN key never moves ahead of another
        assert kernels._argsort_desc(keys, idx).tolist() == kernels._merge_desc(keys, idx).tolist()


@pytest.mark.parametrize("seed", range(30))
def test_skyband_kernel_is_the_reference(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(0, 300))
    d = rng.choice([0.1, 0.2, -0.0, 0.0, 0.3], m) if seed % 2 else rng.normal(size=m)
    lx = rng.choice([0.0, 0.0, -0.0, 1.5, -0.7, 2.0], m) if seed % 3 else np.abs(rng.normal(size=m)) * (rng.random(m) < 0.8)
    for k in (0, 1, 3, 10, m, m + 1):
        assert skyband(d, lx, k).tolist() == skyband_reference(d, lx, k).tolist()
    if m > 2:  # not finite: the reference answers
        d[1] = np.nan
        assert skyband(d, lx, 2).tolist() == skyband_reference(d, lx, 2).tolist()


def _bm25_reference(ix, slots, terms, idf, avgdl, k1=1.5, b=0.75):
    """PostingsIndex.score before the kernel: its segment loop in numpy, verbatim; the delta
    layers through the index's own delta scoring (a chunk is in the segment or in one layer, so
    per chunk the additions are in the same order as the old interleaved loop)."""
    s = np.asarray(slots, dtype=np.int64)
    idf = np.asarray(idf, dtype=np.float64)
    out = np.zeros(s.shape, dtype=np.float64)
    if s.size == 0 or avgdl == 0:
        return out
    norm = k1 * (1 - b + b * ix._doc_len[s] / avgdl)
    s32 = s.astype(np.int32)
    in_seg = ix._where[s] == _SEG
    vocab, seg_df = ix._seg.vocab, ix._seg_df
    for i, t in enumerate(terms):
        tid = vocab.get(t)
        if tid is not None and seg_df[tid]:
            ps, ptf = ix._seg.postings(tid)
            pos = ps.searchsorted(s32)
            np.minimum(pos, len(ps) - 1, out=pos)
            hit = np.flatnonzero((ps[pos] == s32) & in_seg)
            if hit.size:
                tf = ptf[pos[hit]].astype(np.float64)
                out[hit] += idf[i] * (tf * (k1 + 1) / (tf + norm[hit]))
    ix._add_delta_scores(out, s, terms, idf, k1, norm)
    return out


def _shard(rng, kind: str, m: int, d: int, merge_at: int | None) -> ShardState:
    """One shard of m chunks (documents of 1-3 chunks); the postings merged into a segment after
    ``merge_at`` chunks (None: all in the delta); then a fifth of the documents deleted."""
    sh = ShardState(0, d, None)
    vecs = _vectors(rng, kind, m, d)
    done, doc = 0, 0
    while done < m:
        c = min(m - done, int(rng.integers(1, 4)))
        texts = [" ".join(rng.choice(WORDS, int(rng.integers(0, 9)))) for _ in range(c)]
        ids = [f"d{doc:04d}#{i}" for i in range(c)]
        batch = records.make_chunk_batch(
            chunk_ids=ids, doc_ids=[f"d{doc:04d}"] * c, titles=[""] * c, texts=texts, metadata=[{"g": doc % 3}] * c,
            ordinals=list(range(c)), generations=[1] * c, vectors=vecs[done:done + c],
            content_hashes=[hashlib.sha256(f"{doc}{t}".encode()).hexdigest() for t in texts])
        sh.store.upsert(pa.Table.from_batches([batch]), 1)
        done, doc = done + c, doc + 1
        if merge_at is not None and done >= merge_at and not sh.store.postings.merges:
            sh.store.postings.merge()
    gone = [f"d{i:04d}" for i in rng.choice(doc, doc // 5, replace=False)]
    sh.store.delete(gone, 2)
    return sh


def _reference_path(monkeypatch, searcher):
    """The numpy path of Searcher.search: FAISS / BLAS + refine_top, the BM25 loop, the reference skyband."""
    def tops(q, allowed, n):
        plain = [i for i, a in enumerate(allowed) if a is None]
        res = searcher._dense_tops(q, plain, n) if plain else {}
        dense = searcher.store.dense
        rows = [np.arange(len(dense)) if a is None else dense.rows(a) for a in allowed]  # exact minimum: every row
        lows = [float(fixed_order_dot(dense.vectors[r], q[i]).min()) if r.size else np.inf for i, r in enumerate(rows)]
        return [res[i] if i in res else searcher._dense_top(q[i], n, allowed[i]) for i in range(q.shape[0])], lows

    monkeypatch.setattr(searcher, "_kernel_tops", tops)
    monkeypatch.setattr(searcher.store.postings, "score",
                        lambda *a, **kw: _bm25_reference(searcher.store.postings, *a, **kw))
    from oprag_server.index import kernels_carry  # (the carried chunks: its numpy steps, the reference skyband)

    monkeypatch.setattr(kernels_carry, "band_slots", kernels_carry.band_slots_reference)
    monkeypatch.setattr(kernels_carry, "skyband", skyband_reference)
    monkeypatch.setattr(search_mod, "listed_top", listed_top_reference)
    # the BM25 list by numpy; no candidate scores from it: the candidates through the patched score
    monkeypatch.setattr(search_mod, "listed_top_scored", lambda *a, **kw: (*listed_top_reference(*a[:8]), a[9]()))


def _key(rep):
    c = [(x.slots.tobytes(), x.chunk_ids, x.dense.tobytes(), x.lexical.tobytes()) for x in rep.candidates]
    f = [(x.slots, x.doc_ids, x.texts) for x in rep.fields or []]
    lx = [(x.slots.tobytes(), x.chunk_ids, x.dense.tobytes(), x.lexical.tobytes()) for x in rep.lexical or []]
    return c, rep.eligible, np.asarray(rep.dense_min).tobytes(), f, lx, rep.listed


CASES = [("random", 300, 48, 120), ("random", 40, 37, 20), ("dups", 250, 16, 100), ("zeros", 200, 32, 60),
         ("random", 9, 8, None), ("dups", 150, 5, None), ("zeros", 120, 64, 0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_shard_search_with_kernels_is_bit_identical_to_numpy(case, monkeypatch):
    # the kernel that reads every list; its MaxScore path reports a lower-bound listed count
    # and is checked against this one in test_topm_pruned.py
    monkeypatch.setattr(listed_top_mod, "_PRUNE", False)
    kind, m, d, merge_at = case
    rng = np.random.default_rng(m * d)
    sh = _shard(rng, kind, m, d, merge_at)
    q = _vectors(rng, kind, 6, d)
    q[5] = q[0]  # a repeated query vector (the dense-minimum memo)
    terms = [list(rng.choice(WORDS + ["absent"], int(rng.integers(0, 5)))) for _ in range(6)]
    idf = [rng.normal(1.0, 0.8, len(t)) for t in terms]  # negative idf too
    filters = [None, [("g", [0])], None, [("g", [1, 2])], [("g", [7])], None]
    reqs = [SearchRequest(QueryBatch(q, terms, idf, 5.5, k1, b, fl), mode, n, fetch_k=fk, m=(n * 7) % 13 if mode == "hybrid" else 0)
            for mode in ("hybrid", "dense") for n in (1, 10, 64, m + 5) for fk in (0, 10)
            for fl in (None, filters) for k1, b in ((1.5, 0.75), (1.2, 0.3))][:: 3 if m > 100 else 1]
    got = [_key(sh.search.search(r)) for r in reqs]
    sh.search._dmin = (-1, {})
    _reference_path(monkeypatch, sh.search)
    assert [_key(sh.search.search(r)) for r in reqs] == got


@pytest.mark.parametrize("seed", range(6))
def test_bm25_kernel_is_the_numpy_loop(seed):
    rng = np.random.default_rng(seed)
    sh = _shard(rng, "random", 200, 8, merge_at=int(rng.integers(0, 200)))
    ix = sh.store.postings
    live = ix.slots()
    for _ in range(10):
        slots = rng.choice(live, int(rng.integers(0, 80)))  # duplicates, any order
        t = list(rng.choice(WORDS + ["absent"], int(rng.integers(0, 7))))
        idf = rng.normal(0.5, 1.0, len(t))
        k1, b, avgdl = float(rng.uniform(0.1, 3)), float(rng.uniform(0, 1)), float(rng.uniform(0.5, 9))
        assert ix.score(slots, t, idf, avgdl, k1, b).tobytes() == _bm25_reference(ix, slots, t, idf, avgdl, k1, b).tobytes()
    with pytest.raises(KeyError):
        ix.score(np.array([10_000]), ["alpha"], np.ones(1), 3.0)


@pytest.mark.parametrize("seed", range(6))
def test_bm25_top_m_kernel_is_score_all(seed, monkeypatch):
    """The compiled BM25 top-m (segment + delta + deletes, filters, negative idf, repeated
    terms) returns score_all's listed scores bit for bit, every chunk that can be in the top-m,
    and the listed count; the top-m by (score desc, id asc) is the reference's."""
    monkeypatch.setattr(listed_top_mod, "_PRUNE", False)  # the pruned path: test_topm_pruned.py
    rng = np.random.default_rng(100 + seed)
    sh = _shard(rng, "random", 220, 8, merge_at=[None, 0, 60, 150][seed % 4])
    ix, ids = sh.store.postings, sh.store._slot_ids
    live = ix.slots()
    for _ in range(12):
        t = list(rng.choice(WORDS + ["absent"], int(rng.integers(0, 6))))
        idf = rng.normal(0.7, 1.0, len(t))
        k1, b, avgdl = float(rng.uniform(0.1, 3)), float(rng.uniform(0, 1)), float(rng.uniform(0.5, 9))
        allowed = None if rng.random() < 0.5 else np.sort(rng.choice(live, int(rng.integers(0, live.size)), replace=False))
        m = int(rng.integers(1, 40))
        s, sc, listed = listed_top(ix, t, idf, avgdl, k1, b, m, allowed)
        rs, rsc, rlisted = listed_top_reference(ix, t, idf, avgdl, k1, b, m, allowed)
        assert listed == rlisted and s.size >= min(m, listed)
        ref = dict(zip(rs.tolist(), rsc.tolist()))
        assert all(ref[x] == y for x, y in zip(s.tolist(), sc.tolist()))  # score_all's values, bit for bit
        got = [(int(s[i]), sc[i].tobytes()) for i in top_k_order(sc, ids, m, rows=s)]
        assert got == [(int(rs[i]), rsc[i].tobytes()) for i in top_k_order(rsc, ids, m, rows=rs)]
        # with a write counter: the per-chunk factors (bm25_norms) kept on the index, the same bits
        at = rng.choice(live, 30)
        for _ in range(2):  # computed, then reused
            s2, sc2, listed2, at2 = listed_top_scored(ix, t, idf, avgdl, k1, b, m, allowed, at=at, cache_version=5)
            assert listed2 == listed and s2.tolist() == s.tolist() and sc2.tobytes() == sc.tobytes()
            assert at2.tobytes() == ix.score(at, t, idf, avgdl, k1, b).tobytes()
    with pytest.raises(ValueError):
        listed_top(ix, ["alpha"], np.ones(1), 3.0, 1.5, 0.75, 0)


def test_warm_compiles_every_kernel_and_a_shard_warms_on_its_arrays():
    assert kernels.warm() >= 0.0
    sh = _shard(np.random.default_rng(1), "random", 30, 8, 10)
    assert sh.search.warm() >= 0.0
    assert ShardState(1, 8, None).search.warm() >= 0.0  # empty shard
