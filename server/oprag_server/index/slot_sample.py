"""A fixed sample of a shard's live rows chosen by slot order (trial37 #1): a strided sample by row
position changed when a restart reloaded the rows in another order (removals move the last row
into the hole; a load puts them in slot order), and with it the IVF dense minimum and the ANN list
check, so a restart changed some approximate answers. Slots keep their order across a restart
(a load renumbers them 0..n-1 in slot order; a replayed write gets the next one), so the chunks
sampled from the same live chunks are the same before and after it."""

from __future__ import annotations

import numpy as np


def slot_sample(slots: np.ndarray, k: int) -> np.ndarray:
    """int64[min(k, n)]: the rows (positions in int64[n] ``slots``) of ``min(k, n)`` chunks evenly
    spaced over the live slots sorted ascending (every row when ``k >= n``), ascending by slot."""
    n = int(slots.size)
    order = np.argsort(slots, kind="stable")
    if k >= n:
        return order.astype(np.int64, copy=False)
    return order[(np.arange(k, dtype=np.int64) * n) // max(k, 1)].astype(np.int64, copy=False)
