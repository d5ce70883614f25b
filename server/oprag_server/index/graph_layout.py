"""An HNSW graph's nodes renumbered for memory locality (issue 13, session 47).

FAISS numbers a graph's nodes (ANN ids) in insertion order, and its stored vectors, neighbour lists and our int8
copy of the graph (:class:`.dense_low.Int8Graph`) sit in that order. A search walks from a node to its neighbours,
which an ingest inserted at unrelated times: at 500K vectors per shard each step of FAISS's walk and of the dense
minimum's walk reads rows far apart, and the walks are bound by memory latency (bench/RESULTS.md, session 46).
:func:`lay_out` renumbers the nodes in breadth-first order of the bottom layer from the entry point (the
neighbour lists in their own order, nearest first; nodes no search reaches, copies among them, after, in id
order), so that a walk's next nodes mostly sit near the last ones. The order is one of those measured by Coleman
et al., "Graph Reordering for Cache-Efficient Near Neighbor Search" (NeurIPS 2022); measured here at 500K: FAISS's
search at ef_search 320 0.53 -> 0.43 ms, reverse Cuthill-McKee 0.43, k-means cluster order 0.40 (bench/RESULTS.md,
session 47).

Nothing a caller sees changes: the same graph (FAISS's ``HNSW::permute_entries``), the same vectors, and every
structure keyed by ANN id renumbered with it (the id -> slot map, the copies' bookkeeping, the dense minimum's
seeds and int8 rows). A search visits the same vectors in the same order (ties of equal scores aside) and returns
the same slots with the same scores. Vectors added later get the next ids, and their graph levels
(:func:`.ann_copies.preset_levels`) are a function of those ids, which a renumbering does not change; so a shard
restarted from a snapshot taken before or after a renumbering links new vectors the same way.

When: between requests (the shard's idle step; a Ray actor before a call), once writes have been quiet for the
shard's quiet time, when the graph holds at least ``--hnsw-layout-min`` vectors (65,536 by default: 100 MB of
float32 rows at D 384, three times this machine's L3; smaller graphs keep insertion order) and twice as many as at its last
renumbering, and no background compaction, dense-minimum seeds thread or deferred insert is under way (their ids
would go stale). In place: the stored vectors and int8 rows are permuted row by row (one spare row); FAISS
allocates new neighbour lists (~130 MB at 500K, M 32) while the old ones are freed. ~0.7 s at 500K vectors, during
which the shard answers nothing; ``laid_at`` (the graph's size at the last renumbering) is kept in the snapshot.
"""

from __future__ import annotations

import time

import numpy as np

from . import hugepages, kernels_layout
from .ann_copies import hnsw_storage, level0


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def bfs_order(index) -> np.ndarray:
    """int64[A]: the new order of HNSW ``index``'s A nodes (entry ``i`` is the old id of new id ``i``): breadth-first
    over the bottom layer from the entry point, then the nodes it does not reach, in id order."""
    n = int(index.ntotal)
    if n == 0:
        return np.zeros(0, np.int64)
    nbr, off, width = level0(index)
    return kernels_layout.bfs(nbr, off, width, n, int(index.hnsw.entry_point))


def permute_rows(a: np.ndarray, perm: np.ndarray) -> None:
    """In place: row ``i`` of ``a`` (a C-contiguous [A, *] or [A] array) becomes old row ``perm[i]`` (int64[A], a
    permutation): cycle by cycle, one spare row, so a 768 MB storage is never held twice."""
    two = a.reshape(a.shape[0], -1)
    if perm.size:
        kernels_layout.permute_rows(two, np.ascontiguousarray(perm, np.int64))


def live_by_slot(ann_slot: np.ndarray) -> np.ndarray:
    """int64[n]: the live ANN ids of ``ann_slot`` (an id -> slot map, < 0 dead), ordered by their slot: the order a
    compaction adds a graph's vectors in and the probes' sample is drawn from, so that neither depends on how the
    graph happens to be numbered (a renumbering here; trial47 #2)."""
    live = np.flatnonzero(ann_slot >= 0)
    return live[np.argsort(ann_slot[live], kind="stable")]


def sample_ids(ann, a: int, step: int) -> np.ndarray:
    """int64: every ``step``-th live ANN id below ``a`` in slot order, a sample of the graph that its numbering does
    not change (the dense minimum's probes are trained on it: a renumbered graph, or a restart that renumbered it at
    another size, gets the same probes); ``0, step, ...`` where ``ann`` has no id -> slot map (a compaction's new
    graph) or no live id below ``a``."""
    slots = getattr(ann, "ann_slot", None)
    live = np.zeros(0, np.int64) if slots is None else live_by_slot(np.asarray(slots[:a]))
    if not live.size:
        return np.arange(0, a, step, dtype=np.int64)
    return live[::step]


def free(ann, seeds=None) -> bool:
    """Whether HNSW ``ann``'s graph may be renumbered now: no deferred vector, no background compaction, and no thread
    of ``seeds`` (the shard's :class:`.dense_low.LowSeeds`) reading the graph (their ids would go stale)."""
    index = getattr(ann, "_index", None)
    if ann.params.kind != "hnsw" or index is None or ann.pending or ann._build is not None:  # noqa: SLF001
        return False
    if getattr(ann, "seeds", None) is not None:  # (a compaction's seeds not taken yet: their ids would go stale)
        return False
    return seeds is None or getattr(seeds, "_next", None) is None


def due(ann, seeds=None) -> bool:
    """Whether :func:`lay_out` would renumber HNSW ``ann``'s graph now (module docstring; the caller checks the quiet
    time): :func:`free`, at least ``ann.params.layout_min`` vectors (0: never) and twice ``ann.laid_at``."""
    if not free(ann, seeds):
        return False
    n, low = int(ann._index.ntotal), int(ann.params.layout_min)  # noqa: SLF001
    return low > 0 and n >= low and n >= 2 * ann.laid_at


def lay_out(ann, seeds=None, order: np.ndarray | None = None) -> np.ndarray | None:
    """Renumber HNSW ``ann``'s graph in :func:`bfs_order` (module docstring), with ``seeds`` (the shard's
    :class:`.dense_low.LowSeeds`, or None) built for it. The caller renumbers what it keys by ANN id itself
    (:meth:`.graph_rows.GraphRows.lay_out_ann`: the dense rows).

    :param order: int64[A], a permutation of the ids (new id ``i`` gets old id ``order[i]``) to apply instead of
        :func:`bfs_order`, whenever :func:`free` (``bench/graph_layout.py`` compares orders with it).
    :returns: int64[A] the old id of each new id; None when not :func:`due` (nothing changed).
    :raises ValueError: ``order`` is not a permutation of the graph's ids.
    """
    if not (due(ann, seeds) if order is None else free(ann, seeds)):
        return None
    if order is not None:
        order = np.ascontiguousarray(order, np.int64)
        if not np.array_equal(np.sort(order), np.arange(int(ann._index.ntotal))):  # noqa: SLF001
            raise ValueError("order must hold every ANN id of the graph once")
    t0 = time.perf_counter()
    with ann._mut:  # noqa: SLF001
        index = ann._index  # noqa: SLF001
        n = int(index.ntotal)
        mine = seeds is not None and seeds._index is index  # noqa: SLF001
        if mine and seeds.INT8_WALK and seeds._g.n:  # noqa: SLF001 - quantise rows not copied yet, in the old order
            seeds._g.follow(hnsw_storage(index), rebuild=False)  # noqa: SLF001
        perm = bfs_order(index) if order is None else order
        inv = np.empty(n, np.int64)
        inv[perm] = np.arange(n, dtype=np.int64)
        index.hnsw.permute_entries(_faiss().swig_ptr(perm))  # levels, offsets, neighbour lists, entry point
        permute_rows(hnsw_storage(index), perm)
        hugepages.advise(level0(index)[0], True)  # (the new neighbour lists)
        ann.ann_slot[:n] = ann.ann_slot[:n][perm]
        ann._copies.relabel(perm, inv)  # noqa: SLF001
        ann._selector = None  # noqa: SLF001
        ann.laid_at = n
        if mine:
            _seeds(seeds, ann, perm, inv)
        saved = getattr(ann, "saved_seeds", None)  # (a snapshot's seeds not taken yet: ids of the old order)
        if saved is not None and saved[0] is index:
            probes, thresh, ids, built_at, seen = saved[1]
            ann.saved_seeds = (index, (probes, thresh, _remap(ids, inv), built_at, seen))
        ann.layouts.append((n, time.perf_counter() - t0))
    return perm


def _remap(ids: np.ndarray, inv: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    inside = (ids >= 0) & (ids < inv.size)
    return np.where(inside, inv[np.where(inside, ids, 0)], ids)


def _seeds(seeds, ann, perm: np.ndarray, inv: np.ndarray) -> None:
    """The dense minimum's seeds and int8 rows of the graph just renumbered, renumbered with it."""
    from . import low_seeds_state  # noqa: PLC0415 - (dense_low imports this module's users)

    n = perm.size
    seeds._ids = _remap(seeds._ids, inv)  # noqa: SLF001 - (their int8 rows stay paired: same order)
    g = seeds._g  # noqa: SLF001
    if g.n == n:
        permute_rows(g.codes[:n], perm)
        permute_rows(g.scale[:n], perm)
        g.stamp[:], g.mark = 0, 0
    elif g.n:  # (an int8 copy short of the graph: made anew at the next query)
        g.n = 0
    seeds._l0 = None  # noqa: SLF001 - (views of the old neighbour lists)
    low_seeds_state.mark(seeds, ann)
