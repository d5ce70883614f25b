"""Deferred HNSW vectors go into the graph in pieces counted from the start of each write's vectors (index/ann.py
``insert_pending``, trial47 #3): FAISS inserts an ``add``'s batch in an order of its own, so before this the steps a
shard cut its inserts into (between requests, timing-dependent) decided the graph, and a log replay after ``kill -9``
linked the vectors otherwise. Now any cutting, and a snapshot taken with vectors still deferred, give one graph."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index.ann import AnnIndex
from oprag_server.index.ann_copies import level0

D = 24
WRITES = [50, 7, 100, 33, 1, 64, 90]  # vectors per write (defer call)


def _ann() -> AnnIndex:
    faiss.omp_set_num_threads(1)  # (as a shard process runs FAISS)
    return AnnIndex(D, DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ef_search=64))


def _vectors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for m in WRITES:
        x = rng.standard_normal((m, D)).astype(np.float32)
        out.append(x / np.linalg.norm(x, axis=1, keepdims=True))
    return out


def _graph(ann: AnnIndex) -> tuple:
    nbr, off, _ = level0(ann._index)  # noqa: SLF001
    n = int(ann._index.ntotal)  # noqa: SLF001
    return n, int(ann._index.hnsw.entry_point), nbr[: int(off[n])].copy(), faiss.vector_to_array(ann._index.hnsw.levels)  # noqa: SLF001


def _feed(ann: AnnIndex, xs: list[np.ndarray], steps) -> None:
    """The writes deferred one after another, ``steps(ann)`` inserting some of them between writes."""
    first = 0
    for x in xs:
        ann.defer(np.arange(first, first + x.shape[0], dtype=np.int64), x)
        first += x.shape[0]
        steps(ann)


@pytest.mark.parametrize("seed", [0, 1])
def test_any_steps_give_one_graph(seed):
    xs = _vectors(seed)
    rng = np.random.default_rng(seed + 5)
    whole, stepped, late = _ann(), _ann(), _ann()
    _feed(whole, xs, lambda a: a.insert_pending())  # each write inserted at once
    _feed(stepped, xs, lambda a: [a.insert_pending(int(k)) for k in rng.integers(1, 40, 3)])  # odd steps between
    _feed(late, xs, lambda a: None)
    late.insert_pending(5)
    late.insert_pending()  # the rest at the end, in one call
    assert whole.pending == stepped.pending == late.pending == 0
    g = _graph(whole)
    for other in (stepped, late):
        n, ep, nbr, lv = _graph(other)
        assert (n, ep) == g[:2] and np.array_equal(lv, g[3]) and np.array_equal(nbr, g[2])


def test_a_snapshot_with_deferred_vectors_keeps_the_pieces(tmp_path):
    xs = _vectors(3)
    live = _ann()
    _feed(live, xs[:4], lambda a: a.insert_pending(20))  # part of the writes still deferred
    assert live.pending > 0 and live.tail_groups().size >= 2
    live.write(tmp_path / "dense.faiss")
    back = _ann()
    back.load(tmp_path / "dense.faiss", live.ann_slot, 0, np.array(live.tail()), live.tail_groups())
    first = int(live.ann_slot.size)
    _feed_from(live, xs[4:], first, 11)  # the live shard goes on in steps of 11 ...
    _feed_from(back, xs[4:], first, 0)  # ... the restarted one inserts nothing until the end
    for a in (live, back):
        a.insert_pending()
    assert np.array_equal(_graph(live)[2], _graph(back)[2]) and _graph(live)[:2] == _graph(back)[:2]


def _feed_from(ann: AnnIndex, xs: list[np.ndarray], first: int, step: int) -> None:
    for x in xs:
        ann.defer(np.arange(first, first + x.shape[0], dtype=np.int64), x)
        first += x.shape[0]
        ann.insert_pending(step)
