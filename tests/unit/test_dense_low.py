"""The HNSW dense minimum from extreme seeds and a bottom-layer search (index/dense_low.py).

What must hold whatever the data: the minimum a hybrid search reports is the canonical score of a
live chunk (never below the exact minimum, never a deleted chunk's), and the seeds follow adds,
deletes and compaction. How often it is the exact minimum is measured (bench.shard_parts); here
it must be at least what the full ``-q`` search gave on two ways of generating vectors:
clustered Gaussians and a narrow cone with a few outliers (embedding-like anisotropy).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import DenseConfig
from oprag_server.index.dense import fixed_order_dot
from oprag_server.index.dense_low import LowSeeds
from oprag_server.shards.protocol import QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

DIM = 32


@pytest.fixture(autouse=True)
def _seeds_in_the_query(monkeypatch):
    """The seeds built where they are first needed, whatever the graph's size (these tests check what they find;
    tests/unit/test_seeds_refresh.py checks the thread that makes them from LowSeeds.REFRESH_MIN vectors)."""
    monkeypatch.setattr(LowSeeds, "REFRESH_MIN", 1 << 62)


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def clustered(rng, n):
    centres = _unit(rng.normal(size=(20, DIM)))
    return _unit(centres[rng.integers(20, size=n)] + 0.4 * rng.normal(size=(n, DIM)))


def cone(rng, n):
    """Most vectors near one direction, 1% spread widely (the chunks a minimum comes from)."""
    a = _unit(rng.normal(size=DIM))
    v = a + 0.35 * rng.normal(size=(n, DIM))
    out = rng.random(n) < 0.01
    v[out] = rng.normal(size=(int(out.sum()), DIM))
    return _unit(v), a


def _shard(vecs, start=0, sh=None, ann_tail=DenseConfig.ann_tail):
    """A shard holding ``vecs``; with the default ``ann_tail`` an upsert leaves its vectors in the
    tail outside the graph (the seeds' minimum then comes with the tail's exact one)."""
    sh = sh or ShardState(0, DIM, None, dense=DenseConfig(kind="hnsw", hnsw_m=16, ef_construction=40,
                                                           ann_tail=ann_tail, ann_check=0))  # (a check sample
    # holding every chunk gives the exact minimum instead: the seeds are for shards larger than it)
    sh.store.upsert(pa.Table.from_batches([_batch(vecs, start)]), 1 + start)
    return sh


def _batch(vecs, start=0):
    """One-chunk documents d<start>... (text "w") with the vectors ``vecs``, as a chunk batch."""
    n = len(vecs)
    ids = [f"d{start + i:05d}" for i in range(n)]
    return records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in ids], doc_ids=ids, titles=[""] * n, texts=["w"] * n, metadata=[{}] * n,
        ordinals=[0] * n, generations=[1] * n, content_hashes=[hashlib.sha256(d.encode()).hexdigest() for d in ids],
        vectors=vecs)


def _mins(sh, qv, ef=0):
    rep = sh.search.search(SearchRequest(QueryBatch(qv, [["w"]] * len(qv), [np.ones(1)] * len(qv), 1.0, 1.5, 0.75),
                                         "hybrid", 8, ef, 0, 0, 4))
    return rep.dense_min


def _exact(sh, qv):
    V = sh.store.dense.vectors
    return [float(fixed_order_dot(V, x).min()) for x in qv]


def _minus_q(sh, qv, ef):
    """What the former estimator gave: canonical score of the -q search's hit (k = 1)."""
    slots, _ = sh.store.dense.search(-qv, 1, ef)
    return [float(sh.store.dense.exact_slots(x, s).min()) for x, s in zip(qv, slots)]


@pytest.mark.parametrize("ann_tail", [0, 2000])
@pytest.mark.parametrize("family,seed", [("clustered", 0), ("cone", 1), ("cone", 2)])
def test_minimum_is_a_real_score_and_as_good_as_the_minus_q_search(family, seed, ann_tail):
    """Never below the exact minimum, a real chunk's score, exact at least as often as a plain
    -q search of the same beam width, and for >= 80% of queries; with every vector in the graph
    (``ann_tail`` 0) and with the last ones still waiting outside it (the tail's exact minimum
    joins the seeds')."""
    rng = np.random.default_rng(seed)
    if family == "clustered":
        vecs = clustered(rng, 6000)
        qv = _unit(vecs[rng.integers(6000, size=60)] + 0.3 * rng.normal(size=(60, DIM)))
    else:
        vecs, a = cone(rng, 6000)
        qv = _unit(a + 0.3 * rng.normal(size=(60, DIM)))
    sh = _shard(vecs[:4000], ann_tail=ann_tail)
    _shard(vecs[4000:], start=4000, sh=sh)
    assert (sh.store.dense.ann.pending > 0) == (ann_tail > 0)
    got, exact = _mins(sh, qv, ef=64), _exact(sh, qv)
    canon = {float(v) for x in qv for v in fixed_order_dot(sh.store.dense.vectors, x)}
    assert all(g >= e for g, e in zip(got, exact))
    assert all(g in canon for g in got)  # a real chunk's canonical score
    old = _minus_q(sh, qv, 16)  # the -q search with the same beam (ef_search 64 gives the floor, 16)
    hits, old_hits = sum(g == e for g, e in zip(got, exact)), sum(o == e for o, e in zip(old, exact))
    assert hits >= old_hits and hits >= 0.8 * len(qv), (hits, old_hits)


def test_seeds_follow_adds_deletes_and_compaction():
    rng = np.random.default_rng(3)
    vecs, a = cone(rng, 3000)
    sh = _shard(vecs, ann_tail=0)  # every add goes into the graph: the seeds' own upkeep
    qv = _unit(a + 0.2 * rng.normal(size=(10, DIM)))
    sh.search.warm()
    built = sh.search._low._ids.size
    assert built > 0
    # a new chunk opposite to every query: the new minimum for all of them (added after the build)
    far = _unit(-a[None])
    _shard(far, start=3000, sh=sh)
    assert sh.search._low._built_at == 3000  # not rebuilt: 3001 < 2 x 3000
    got = _mins(sh, qv)
    assert got == [float(fixed_order_dot(far, x)[0]) for x in qv] == _exact(sh, qv)
    assert sh.search._low._ids.size == built + 1
    # deleted: its score is never reported again
    sh.store.delete(["d03000"], 5000)
    got = _mins(sh, qv)
    assert all(g >= e for g, e in zip(got, _exact(sh, qv)))
    assert all(g > float(fixed_order_dot(far, x)[0]) for g, x in zip(got, qv))
    # compaction rebuilds the graph (new ANN ids): the seeds are rebuilt for it
    sh.store.delete([f"d{i:05d}" for i in range(0, 3000, 3)], 5001)
    sh.store.dense.compact_ann()
    got, exact = _mins(sh, qv), _exact(sh, qv)
    assert sh.search._low._built_at == len(sh.store.dense) == 2000
    assert all(g >= e for g, e in zip(got, exact)) and sum(g == e for g, e in zip(got, exact)) >= 8
    # the graph doubles: rebuilt on the next query
    _shard(cone(rng, 2500)[0], start=10000, sh=sh)
    _mins(sh, qv)
    assert sh.search._low._built_at == 4500


def test_a_small_shard_builds_its_seeds_without_faiss_warnings(capfd):
    """trial36: a shard of 20 vectors printed FAISS's 'please provide at least 39 training
    points' on stderr (outside the log format); its minimum is still the exact one."""
    rng = np.random.default_rng(11)
    vecs = clustered(rng, 20)
    sh = _shard(vecs, ann_tail=0)
    sh.search.warm()
    qv = _unit(rng.normal(size=(5, DIM)))
    assert _mins(sh, qv) == _exact(sh, qv)
    assert "training points" not in capfd.readouterr().err
