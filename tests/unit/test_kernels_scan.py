"""The int8 scan of a flat shard (index/kernels_scan.py): its error bound holds for every row,
and whole search replies equal the float32 BLAS scan's bit for bit (shards built as in
test_kernels.py: random, duplicated and one-hot vectors, filters, deletes, writes between
queries); an error bound that is too small makes them differ (the comparison can fail)."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.index import kernels_refine, kernels_scan
from oprag_server.index.dense import fixed_order_dot
from oprag_server.shards.protocol import QueryBatch, SearchRequest
from tests.unit.test_kernels import WORDS, _key, _shard, _vectors


def _family(rng, kind, m, d):
    if kind == "clustered":
        c = rng.normal(size=(6, d))
        v = c[rng.integers(0, 6, m)] + 0.2 * rng.normal(size=(m, d))
        return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    if kind == "scaled":  # not unit: norms from 1e-3 to 1e3, a zero row, tiny values
        v = rng.normal(size=(m, d)) * 10.0 ** rng.uniform(-3, 3, (m, 1))
        v[0] = 0.0
        v[1] = 1e-30
        return v.astype(np.float32)
    return _vectors(rng, kind, m, d)


@pytest.mark.parametrize("kind", ["random", "dups", "zeros", "clustered", "scaled"])
@pytest.mark.parametrize("d", [1, 7, 64, 384])
def test_the_bound_holds_for_every_row(kind, d):
    rng = np.random.default_rng(d)
    v = _family(rng, kind, 500, d)
    rows = kernels_scan.Int8Rows().of(v, 0)
    assert rows is not None
    for q in list(_family(rng, kind, 8, d)) + [rng.normal(size=d).astype(np.float32) * 50]:
        q = np.ascontiguousarray(q, dtype=np.float32)
        got = rows.scores(q, None).astype(np.float64)
        exact = fixed_order_dot(v, q)
        err = rows.error(q)
        assert np.all(np.abs(got - exact) <= err), (np.abs(got - exact).max(), err)
        sub = rng.choice(500, 40, replace=False).astype(np.int64)
        assert np.array_equal(rows.scores(q, sub), got.astype(np.float32)[sub])
        if kind in ("random", "clustered"):
            assert err < 0.05 * float(np.linalg.norm(q))  # tight enough to shortlist few rows



@pytest.mark.parametrize("d", [1, 5, 384, 1024, 20000])
def test_the_integer_scan_sums_exactly_and_cannot_overflow(d):
    """scan_int's sums are the exact integer dot products of the codes with the query rounded to
    16-bit integers (numpy in int64), even at the largest magnitudes (every code +-127, every query
    value at the bound Q); its scores are those sums times ``scale * t`` rounded as documented."""
    rng = np.random.default_rng(d)
    v = rng.normal(size=(40, d)).astype(np.float32)
    v[0] = 1.0  # codes all 127
    v[1] = -1.0  # codes all -127
    rows = kernels_scan.Int8Rows().of(v, 0)
    for q in (np.ones(d, np.float32), -np.ones(d, np.float32), rng.normal(size=d).astype(np.float32),
              np.zeros(d, np.float32), np.eye(1, d, d // 2, dtype=np.float32)[0] * 3e-20):
        k = np.empty(d, np.int16)
        t = kernels_scan._query_int(q, k)
        qm = kernels_scan._qmax(d)
        assert qm * 127 * d < 2 ** 31 and np.abs(k.astype(np.int64)).max() <= qm
        exact = rows.codes.astype(np.int64) @ k.astype(np.int64)
        assert np.abs(exact).max() < 2 ** 31
        want = (exact.astype(np.float64) * (rows.scale.astype(np.float64) * t)).astype(np.float32)
        got = rows.scores(q, None)
        assert np.array_equal(got, want)
        assert np.array_equal(rows.scores(q, np.array([1, 0, 7], np.int64)), want[[1, 0, 7]])
        if np.abs(q).max() > 0 and d > 1:
            assert abs(int(np.abs(k).max())) == qm  # the largest query value maps to Q
        assert np.all(np.abs(got.astype(np.float64) - fixed_order_dot(v, q)) <= rows.error(q))


@pytest.mark.parametrize("d", [3, 384, 1024])
def test_the_bound_holds_for_spiky_and_tiny_queries(d):
    """Queries whose rounding to integers loses most (one large value and tiny others, values
    just below half a step, huge and subnormal scales): every row's scan error stays within both
    its own bound and the global one."""
    rng = np.random.default_rng(d + 5)
    v = _family(rng, "scaled", 300, d)
    v[2], v[3] = 1.0 / np.sqrt(d), -1.0 / np.sqrt(d)  # rows aligned with a rounding that errs alike everywhere
    rows = kernels_scan.Int8Rows().of(v, 0)
    spike = rng.normal(size=d) * 1e-6
    spike[0] = 10.0
    qm = kernels_scan._qmax(d)
    half = np.full(d, 0.49999 / qm)  # every value a hair under half a step of the largest
    half[0] = 1.0
    for q in (spike, -spike, half, half * 1e30, half * 1e-35, rng.normal(size=d) * 1e-38):
        q = q.astype(np.float32)
        if not np.isfinite(q).all():
            continue
        err = np.abs(rows.scores(q, None).astype(np.float64) - fixed_order_dot(v, q))
        assert np.all(err <= rows.error(q))
        per_row = rows.row_scale(q) * rows.rb + 1e-12
        assert np.all(err <= per_row), (err - per_row).max()

def _requests(rng, d, m):
    q = _vectors(rng, "random", 4, d)
    terms = [list(rng.choice(WORDS, 3)) for _ in range(4)]
    idf = [np.ones(3) for _ in range(4)]
    filters = [None, [("g", [0])], None, [("g", [1, 2])]]
    return [SearchRequest(QueryBatch(q, terms, idf, 5.5, 1.5, 0.75, fl), mode, n, fetch_k=10, m=8 if mode == "hybrid" else 0)
            for mode in ("hybrid", "dense") for n in (1, 10, 64, m + 5) for fl in (None, filters)]


def _both(sh, reqs):
    sh.search.int8_scan = True
    a = [_key(sh.search.search(r)) for r in reqs]
    sh.search.int8_scan = False
    sh.search._dmin = (-1, {})
    b = [_key(sh.search.search(r)) for r in reqs]
    sh.search.int8_scan = True
    return a, b


@pytest.mark.parametrize("kind,m,d", [("random", 300, 48), ("dups", 250, 16), ("zeros", 200, 32), ("random", 9, 8)])
def test_search_replies_equal_the_blas_scan(kind, m, d):
    rng = np.random.default_rng(m + d)
    sh = _shard(rng, kind, m, d, m // 2)
    reqs = _requests(rng, d, m)
    a, b = _both(sh, reqs)
    assert a == b
    assert sh.search._i8 is not None and sh.search._i8.key is not None  # the int8 path ran
    # a write between queries: the copy is rebuilt and replies still agree
    key = sh.search._i8.key
    v = _vectors(rng, kind, 3, d)
    batch = records.make_chunk_batch(
        chunk_ids=[f"new#{i}" for i in range(3)], doc_ids=["new"] * 3, titles=[""] * 3, texts=["alpha beta"] * 3,
        metadata=[{"g": 0}] * 3, ordinals=[0, 1, 2], generations=[1] * 3, vectors=v,
        content_hashes=[hashlib.sha256(f"n{i}".encode()).hexdigest() for i in range(3)])
    sh.store.upsert(pa.Table.from_batches([batch]), 3)
    sh.store.delete(["d0001", "d0002"], 4)
    a, b = _both(sh, reqs)
    assert a == b and sh.search._i8.key != key


def test_a_bound_too_small_changes_the_result(monkeypatch):
    """With a zero bound the shortlist misses rows whose int8 score is slightly low: some reply
    differs from the BLAS scan's, so the comparison above can fail."""
    rng = np.random.default_rng(5)
    sh = _shard(rng, "random", 400, 64, 200)
    reqs = [SearchRequest(QueryBatch(_vectors(rng, "random", 1, 64), [["alpha"]], [np.ones(1)], 5.5, 1.5, 0.75),
                          "dense", n, fetch_k=0) for n in (1, 3, 10, 30) for _ in range(10)]
    monkeypatch.setattr(kernels_scan.Int8Rows, "error", lambda self, q, qn=None: 0.0)
    fused = kernels_refine.flat_top_one  # (an unfiltered query's steps in one call: its bounds from E and C)
    monkeypatch.setattr(kernels_refine, "flat_top_one", lambda v, codes, scale, rb, e, c, *a: fused(
        v, codes, scale, rb * 0.0, 0.0, 0.0, *a))
    a, b = _both(sh, reqs)
    assert a != b


def test_large_or_non_finite_shards_use_the_blas_scan(monkeypatch):
    rng = np.random.default_rng(2)
    sh = _shard(rng, "random", 120, 16, 60)
    reqs = _requests(rng, 16, 120)
    monkeypatch.setattr(kernels_scan.Int8Rows, "MAX_ROWS", 50)
    a, b = _both(sh, reqs)
    assert a == b and sh.search._i8.key is None
    bad = np.ones((5, 4), np.float32)
    bad[2, 1] = np.nan
    assert kernels_scan.Int8Rows().of(bad, 0) is None
