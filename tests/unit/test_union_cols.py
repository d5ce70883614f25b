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
    b, c, y, z = (rng.choice([0.0, -0.0, 0.5, -1.0, 2.0], k) if rng.random() < 0.3 else rng.standard_normal(k)
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
        both = [bool((c == 0).any() and np.signbit(c[c == 0]).any() and not np.signbit(c[c == 0]).all())
                for c in (ref[2], ref[3])]
        assert got[9] == (not any(both))  # numpy's ranges bit for bit unless a column holds both signs of zero
        if ref[2].size and got[9]:
            want = np.asarray([ref[2].min(), ref[2].max(), ref[3].min(), ref[3].max()])
            assert got[8].tobytes() == want.tobytes() or np.isnan(want).any() and np.array_equal(got[8], want, equal_nan=True)
        elif not ref[2].size:
            assert np.isnan(got[8]).all()


def test_not_in_keeps_order_and_duplicates_of_the_dense_side():
    ds = np.asarray([5, 3, 3, 9], dtype=np.int64)
    ls = np.asarray([9, 1, 3, 7, 5, 2], dtype=np.int64)
    assert not_in(ds, ls).tolist() == [1, 3, 5]
    assert not_in(np.zeros(0, np.int64), ls).tolist() == list(range(6))


def test_fuse_rank_is_fuse_top_then_hit_ranks():
    from oprag_server.index.kernels_merge import fuse_top, hit_ranks
    from oprag_server.operators.union import fuse_rank

    rng = np.random.default_rng(5)
    seen_strict = seen_loose = 0
    for t in range(400):
        m = int(rng.integers(0, 50))
        pick = [0.0, 0.25, 0.5, 1.0] if t % 3 == 0 else None
        d = rng.choice(pick, m) if pick else rng.standard_normal(m)
        lx = rng.choice(pick, m) if pick else np.where(rng.random(m) < 0.3, 0.0, rng.standard_normal(m))
        if t % 17 == 0 and m:
            d[0] = np.nan
        args = (d, lx, -1.0, 2.0, -0.5, 3.0, 0.6, 0.4, int(rng.integers(1, 12)))
        n = int(rng.integers(1, 40))
        nb = int(rng.integers(0, 4))
        bd, bl = rng.choice([0.1, 0.5, -0.3, np.inf, np.nan], nb, p=[.3, .3, .3, .05, .05]), rng.standard_normal(nb)
        s, top, strict, dr, okd, lr, okl, ub, finite = fuse_rank(*args, n, bd, bl)
        s0, top0, strict0 = fuse_top(*args)
        assert s.tobytes() == s0.tobytes() and strict == strict0
        fin = bool(np.isfinite(bd).all() and np.isfinite(bl).all())
        want = -np.inf if not nb else float(fuse_top(bd, bl, *args[2:8], 0)[0].max()) if fin else np.inf
        assert finite == fin and (ub == want or np.isnan(ub) and np.isnan(want))
        if strict:
            seen_strict += 1
            assert top.tolist() == top0.tolist()
            for got, ok, ref in ((dr, okd, hit_ranks(d, top0, n, False)), (lr, okl, hit_ranks(lx, top0, n, True))):
                assert ok == ref[1] and got.tolist() == ref[0].tolist()
        else:
            seen_loose += 1
            assert not okd and not okl
    assert seen_strict > 50 and seen_loose > 50


def _hit_ranks_ref(vals, rows, n, lexical):
    """The scan kernels_merge.hit_ranks replaced (stops at the first NaN; branches per score):
    the reference its branch-free scan must equal."""
    out = np.zeros(rows.size, np.int64)
    for q in range(rows.size):
        v = vals[rows[q]]
        if v != v:
            return out, False
        if lexical and v == 0.0:
            continue
        ahead, eq = 0, 0
        for t in range(vals.size):
            x = vals[t]
            if x != x:
                return out, False
            if x > v and not (lexical and x == 0.0):
                ahead += 1
            elif x == v:
                eq += 1
        if ahead < n:
            if eq > 1:
                return out, False
            out[q] = ahead + 1
    return out, True


def test_hit_ranks_branch_free_scan_equals_the_reference_scan():
    """The branch-free scan gives the reference scan's ranks and flag, also with NaN anywhere,
    -0.0, ties, rows scoring 0 in the BM25 list and windows shorter than the ties."""
    from oprag_server.index.kernels_merge import hit_ranks

    rng = np.random.default_rng(11)
    flags = set()
    for t in range(3000):
        m = int(rng.integers(1, 80))
        pool = [0.0, -0.0, 0.25, 0.5, 1.0, -1.0, np.inf, -np.inf]
        vals = rng.choice(pool, m) if t % 2 else np.where(rng.random(m) < 0.3, 0.0, rng.standard_normal(m))
        if t % 5 == 0:
            vals[int(rng.integers(0, m))] = np.nan
        rows = rng.choice(m, int(rng.integers(0, min(m, 12) + 1)), replace=False).astype(np.int64)
        n = int(rng.integers(1, 90))
        for lexical in (False, True):
            got, ok = hit_ranks(vals, rows, n, lexical)
            ref, ok0 = _hit_ranks_ref(vals, rows, n, lexical)
            assert ok == ok0 and got.tolist() == ref.tolist(), (t, lexical)
            flags.add(ok)
    assert flags == {True, False}
