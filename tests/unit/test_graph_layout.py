"""An HNSW graph's nodes renumbered for locality (index/graph_layout.py, session 47): the same searches, dense minima
and copies before and after, and after later adds, as a twin index that never renumbers; the walks' neighbours sit
nearer; the dense minimum's probes do not depend on the numbering."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import graph_layout
from oprag_server.index.ann_copies import level0
from oprag_server.index.dense import DenseIndex, fixed_order_dot
from oprag_server.index.dense_low import LowSeeds

D = 32


def _data(n: int, seed: int) -> np.ndarray:
    """Clustered unit vectors (20 Gaussian clusters), rows 100-149 repeated at the end (copies of linked vectors)."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((20, D))
    x = centers[rng.integers(0, 20, n)] + 0.4 * rng.standard_normal((n, D))
    x = np.concatenate([x, x[100:150]]).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _index(layout_min: int) -> DenseIndex:
    faiss.omp_set_num_threads(1)  # (as a shard process runs FAISS)
    return DenseIndex(D, DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ef_search=64, layout_min=layout_min))


def _fill(dense: DenseIndex, x: np.ndarray, first: int) -> None:
    for a in range(0, x.shape[0], 500):
        dense.add(np.arange(first + a, first + min(a + 500, x.shape[0]), dtype=np.int64), x[a:a + 500])


def _searches(dense: DenseIndex, q: np.ndarray) -> list[tuple[list[int], list[float]]]:
    slots, scores, _ = dense.ann.search(q, 40)
    return [(s.tolist(), np.round(c, 6).tolist()) for s, c in zip(slots, scores)]


def _minima(dense: DenseIndex, seeds: LowSeeds, q: np.ndarray) -> list[tuple[int, float]]:
    """Per query, the dense minimum the seeds and the walk found: (its slot, its canonical score)."""
    out = []
    for j, ids in enumerate(seeds.candidates(dense.ann, q)):
        sc = fixed_order_dot(dense.ann.storage()[ids], q[j])
        out.append((int(dense.ann.ann_slot[ids[int(np.argmin(sc))]]), float(sc.min())))
    return out


def _edge_gap(dense: DenseIndex) -> float:
    """Mean |id(u) - id(v)| over the bottom layer's links."""
    nbr, off, width = level0(dense.ann._index)  # noqa: SLF001
    n = int(dense.ann._index.ntotal)  # noqa: SLF001
    rows = nbr[off[:n, None] + np.arange(width)]
    ok = rows >= 0
    return float(np.abs(rows - np.arange(n)[:, None])[ok].mean())


@pytest.mark.parametrize("seed", [0, 1])
def test_renumbered_graph_answers_as_before(seed):
    x = _data(3000, seed)
    laid, twin = _index(1000), _index(0)
    for d in (laid, twin):
        _fill(d, x, 0)
        d.remove(np.arange(7, 3000, 11, dtype=np.int64))  # dead ids (and dead linked copies' originals)
    s_laid, s_twin = LowSeeds(), LowSeeds()
    s_laid.prepare(laid.ann)
    s_twin.prepare(twin.ann)
    rng = np.random.default_rng(seed + 10)
    q = np.concatenate([rng.standard_normal((30, D)), x[100:110]]).astype(np.float32)  # (the last: copies' vectors)
    before, low_before, gap = _searches(laid, q), _minima(laid, s_laid, q), _edge_gap(laid)
    assert before == _searches(twin, q) and low_before == _minima(twin, s_twin, q)

    assert laid.layout_due(s_laid) and not twin.layout_due(s_twin)
    assert laid.lay_out_ann(s_laid) and not twin.lay_out_ann(s_twin)
    assert laid.ann.laid_at == 3050 and not laid.layout_due(s_laid)
    assert not np.array_equal(laid.ann.ann_slot, twin.ann.ann_slot)  # (renumbered)
    assert _edge_gap(laid) < 0.7 * gap  # the walks' neighbours sit nearer
    assert _searches(laid, q) == before  # the same slots and scores, the copies expanded as before
    assert _minima(laid, s_laid, q) == low_before
    assert sorted(laid.slots.tolist()) == sorted(twin.slots.tolist())
    some = np.arange(0, 3050, 13, dtype=np.int64)
    some = some[twin._rows_of(some) >= 0]  # noqa: SLF001 - (live ones)
    assert np.array_equal(laid.vectors_of(some), twin.vectors_of(some))

    # later adds link the same way (their levels are a function of ids a renumbering keeps)
    y = _data(1500, seed + 20)
    for d in (laid, twin):
        _fill(d, y, 5000)
    q2 = np.concatenate([q, y[:10]])
    assert _searches(laid, q2) == _searches(twin, q2)
    assert _minima(laid, s_laid, q2) == _minima(twin, s_twin, q2)

    # a compaction (a quarter dead) builds the same graph on both: it adds the live vectors in slot order
    # (trial47 #2: in ANN id order, the renumbered shard's new graph differed)
    for d in (laid, twin):
        d.remove(np.arange(0, 3000, 2, dtype=np.int64))
        d.install_ann()  # (the background compaction's graph, installed as between requests)
    assert laid.ann.laid_at == 0 and np.array_equal(laid.ann.ann_slot, twin.ann.ann_slot)
    assert _searches(laid, q2) == _searches(twin, q2)


def test_probes_do_not_depend_on_the_numbering():
    x = _data(4000, 3)
    laid, twin = _index(1000), _index(0)
    for d in (laid, twin):
        _fill(d, x, 0)
        d.remove(np.arange(5, 4000, 17, dtype=np.int64))
    assert laid.lay_out_ann(LowSeeds())
    a, b = LowSeeds(), LowSeeds()
    a._build(laid.ann)  # noqa: SLF001
    b._build(twin.ann)  # noqa: SLF001
    assert np.array_equal(a._probes, b._probes) and np.array_equal(a._thresh, b._thresh)  # noqa: SLF001
    assert sorted(laid.ann.ann_slot[a._ids].tolist()) == sorted(twin.ann.ann_slot[b._ids].tolist())  # noqa: SLF001


def test_permute_rows_and_order():
    rng = np.random.default_rng(4)
    perm = rng.permutation(5000).astype(np.int64)
    for a in (rng.standard_normal((5000, 7)).astype(np.float32), rng.integers(-127, 128, (5000, 9), dtype=np.int8),
              rng.standard_normal(5000).astype(np.float32)):
        want = a[perm].copy()
        graph_layout.permute_rows(a, perm)
        assert np.array_equal(a, want)
    dense = _index(1000)
    _fill(dense, _data(2000, 5), 0)
    order = graph_layout.bfs_order(dense.ann._index)  # noqa: SLF001
    assert np.array_equal(np.sort(order), np.arange(2050)) and order[0] == dense.ann._index.hnsw.entry_point  # noqa: SLF001
    assert set(order[-50:].tolist()) >= set(range(2000, 2050)) - {int(dense.ann._index.hnsw.entry_point)}  # noqa: SLF001


def test_any_given_order_answers_as_before():
    x = _data(2500, 6)
    dense, twin = _index(100_000), _index(0)  # (not due by size: an order given renumbers whenever free)
    for d in (dense, twin):
        _fill(d, x, 0)
    seeds = LowSeeds()
    seeds.prepare(dense.ann)
    q = np.random.default_rng(7).standard_normal((20, D)).astype(np.float32)
    before, low = _searches(dense, q), _minima(dense, seeds, q)
    assert not dense.lay_out_ann(seeds)
    with pytest.raises(ValueError, match="every ANN id"):
        dense.lay_out_ann(seeds, order=np.arange(2549))
    order = np.random.default_rng(8).permutation(2550)
    assert dense.lay_out_ann(seeds, order=order)
    assert np.array_equal(dense.ann.ann_slot, twin.ann.ann_slot[order])
    assert _searches(dense, q) == before and _minima(dense, seeds, q) == low
    assert dense.lay_out_ann(seeds, order=np.argsort(dense.ann.ann_slot))  # back to insertion order
    assert np.array_equal(dense.ann.ann_slot, twin.ann.ann_slot) and _searches(dense, q) == before


def test_not_while_a_compactions_seeds_wait():
    dense = _index(1000)
    _fill(dense, _data(1500, 9), 0)
    assert graph_layout.free(dense.ann) and dense.layout_due()
    dense.ann.seeds = LowSeeds()  # (a compaction's, not taken yet: their ids would go stale)
    assert not graph_layout.free(dense.ann) and not dense.lay_out_ann()
