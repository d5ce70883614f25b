"""The compiled union of the dense-first merge (``operators/union.py``) against the Python/numpy
loop it replaced in ``merge_union`` (issue 13, front12): the same columns in the same order, the
same BM25-only positions, and numpy's minima (NaN when any value is NaN)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.operators.union import not_in, union_cols


def _reference(shards, ds, dd, dl, ls, ld, ll):
    shard, slot, dense, lexical, extras, dmin, lmin = [], [], [], [], [], [], []
    for s, a, b, c, x, y, z in zip(shards, ds, dd, dl, ls, ld, ll):
        seen = set(a.tolist())
        e = np.asarray([i for i, v in enumerate(x.tolist()) if v not in seen], dtype=np.int64) if x.size else x
        shard.append(np.full(a.size + e.size, s, dtype=np.int64))
        slot += (a, x[e])
        dense += (b, y[e])
        lexical += (c, z[e])
        extras.append(e)
        dmin.append(float(b.min()) if b.size else np.nan)
        lmin.append(float(z.min()) if z.size else np.nan)
    cat = lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)  # noqa: E731
    return (cat(shard, np.int64), cat(slot, np.int64), cat(dense, np.float64), cat(lexical, np.float64), extras,
            dmin, lmin)


def _lists(rng, n_slots, nan):
    n = int(rng.integers(0, 40))
    a = rng.choice(n_slots, size=min(n, n_slots), replace=False).astype(np.int64)
    m = int(rng.integers(0, 20))
    both = rng.choice(a, size=min(len(a), m // 2), replace=False) if len(a) else np.zeros(0, np.int64)
    x = np.concatenate([both, rng.integers(0, n_slots, m - len(both))]).astype(np.int64)
    x = np.unique(x)  # (a shard's list has distinct slots)
    rng.shuffle(x)
    b, c, y, z = (rng.choice([0.0, 0.5, -1.0, 2.0], k) if rng.random() < 0.3 else rng.standard_normal(k)
                  for k in (len(a), len(a), len(x), len(x)))
    if nan and len(b):
        b[rng.integers(0, len(b))] = np.nan
    if nan and len(z):
        z[rng.integers(0, len(z))] = np.nan
    return a, b, c, x, y, z


@pytest.mark.parametrize("n_shards", [1, 2, 3])
def test_union_cols_equals_the_python_loop(n_shards):
    rng = np.random.default_rng(n_shards)
    for t in range(300):
        parts = [_lists(rng, int(rng.integers(1, 60)), nan=t % 7 == 0) for _ in range(n_shards)]
        shards = np.asarray(rng.permutation(8)[:n_shards], dtype=np.int64)
        args = tuple(tuple(np.ascontiguousarray(p[i]) for p in parts) for i in range(6))
        got = union_cols(shards, *args)
        ref = _reference(shards, *args)
        for g, r in zip(got[:4], ref[:4]):
            assert g.dtype == r.dtype and np.array_equal(g, r, equal_nan=True)
        off = got[5]
        assert [got[4][off[k]:off[k + 1]].tolist() for k in range(n_shards)] == [e.tolist() for e in ref[4]]
        np.testing.assert_array_equal(got[6], np.asarray(ref[5]))
        np.testing.assert_array_equal(got[7], np.asarray(ref[6]))


def test_not_in_keeps_order_and_duplicates_of_the_dense_side():
    ds = np.asarray([5, 3, 3, 9], dtype=np.int64)
    ls = np.asarray([9, 1, 3, 7, 5, 2], dtype=np.int64)
    assert not_in(ds, ls).tolist() == [1, 3, 5]
    assert not_in(np.zeros(0, np.int64), ls).tolist() == list(range(6))
