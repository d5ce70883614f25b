"""HNSW graph levels as a function of the ANN id (index/ann_copies.py ``preset_levels``, session 46): FAISS draws a
new node's level from the index's random generator, which a saved index does not keep, so a shard restarted from a
snapshot linked the vectors of its log replay (or of a later ingest) otherwise than the shard before the restart
did, and its searches and dense minima differed. With the levels preset, the same vectors added in the same order
give the same graph whatever the index went through before."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from oprag_server.index.ann_copies import level0, preset_levels


def _graph(n0: int, x: np.ndarray, reload: bool, preset: bool):
    faiss.omp_set_num_threads(1)  # (as a shard process runs FAISS)
    idx = faiss.IndexHNSWFlat(x.shape[1], 8, faiss.METRIC_INNER_PRODUCT)
    idx.hnsw.efConstruction = 32

    def add(v):
        if preset:
            preset_levels(idx, int(idx.ntotal), v.shape[0])
        idx.add(v)
    add(x[:n0])
    if reload:  # a snapshot and a restart: the random generator starts over
        idx = faiss.deserialize_index(faiss.serialize_index(idx))
    for a in range(n0, x.shape[0], 500):
        add(x[a:a + 500])
    return idx


@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_graph_after_a_reload(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    live, again = _graph(1200, x, False, True), _graph(1200, x, True, True)
    assert np.array_equal(faiss.vector_to_array(live.hnsw.levels), faiss.vector_to_array(again.hnsw.levels))
    assert np.array_equal(level0(live)[0], level0(again)[0])
    assert int(live.hnsw.entry_point) == int(again.hnsw.entry_point)
    # FAISS's own draw (what the shards did before): the replayed part is linked otherwise
    a, b = _graph(1200, x, False, False), _graph(1200, x, True, False)
    assert not np.array_equal(faiss.vector_to_array(a.hnsw.levels), faiss.vector_to_array(b.hnsw.levels))


def test_levels_follow_faiss_distribution():
    idx = faiss.IndexHNSWFlat(4, 32, faiss.METRIC_INNER_PRODUCT)
    probas = faiss.vector_to_array(idx.hnsw.assign_probas)
    n = 200_000
    idx.hnsw.levels.resize(0)
    preset_levels(idx, 0, n)
    lv = faiss.vector_to_array(idx.hnsw.levels) - 1
    got = np.bincount(lv, minlength=probas.size)[:probas.size] / n
    assert np.abs(got - probas).max() < 4 * np.sqrt(probas.max() / n)  # (~4 sigma)
    again = faiss.IndexHNSWFlat(4, 32, faiss.METRIC_INNER_PRODUCT)
    preset_levels(again, 1000, 10)  # (ids 1000...: the same levels as above)
    assert np.array_equal(faiss.vector_to_array(again.hnsw.levels) - 1, lv[1000:1010])
