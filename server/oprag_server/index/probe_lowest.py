"""Per probe direction, the rows of a graph's storage with the lowest inner products (the dense minimum's seeds,
:class:`.dense_low.LowSeeds`): blocks of rows times the probes folded into each probe's lowest (:func:`fold_lowest`),
then the final ``t`` of them scored again so that neither the thresholds nor the rows chosen depend on how the graph
is numbered (:func:`settled`; a renumbering, :mod:`.graph_layout`, keeps every structure keyed by ANN id)."""

from __future__ import annotations

import numpy as np

#: rows kept per probe past the t lowest while the blocks are folded (:func:`settled` picks the t again)
SETTLE_SPARE = 4


def settled(probes: np.ndarray, kept: np.ndarray, vecs: np.ndarray, slot_of: np.ndarray | None,
            t: int) -> tuple[np.ndarray, np.ndarray]:
    """Per probe, the ``t`` lowest inner products among its ``kept`` rows (int64[P, t + spare] ANN ids, each
    probe's lowest of a float32 fold), scored again in float64 and rounded to float32, ties by slot.

    A float32 BLAS product rounds a row's score by the row's place in the block on some CPUs (the AVX-512 sgemm
    kernels of OpenBLAS on AMD Zen 5 here), so a renumbered graph got other thresholds than its twin
    (``test_probes_do_not_depend_on_the_numbering``); float64 sums of the exact float32 products differ by far less
    than a float32 rounding step, whatever the order. :param vecs: float32[K, D], the rows of ``np.unique(kept)``
    in that order. :param slot_of: the graph's id -> slot map (None: ids stand in).
    :returns: ``(thresholds float32[P]: each probe's t-th lowest score, ids int64[S]: the chosen rows, unique)``."""
    uniq, inv = np.unique(kept, return_inverse=True)
    inv = inv.reshape(kept.shape)
    v = np.asarray(vecs, np.float64)[inv]  # [P, t + spare, D]
    sc = np.einsum("pkd,pd->pk", v, np.asarray(probes, np.float64)).astype(np.float32)
    key = kept if slot_of is None else np.asarray(slot_of)[kept]
    order = np.lexsort((key, sc), axis=-1)[:, :t]
    chosen = np.take_along_axis(kept, order, 1)
    return np.take_along_axis(sc, order[:, -1:], 1).ravel(), np.unique(chosen).astype(np.int64)


def fold_start(p: int, t: int, a: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty folds of :func:`fold_lowest` for ``p`` probes over ``a`` rows: t + spare wide (at most a)."""
    w = min(t + SETTLE_SPARE, a)
    return np.full((p, w), np.inf, np.float32), np.full((p, w), -1, np.int64)


def fold_lowest(best_s: np.ndarray, best_i: np.ndarray, sc: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Per probe, the t lowest scores (float32[P, t]) and their rows (int64[P, t]) so far joined with those of one
    block of scores float32[P, rows] of rows ``lo...``: the t lowest of both."""
    p, t = best_s.shape
    k = min(t, sc.shape[1])
    part = np.argpartition(sc, k - 1, axis=1)[:, :k] if k < sc.shape[1] else np.tile(np.arange(k), (p, 1))
    cs = np.concatenate([best_s, np.take_along_axis(sc, part, 1)], axis=1)
    ci = np.concatenate([best_i, part + lo], axis=1)
    keep = np.argpartition(cs, t - 1, axis=1)[:, :t]
    return np.take_along_axis(cs, keep, 1), np.take_along_axis(ci, keep, 1)
