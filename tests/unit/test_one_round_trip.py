"""Retrieve in one shard round trip (issue 13, hot path): the search reply carries the fields of
every candidate that can reach the top-k (the 2-D k-skyband), so no FETCH follows; a hit whose
fields did not come along is still fetched."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_retrieval import VOCAB
from test_retrieval_ops import Corpus, _vec

from oprag_server.index.fusion import fuse_minmax, skyband, top_k_order
from oprag_server.operators.retrieve import RetrieveSpec
from oprag_server.shards.protocol import Op


def _brute_top(d, lx, ids, k, wd, wl, rrf):
    if rrf:
        dr = np.empty(len(d), np.int64)
        dr[top_k_order(d, ids, len(d))] = np.arange(1, len(d) + 1)
        pos = np.flatnonzero(lx != 0)
        lr = np.zeros(len(d), np.int64)
        lr[pos[top_k_order(lx[pos], [ids[i] for i in pos], len(pos))]] = np.arange(1, len(pos) + 1)
        s = wd / (60 + dr) + np.where(lr > 0, wl / (60 + np.maximum(lr, 1)), 0.0)
    else:
        s = fuse_minmax(d, lx, dense_range=(d.min(), d.max()), lexical_range=(min(0.0, lx.min()), lx.max()),
                        dense_weight=wd, lexical_weight=wl)
    return set(top_k_order(s, ids, k))


@pytest.mark.parametrize("seed", range(20))
def test_every_fused_top_k_lies_in_the_skyband(seed):
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(1, 300)), int(rng.integers(1, 15))
    d = np.round(rng.normal(size=m), 2)  # rounded: ties happen
    lx = np.where(rng.random(m) < 0.4, 0.0, np.round(rng.normal(1, 2, size=m), 1))  # negative BM25 too
    ids = [f"c{i:04d}" for i in rng.permutation(m)]
    band = set(skyband(d, lx, k).tolist())
    for _ in range(10):
        wd, wl = rng.uniform(0.05, 2, size=2)
        for rrf in (False, True):
            assert _brute_top(d, lx, ids, k, wd, wl, rrf) <= band


def test_skyband_keeps_all_when_few_and_none_for_k_0():
    assert skyband(np.array([1.0, 2.0]), np.array([0.0, 1.0]), 5).tolist() == [0, 1]
    assert skyband(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0]), 1).tolist() == [2]
    assert skyband(np.array([1.0]), np.array([1.0]), 0).size == 0


class _Counting:
    """Wraps a pool's transports and counts the ops they are asked."""

    def __init__(self, pool):
        self.ops: list[Op] = []
        for c in pool.clients:
            inner = c.call

            def call(op, req, inner=inner):
                self.ops.append(op)
                return inner(op, req)

            c.call = call


def _corpus(seed=0, n=60):
    rng = np.random.default_rng(seed)
    c = Corpus()
    for i in range(n):
        c.put(f"doc{i:02d}", [" ".join(rng.choice(VOCAB[:8], size=6).tolist())], _vec(rng, 1),
              {"n": i})
    return c, _vec(rng, 1)[0]


@pytest.mark.parametrize("mode,fusion", [("hybrid", "minmax"), ("hybrid", "rrf"), ("dense", "minmax"),
                                         ("lexical", "minmax"), ("full_hybrid", "minmax")])
def test_hits_come_without_a_fetch_round_trip(mode, fusion):
    c, qv = _corpus()
    count = _Counting(c.retriever.pool)
    hits, _ = c.retrieve("alpha beta", qv, mode=mode, fusion=fusion, top_k=7, candidates=30)
    assert len(hits) == 7 and all(h.text and h.doc_id for h in hits)
    assert Op.FETCH not in count.ops, count.ops
    assert hits[0].metadata == {"n": int(hits[0].doc_id[3:])}


def test_hits_whose_fields_did_not_come_along_are_fetched():
    c, qv = _corpus(1)
    want, _ = c.retrieve("alpha beta", qv, mode="hybrid", top_k=7, candidates=30)
    count = _Counting(c.retriever.pool)
    r = c.retriever
    hits = asyncio.run(r._materialise([[]]))[0]
    assert hits == [[]] and count.ops == []
    # drop what the shards sent: every hit is fetched instead, with identical fields
    orig = r._materialise
    r._materialise = lambda results, fetched=None: orig(results, {})
    again, _ = c.retrieve("alpha beta", qv, mode="hybrid", top_k=7, candidates=30)
    assert again == want and Op.FETCH in count.ops


@pytest.mark.parametrize("seed", range(30))
def test_cone_keeps_every_top_k_of_the_allowed_fusions(seed):
    """kernels_cone.cone_keep: for every rho >= rho_lo the top-k of d + rho l (ties: any order)
    lies in what it keeps, and it keeps less than the skyband when rho_lo is large enough."""
    from oprag_server.index.kernels_cone import cone_keep

    rng = np.random.default_rng(seed)
    s, k = int(rng.integers(1, 80)), int(rng.integers(1, 12))
    d = np.round(rng.normal(size=s), int(rng.integers(1, 4)))  # ties at 1-3 decimals
    lx = np.where(rng.random(s) < 0.3, 0.0, np.round(rng.gamma(2, 3, size=s), int(rng.integers(0, 3))))
    rho_lo = float(rng.choice([0.0, 1e-3, 0.05, 0.3, 2.0]))
    keep = cone_keep(d, lx, k, rho_lo)
    ahead = lambda f, x: int(np.count_nonzero(f > f[x]))  # noqa: E731
    rhos = [rho_lo, rho_lo * 1.0001 + 1e-9, 1e6] + list(rho_lo + rng.exponential(1.0, size=40))
    for rho in rhos:
        f = d + rho * lx
        for x in range(s):
            if ahead(f, x) < k:  # x can be in the top-k (after ties broken its way)
                assert keep[x], (rho, x)
    assert cone_keep(d, lx, s + 1, rho_lo).all()


def test_cone_is_narrower_than_the_skyband():
    from oprag_server.index.kernels_cone import cone_keep

    rng = np.random.default_rng(7)
    d, lx = rng.normal(size=200), rng.gamma(2, 3, size=200)
    band = skyband(d, lx, 5)
    wide, narrow = cone_keep(d[band], lx[band], 5, 0.0), cone_keep(d[band], lx[band], 5, 0.5)
    assert (wide >= narrow).all() and narrow.sum() < wide.sum() <= band.size  # linear fusions: fewer still


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_carries_fewer_fields_and_still_needs_no_fetch(seed):
    """With the fusion's weights in the request the shards carry only the skyband chunks that can
    be in its top-k: over queries and weights no FETCH follows, the hits equal those of a search
    carrying the whole skyband, and fewer fields come along in all."""
    from oprag_server.shards import search as search_mod

    c, _ = _corpus(seed, n=150)
    rng = np.random.default_rng(seed)
    count, carried = _Counting(c.retriever.pool), {True: 0, False: 0}
    orig_fields, orig_band = search_mod.Searcher._fields, search_mod.Searcher.__dict__["_skyband_slots"]
    whole = staticmethod(lambda c, lex, k, cone=None: orig_band.__func__(c, lex, k, None))  # the whole skyband
    narrow = [True]

    def fields(self, slots):
        carried[narrow[0]] += len(slots)
        return orig_fields(self, slots)

    search_mod.Searcher._fields = fields
    try:
        for _ in range(15):
            qv = _vec(rng, 1)[0]
            q = " ".join(rng.choice(VOCAB[:8], size=int(rng.integers(1, 4))).tolist())
            wd, wl = (float(x) for x in rng.uniform(0.05, 2, size=2))
            kw = dict(mode="hybrid", top_k=int(rng.integers(1, 9)), candidates=int(rng.integers(8, 40)),
                      dense_weight=wd, lexical_weight=wl)
            del count.ops[:]
            narrow[0] = True
            search_mod.Searcher._skyband_slots = orig_band
            hits, _ = c.retrieve(q, qv, **kw)
            assert Op.FETCH not in count.ops
            narrow[0] = False
            search_mod.Searcher._skyband_slots = whole
            assert c.retrieve(q, qv, **kw)[0] == hits
    finally:
        search_mod.Searcher._fields, search_mod.Searcher._skyband_slots = orig_fields, orig_band
    assert 0 < carried[True] < carried[False], carried
