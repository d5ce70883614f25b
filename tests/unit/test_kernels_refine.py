"""The flat shard's dense step with the second filter (index/kernels_refine.py): the same exact
top-n, canonical scores, ties flag and minimum as ``kernels.dense_step`` on random, duplicated,
clustered and cancelling vectors (where summation orders differ most), unfiltered and filtered,
for n from 1 to past the row count; with no error allowance for the fast sums (``err2`` 0) the
cancelling vectors give another top-n (the comparison can fail)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index import kernels, kernels_refine, kernels_scan


def _vecs(rng, kind: str, m: int, d: int) -> np.ndarray:
    if kind == "dups":
        v = rng.normal(size=(m // 4 + 1, d))[rng.integers(0, m // 4 + 1, m)]
    elif kind == "clustered":
        v = rng.normal(size=(5, d))[rng.integers(0, 5, m)] + 0.05 * rng.normal(size=(m, d))
    elif kind == "cancel":  # large entries that cancel: every summation order rounds differently
        v = rng.normal(size=(m, d)) * 1e-3
        v[:, 0] = 1e4 * rng.choice([-1.0, 1.0], m)
        v[:, 1] = -v[:, 0] * (1 + rng.normal(size=m) * 1e-7)
        return v.astype(np.float32)
    else:
        v = rng.normal(size=(m, d))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _top(res, kk):
    short, ex, order, ties, low, status = res
    o = order[:kk]
    return short[o].tolist(), ex[o].tobytes(), bool(ties), float(low), int(status), sorted(short[order].tolist())


def _both(v, q, n, rows, every, err2=None, per_row=True, rf=None):
    i8 = kernels_scan.Int8Rows().of(v, 0)
    approx, err = i8.scores(q, None if every else rows), i8.error(q)
    sample = np.arange(v.shape[0], dtype=np.int64) if every else np.zeros(0, np.int64)
    e2 = kernels_refine.fast_error(i8.c + i8.e, v.shape[1], q) if err2 is None else err2
    rb = i8.rb if per_row else np.zeros(0)
    a = kernels.dense_step(v, rows, every, approx, q, err, n, sample)
    b = kernels_refine.dense_step_fast(v, rows, every, approx, q, err, n, sample, e2, rb,
                                       i8.row_scale(q) if rf is None else rf)
    return a, b, min(n, approx.size)


@pytest.mark.parametrize("kind", ["random", "dups", "clustered", "cancel"])
@pytest.mark.parametrize("d", [3, 64, 384])
def test_dense_step_fast_is_dense_step(kind, d):
    rng = np.random.default_rng(d)
    m = 700
    v = _vecs(rng, kind, m, d)
    narrowed = 0
    for trial in range(12):
        q = v[rng.integers(m)] + 0.05 * rng.normal(size=d).astype(np.float32) if trial % 3 else rng.normal(size=d)
        q = np.ascontiguousarray(q, np.float32)
        for n in (1, 10, 256, m + 3):
            every = trial % 2 == 0
            rows = np.zeros(0, np.int64) if every else np.sort(rng.choice(m, 400, replace=False)).astype(np.int64)
            for per_row in (True, False):
                a, b, kk = _both(v, q, n, rows, every, per_row=per_row)
                ta, tb = _top(a, kk), _top(b, kk)
                assert ta[:5] == tb[:5], (kind, d, n, trial, per_row)
                assert set(tb[5]) >= set(ta[0]) and b[0].size <= a[0].size
                narrowed += b[0].size < a[0].size
    assert narrowed > 0


def test_no_allowance_for_the_fast_sums_changes_the_result():
    """Rows that are column permutations of one vector with large cancelling entries: the same
    exact inner product with an all-ones query, different roundings in each summation order."""
    differ = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        w = rng.normal(size=64) * 1e-2
        w[:8] = 1e4 * np.array([1, -1, 1, -1, 1, -1, 1, -1]) * (1 + rng.normal(size=8) * 1e-6)
        v = np.stack([w[rng.permutation(64)] for _ in range(600)]).astype(np.float32)
        q = np.ones(64, np.float32)
        a, b, kk = _both(v, q, 50, np.zeros(0, np.int64), True, err2=0.0)
        differ += _top(a, kk)[:2] != _top(b, kk)[:2]
        a, b, kk = _both(v, q, 50, np.zeros(0, np.int64), True)
        assert _top(a, kk)[:5] == _top(b, kk)[:5]
    assert differ > 0


def test_rank_top_is_top_k_order():
    """With and without ties (at the edge, inside, all equal), NaN, k past the length, rows."""
    from oprag_server.index.fusion import top_k_order

    rng = np.random.default_rng(3)
    fast = 0
    for trial in range(600):
        n = int(rng.integers(0, 90))
        s = np.round(rng.standard_normal(n) * 3, int(rng.integers(0, 4)))
        if trial % 17 == 0 and n:
            s[rng.integers(n)] = np.nan
        ids = np.array([f"c{x:04d}" for x in rng.permutation(200)], dtype=object)
        rows = rng.choice(200, n, replace=False)
        m = int(rng.integers(0, 80))
        got = kernels_refine.rank_top(s, ids, m, rows=rows)
        assert got.dtype == np.int64
        assert got.tolist() == list(top_k_order(s, ids, m, rows=rows)), (trial, n, m)
        fast += n > m > 0 and len(set(s.tolist())) == n
    assert fast > 50  # (many took the path without ids)


def test_rank_top_without_the_tie_check_would_differ():
    from oprag_server.index.fusion import top_k_order

    s = np.array([1.0, 2.0, 2.0, 0.5])
    ids = np.array(["b", "z", "a", "c"], dtype=object)
    assert kernels_refine.rank_top(s, ids, 2).tolist() == list(top_k_order(s, ids, 2)) == [2, 1]
    assert np.argsort(-s, kind="stable")[:2].tolist() == [1, 2]  # (what no tie check would give)


@pytest.mark.parametrize("d", [7, 64, 384])
def test_the_per_row_bounds_hold_and_are_tighter(d):
    rng = np.random.default_rng(d + 1)
    for kind in ("random", "clustered", "dups"):
        v = _vecs(rng, kind, 500, d)
        i8 = kernels_scan.Int8Rows().of(v, 0)
        from oprag_server.index.dense import fixed_order_dot

        for q in list(v[:5]) + [rng.normal(size=d).astype(np.float32) * 30]:
            q = np.ascontiguousarray(q, np.float32)
            got = i8.scores(q, None).astype(np.float64)
            e = i8.row_scale(q) * i8.rb + 1e-12
            assert np.all(np.abs(got - fixed_order_dot(v, q)) <= e)
            assert np.all(e <= i8.error(q)) and e.mean() < 0.9 * i8.error(q)


def test_per_row_bounds_too_small_change_the_result():
    """The per-row filter's argument needs the bound: a hundredth of it drops true top rows."""
    differ = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        v = _vecs(rng, "clustered", 700, 64)
        q = np.ascontiguousarray(v[0] + 0.3 * rng.normal(size=64).astype(np.float32))
        i8 = kernels_scan.Int8Rows().of(v, 0)
        a, b, kk = _both(v, q, 100, np.zeros(0, np.int64), True, rf=i8.row_scale(q) / 100)
        differ += _top(a, kk)[:2] != _top(b, kk)[:2]
    assert differ > 0


@pytest.mark.parametrize("kind", ["random", "dups", "clustered", "cancel"])
@pytest.mark.parametrize("d", [3, 384])
def test_flat_top_one_is_the_steps_it_fuses(kind, d):
    """``flat_top_one`` (|q|, the integer scan, the three bounds and ``dense_step_fast`` in one
    call) returns what the steps give one by one (Int8Rows.scores / error / row_scale, fast_error):
    the same exact top-n, canonical scores, ties flag and minimum; a NaN or infinite query is
    refused with QUERY_NOT_FINITE."""
    rng = np.random.default_rng(d + 7)
    m = 600
    v = _vecs(rng, kind, m, d)
    i8 = kernels_scan.Int8Rows().of(v, 0)
    every = np.arange(m, dtype=np.int64)
    for trial in range(10):
        q = v[rng.integers(m)] + 0.05 * rng.normal(size=d).astype(np.float32) if trial % 2 else rng.normal(size=d)
        q = np.ascontiguousarray(q, np.float32)
        for n in (1, 10, 64, m + 3):
            _, b, kk = _both(v, q, n, np.zeros(0, np.int64), True)
            f = kernels_refine.flat_top_one(v, i8.codes, i8.scale, i8.rb, i8.e, i8.c, q, n, every)
            assert _top(f, kk) == _top(b, kk), (kind, d, n, trial)
            assert f[0].tolist() == b[0].tolist()  # the same rows passed both filters
    for bad in (np.nan, np.inf, -np.inf):
        q = np.ascontiguousarray(v[0].copy())
        q[d // 2] = bad
        assert kernels_refine.flat_top_one(v, i8.codes, i8.scale, i8.rb, i8.e, i8.c, q, 5, every)[5] == \
            kernels_refine.QUERY_NOT_FINITE
