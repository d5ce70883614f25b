"""A fixed sample of a shard's live chunks chosen by slot order (trial37 #1): a strided sample by row
position changed when a restart reloaded the rows in another order (removals move the last row
into the hole; a load puts them in slot order), and with it the IVF dense minimum and the ANN list
check, so a restart changed some approximate answers. Slots keep their order across a restart
(a load renumbers them 0..n-1 in slot order; a replayed write gets the next one), so the chunks
sampled from the same live chunks are the same before and after it."""

from __future__ import annotations

import numpy as np


def sample_slots(dense, k: int) -> np.ndarray:
    """int64[min(k, n)]: the slots of ``min(k, n)`` of the live chunks of :class:`.dense.DenseIndex`
    ``dense``, evenly spaced over its live slots in ascending order (every one when ``k >= n``),
    ascending. The live slots come in order from its slot -> row map (one vectorised scan, no
    sort: rows after removals are out of slot order, and sorting them took ~22 ms at 500K)."""
    live = np.flatnonzero(dense._slot_row >= 0) if dense._pending is None else np.sort(dense.slots)  # noqa: SLF001
    n = int(live.size)
    return live if k >= n else live[(np.arange(k, dtype=np.int64) * n) // max(k, 1)]
