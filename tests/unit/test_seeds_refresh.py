"""The dense-minimum seeds of an HNSW graph grown 2x are made by a thread (index/dense_low.py, refresh_seeds; session
40: the query that found the graph grown built them, 0.6 s at 17K vectors, 2.35 s at 100K): the query path never
builds them, the old seeds answer meanwhile, the new ones are adopted once made, and the minimum found stays a real
live chunk's canonical score, never below the exact one, and equal to it for most queries, as with seeds built in the
query. Vectors from two generators."""

from __future__ import annotations

import time

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import dense_low
from oprag_server.index.ann import AnnIndex
from oprag_server.index.dense import fixed_order_dot
from oprag_server.index.dense_low import LowSeeds
from tests.unit.test_ivf_background import _vectors

D = 32


def _lowest(ann: AnnIndex, low: LowSeeds, q: np.ndarray) -> tuple[float, float]:
    """(minimum found from the seeds' candidates, exact minimum) of canonical scores over live vectors."""
    c = low.candidates(ann, q[None])[0]
    st, live = ann.storage(), np.flatnonzero(ann.ann_slot >= 0)
    assert c.size and (ann.ann_slot[c] >= 0).all()
    return float(fixed_order_dot(st[c], q).min()), float(fixed_order_dot(st[live], q).min())


@pytest.mark.parametrize("how", ["gauss", "clustered"])
def test_a_graph_grown_2x_gets_new_seeds_from_a_thread(monkeypatch, how):
    monkeypatch.setattr(LowSeeds, "REFRESH_MIN", 5000)  # (the first seeds, at 4,000, built in the query)
    monkeypatch.setattr(dense_low, "REFRESH_BLOCK", 512)
    x = _vectors(how, 9000, 11, D)
    ann = AnnIndex(D, DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40))
    s = np.arange(4000)
    ann.add(s, x[:4000], (s, x[:4000]))
    low = LowSeeds()
    q = _vectors("gauss", 60, 12, D)
    low.candidates(ann, q[:1])  # built in the query: a new graph
    builds = []
    real = LowSeeds._build
    monkeypatch.setattr(LowSeeds, "_build", lambda self, a: (builds.append(1), real(self, a))[1])
    s = np.arange(4000, 9000)
    ann.add(s, x[4000:9000], (s, x[4000:9000]))  # 9,000 >= 2 x 4,000
    low.candidates(ann, q[:1])
    assert low._next is not None and low._built_at == 4000  # noqa: SLF001 - a thread makes them
    t = time.monotonic()
    while low._next is not None and low._next.thread.is_alive():  # noqa: SLF001
        found, exact = _lowest(ann, low, q[0])  # the old seeds answer meanwhile
        assert found >= exact - 1e-12
        assert time.monotonic() - t < 60
    low.candidates(ann, q[:1])  # adopts them
    assert low._next is None and low._built_at == 9000 and builds == []  # noqa: SLF001
    assert [(a, how) for a, _, how in low.built] == [(4000, "in the query that needed them"),
                                                     (9000, "by a thread while the old ones served (the graph grew 2x)")]
    got = [_lowest(ann, low, qi) for qi in q]
    assert all(f >= e - 1e-12 for f, e in got)
    fresh = LowSeeds()
    fresh.prepare(ann)  # (built now, as at a shard's start)
    ref = [_lowest(ann, fresh, qi) for qi in q]
    same = np.mean([f == e for f, e in got])
    assert same >= np.mean([f == e for f, e in ref]) - 0.1 and same >= 0.8, (same, ref)


def test_the_shard_logs_each_seeds_build(capsys):
    """trial40b: a 1.7 s query on an idle HNSW server left no line in the log; a seeds build now says when and where."""
    from oprag_server.shards.protocol import QueryBatch, SearchRequest
    from oprag_server.shards.state import ShardState
    from tests.unit.test_ivf_background import _table

    x = _vectors("clustered", 2000, 13, D)
    sh = ShardState(0, D, None, dense=DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40, ann_tail=0, ann_check=0))
    sh.store.upsert(_table(x, 0), 1)
    capsys.readouterr()
    sh.search.search(SearchRequest(QueryBatch(x[:1], [["topic"]], [np.ones(1)], 5.0, 1.5, 0.75), mode="hybrid", n=10))
    sh.note()
    err = capsys.readouterr().err
    assert ("INFO shard 0: HNSW dense-minimum seeds built for a graph of 2000 vectors (deleted ones included) in " in err
            and "(in the query that needed them)" in err), err
    sh.note()
    assert "seeds built" not in capsys.readouterr().err  # (once)


@pytest.mark.parametrize("how", ["gauss", "clustered"])
def test_a_graph_whose_seeds_are_all_deleted_says_it_has_none(how):
    """Session 41: a graph holding live vectors but no live seed returned empty candidates, which the shard read as
    "no vector live" (its minimum then from the tail alone, or none); it says None now, and the shard's minimum is the
    sample estimate, a real chunk's score never below the exact minimum."""
    from oprag_server.shards.protocol import QueryBatch, SearchRequest
    from oprag_server.shards.state import ShardState
    from tests.unit.test_ivf_background import _table

    x = _vectors(how, 3000, 21, D)
    ann = AnnIndex(D, DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40))
    s = np.arange(3000)
    ann.add(s, x, (s, x))
    low, q = LowSeeds(), _vectors("gauss", 20, 22, D)
    c = low.candidates(ann, q[:1])[0]  # built here: a new graph
    assert c is not None and c.size and [w for _, _, w in low.built] == ["in the query that needed them"]
    got = [_lowest(ann, low, qi) for qi in q]
    assert all(f >= e - 1e-12 for f, e in got) and np.mean([f == e for f, e in got]) >= 0.8
    ann.remove(low._ids)  # noqa: SLF001 - every seed deleted, the graph still holds live vectors
    assert low.candidates(ann, q[:2]) == [None, None]

    sh = ShardState(0, D, None, dense=DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40, ann_tail=0, ann_check=0))
    sh.store.upsert(_table(x, 0), 1)
    req = SearchRequest(QueryBatch(q[:3], [["topic"]] * 3, [np.ones(1)] * 3, 5.0, 1.5, 0.75), mode="hybrid", n=10)
    sh.search.search(req)  # (the seeds built)
    seeds = sh.search._low._ids  # noqa: SLF001
    sh.store.delete([f"d{int(sl)}" for sl in sh.store.dense.ann.ann_slot[seeds]], 2)
    res = sh.search.search(req)
    live = np.flatnonzero(sh.store.dense.ann.ann_slot >= 0)
    for i in range(3):
        scores = fixed_order_dot(sh.store.dense.ann.storage()[live], q[i])
        assert np.isfinite(res.dense_min[i]) and res.dense_min[i] >= float(scores.min()) - 1e-12
