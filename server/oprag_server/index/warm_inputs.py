"""Tiny inputs that compile (or load from numba's cache) the BM25 kernels for every argument
type a shard passes: writable and read-only (memory-mapped) postings, int8 ``where``, float64
lengths, int64 offsets, int32 slots, uint16 term frequencies. Shared by :func:`.kernels.warm`
and :func:`.kernels_topm.warm`, and :func:`read_only`; plain numpy (importing it does not load numba)."""

from __future__ import annotations

import numpy as np


def postings_variants() -> list[tuple[bool, tuple[np.ndarray, ...]]]:
    """``[(read_only, (where int8[3], doc_len float64[3], offsets int64[2], slots int32[3],
    tf uint16[3]))]`` for read_only False and True (one segment term holding slots 0-2)."""
    out = []
    for ro in (False, True):
        arrs = [np.ones(3, np.int8), np.ones(3, np.float64), np.array([0, 3], np.int64),
                np.arange(3, dtype=np.int32), np.ones(3, np.uint16)]
        for a in arrs[2:] if ro else ():
            a.flags.writeable = False
        out.append((ro, tuple(arrs)))
    return out


def read_only(a: np.ndarray) -> np.ndarray:
    """``a``, or a read-only view of it. A kernel's arrays come writable (built in memory) or read-only (a snapshot's
    maps, a message's buffers) in any mix, and numba compiles one specialisation per mix (session 41: on a fresh
    install the first search after a restart compiled one, 2.7-3.4 s, and a first staging another); passed read-only,
    there is one, which ``warm()`` compiles."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v

