"""The one-retriever merge of few candidates in Python (``retrieve._merge_small``) returns what
the numpy path returns: the same candidates, order, scores and both ranks, with ties, -0.0,
infinities, repeated ids across shards and packed ids; NaN goes to the numpy path."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.domain import RetrieveSpec
from oprag_server.operators import retrieve as R
from oprag_server.shards.packed import PackedStrs
from oprag_server.shards.protocol import Candidates, SearchReply

POOL = [0.0, -0.0, 0.5, 1.0, 2.5, -1.0, np.inf, -np.inf]


def _replies(rng, sizes, packed=False):
    out = {}
    for s, n in enumerate(sizes):
        ids = [str(rng.choice(["a", "b", "ab", "é", "B", f"c{int(rng.integers(0, 9))}"])) for _ in range(n)]
        c = Candidates(rng.permutation(1000)[:n].astype(np.int64), PackedStrs("\x00".join(ids), n) if packed else ids,
                       rng.choice(POOL, n).astype(np.float64), rng.choice(POOL, n).astype(np.float64))
        out[s] = SearchReply([c], [n], [0.0], "flat", {}, None)
    return out


def _numpy(replies, spec, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(R, "_SMALL", -1)
        return R.Retriever._merge_certified(replies, 0, spec)


@pytest.mark.parametrize("seed", range(60))
def test_small_merge_equals_the_numpy_merge(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    replies = _replies(rng, [int(rng.integers(0, 12)) for _ in range(int(rng.integers(1, 4)))], packed=seed % 2 == 1)
    for mode in ("dense", "lexical"):
        for k in (1, 3, 10):
            spec = RetrieveSpec(mode=mode, top_k=k, candidates=k)
            got = R.Retriever._merge_certified(replies, 0, spec)
            assert got == _numpy(replies, spec, monkeypatch)
            assert all(type(c.slot) is int and type(c.dense) is float for c in got[0])


def test_nan_goes_to_the_numpy_path(monkeypatch):
    rng = np.random.default_rng(1)
    replies = _replies(rng, [4, 4])
    replies[1].candidates[0].dense[2] = np.nan
    assert R._merge_small(replies, 0, False, 3) is None
    spec = RetrieveSpec(mode="dense", top_k=3, candidates=3)
    assert R.Retriever._merge_certified(replies, 0, spec) == _numpy(replies, spec, monkeypatch)


def test_the_small_path_runs_for_few_candidates(monkeypatch):
    calls = []
    real = R._merge_small
    monkeypatch.setattr(R, "_merge_small", lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(2)
    R.Retriever._merge_certified(_replies(rng, [3, 3]), 0, RetrieveSpec(mode="dense", top_k=3, candidates=3))
    R.Retriever._merge_certified(_replies(rng, [40, 40]), 0, RetrieveSpec(mode="dense", top_k=40, candidates=40))
    assert len(calls) == 1
