"""Compiled kernels of :mod:`.graph_layout` (an HNSW graph's nodes renumbered for locality): the breadth-first
order of the bottom layer and an in-place row permutation."""

from __future__ import annotations

import numpy as np

from . import kernels  # noqa: F401 - sets numba's cache directory before the first njit
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def bfs(nbr, off, width, n, entry):  # pragma: no cover - compiled
    order = np.empty(n, np.int64)
    seen = np.zeros(n, np.uint8)
    head = tail = 0
    for s0 in range(-1, n):
        s = entry if s0 < 0 else s0
        if s < 0 or seen[s]:
            continue
        seen[s] = 1
        order[tail] = s
        tail += 1
        while head < tail:
            u = order[head]
            head += 1
            b = off[u]
            for j in range(width):
                v = nbr[b + j]
                if v < 0:
                    break
                if not seen[v]:
                    seen[v] = 1
                    order[tail] = v
                    tail += 1
    return order


@njit(cache=True, nogil=True)
def permute_rows(a, perm):  # pragma: no cover - compiled
    n, d = perm.size, a.shape[1]
    done = np.zeros(n, np.uint8)
    tmp = np.empty(d, a.dtype)
    for i in range(n):
        if done[i]:
            continue
        if perm[i] == i:
            done[i] = 1
            continue
        for c in range(d):
            tmp[c] = a[i, c]
        j = i
        while True:
            k = perm[j]
            done[j] = 1
            if k == i:
                for c in range(d):
                    a[j, c] = tmp[c]
                break
            for c in range(d):
                a[j, c] = a[k, c]
            j = k


def warm() -> None:
    """Compile (or load from numba's cache) :func:`bfs` and :func:`permute_rows` for the types a shard passes."""
    bfs(np.array([1, -1, 0, -1], np.int32), np.array([0, 2, 4], np.int64), 2, 2, 0)
    perm = np.array([1, 0], np.int64)
    for a in (np.ones((2, 3), np.float32), np.ones((2, 3), np.int8), np.ones((2, 1), np.float32)):
        permute_rows(a, perm)
