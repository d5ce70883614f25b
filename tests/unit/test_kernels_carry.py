"""The carried chunks of a hybrid search reply in one compiled call (``index/kernels_carry.py``,
issue 13 hot path): the same slots, in the same order, as the numpy / Python steps
(``band_slots_reference``: union, k-skyband, min-max cone) on random lists with ties, zeros,
shared slots, empty lists, no cone, and non-finite scores (the reference path)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from oprag_server.index import kernels_carry as kc


def _lists(rng, m: int, ml: int, dec: int, shared: float):
    slots = rng.choice(10 * (m + ml) + 10, m, replace=False).astype(np.int64)
    c = NS(slots=slots, dense=np.round(rng.standard_normal(m), dec),
           lexical=np.round(np.maximum(0, rng.standard_normal(m) * 3), dec))
    ls = np.asarray([slots[rng.integers(m)] if m and rng.random() < shared else int(rng.integers(10 ** 6, 2 * 10 ** 6))
                     for _ in range(ml)], np.int64)
    ls = np.unique(ls)[rng.permutation(np.unique(ls).size)] if ml else np.zeros(0, np.int64)
    lex = NS(slots=ls, dense=np.round(rng.standard_normal(ls.size), dec),
             lexical=np.round(np.abs(rng.standard_normal(ls.size)) * 3 + 0.1, dec))
    return c, lex


@pytest.mark.parametrize("seed", range(6))
def test_band_slots_equal_the_reference(seed):
    rng = np.random.default_rng(seed)
    n_cone = 0
    for trial in range(150):
        m, ml = int(rng.integers(0, 300)), int(rng.integers(0, 70))
        c, lex = _lists(rng, m, ml, int(rng.integers(0, 3)), float(rng.random()))
        k = int(rng.integers(1, 25))
        w = [None, (0.5, 0.5), (float(rng.random()), float(rng.random())), (1.0, 0.0), (0.0, 1.0)][trial % 5]
        dmin = [float(rng.standard_normal() - 2), np.inf, np.nan, -0.0][trial % 4]
        cone = w and (w, dmin, rng.random(int(rng.integers(1, 30))) * 3, 1.5)
        for lx in (lex, None, NS(slots=np.zeros(0, np.int64), dense=np.zeros(0), lexical=np.zeros(0))):
            got = kc.band_slots(c, lx, k, cone)
            want = kc.band_slots_reference(c, lx, k, cone)
            assert got.dtype == np.int64 and got.tolist() == want.tolist(), (trial, k, w)
            n_cone += bool(cone) and lx is lex and want.size < kc.band_slots_reference(c, lx, k, None).size
    assert n_cone > 20  # the cone did narrow many of these


def test_non_finite_scores_take_the_reference_path():
    rng = np.random.default_rng(9)
    c, lex = _lists(rng, 50, 20, 2, 0.3)
    c.dense[3] = np.nan
    lex.lexical[2] = np.inf
    out, ok = kc.carry_band(c.slots, c.dense, c.lexical, lex.slots, lex.dense, lex.lexical, 5, 0.5, 0.5, -1.0, 3.0)
    assert not ok and out.size == 0
    assert kc.band_slots(c, lex, 5, ((0.5, 0.5), -1.0, np.ones(3), 1.5)).tolist() == \
        kc.band_slots_reference(c, lex, 5, ((0.5, 0.5), -1.0, np.ones(3), 1.5)).tolist()


def test_a_union_that_drops_the_dedup_fails():
    """The comparison can fail: a union that keeps a BM25 chunk already among the dense
    candidates carries it twice."""
    c = NS(slots=np.array([1, 2, 3], np.int64), dense=np.array([0.9, 0.5, 0.1]), lexical=np.array([0.0, 1.0, 2.0]))
    lex = NS(slots=np.array([3, 7], np.int64), dense=np.array([0.1, 0.05]), lexical=np.array([2.0, 3.0]))
    got = kc.band_slots(c, lex, 2, None).tolist()
    assert got == kc.band_slots_reference(c, lex, 2, None).tolist() and got.count(3) == 1
    naive = np.concatenate([c.slots, lex.slots])
    assert sorted(got) != sorted(naive.tolist())
