"""A fixed sample of a shard's live chunks chosen by slot order (trial37 #1): a strided sample by row
position changed when a restart reloaded the rows in another order (removals move the last row
into the hole; a load puts them in slot order), and with it the IVF dense minimum and the ANN list
check, so a restart changed some approximate answers. Slots keep their order across a restart
(a load renumbers them 0..n-1 in slot order; a replayed write gets the next one), so the chunks
sampled from the same live chunks are the same before and after it."""

from __future__ import annotations

import numpy as np


def live_slots(dense, start: int = 0, end: int | None = None) -> np.ndarray:
    """int64: the live slots in ``[start, end)`` (None: no end) of :class:`.dense.DenseIndex` ``dense``, ascending.
    They come in order from its slot -> row map (one vectorised scan, no sort: rows after removals are out of slot
    order, and sorting them took ~22 ms at 500K); a shard still loading its HNSW structure sorts its slots. ``end``:
    the store's next slot, so that a scan of the newest slots stops there, not at the map's capacity (which grows 2x:
    up to ~n entries, ~0.5 ms at 500K)."""
    if dense._pending is not None:  # noqa: SLF001
        live = np.sort(dense.slots)
        return live[(live >= start) & (live < (end if end is not None else np.iinfo(np.int64).max))]
    return np.flatnonzero(dense._slot_row[start:end] >= 0) + start  # noqa: SLF001


def strided(live: np.ndarray, k: int) -> np.ndarray:
    """``min(k, n)`` of the n ascending slots ``live``, evenly spaced (every one when ``k >= n``), ascending."""
    n = int(live.size)
    return live if k >= n else live[(np.arange(max(k, 0), dtype=np.int64) * n) // max(k, 1)]


def sample_slots(dense, k: int) -> np.ndarray:
    """int64[min(k, n)]: the slots of ``min(k, n)`` of the live chunks of :class:`.dense.DenseIndex`
    ``dense``, evenly spaced over its live slots in ascending order (every one when ``k >= n``),
    ascending (:func:`live_slots`, :func:`strided`)."""
    return strided(live_slots(dense), k)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """uint64[M]: the SplitMix64 finaliser of each uint64 of ``x`` (its increment, then its mix; Steele, Lea and
    Flood 2014): a fixed function, so the same values in every process, run and restart (``hash()`` is salted per
    process). The check sample's chunk hashes (:func:`..shards.ann_check.chunk_hashes`) and the HNSW levels by id
    (:func:`.ann_copies.preset_levels`)."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, np.uint64) + _MIX[0]
        x = (x ^ (x >> np.uint64(30))) * _MIX[1]
        x = (x ^ (x >> np.uint64(27))) * _MIX[2]
        return x ^ (x >> np.uint64(31))
