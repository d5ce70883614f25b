"""How many inverted lists an IVF shard trains (:class:`.ann.AnnIndex`, issue 13).

2 sqrt(n) lists, not sqrt(n) (bench/RESULTS.md, session 38; a 499,212-vector shard of the 1M bench, SciFact queries,
caches swept, ``nprobe`` 32): 512 lists 1.26 ms a search with 0.924 of the exact top-10 among the 8-bit top-384, 1,024
lists 0.90-0.95 ms and 0.963, 2,048 lists 0.72-0.80 ms and 0.975-0.985: finer lists are faster and closer, but k-means
grows with lists x points (1.7 / 6.4 / 15-29 s, the shard's apply waiting), so 2 sqrt(n) up to 1,024 lists, the most
sqrt(n) trained below 1.5M vectors: no training costs more than under sqrt(n) at the same size (2 sqrt(n) at 2M: 2,048,
~28 s).

FAISS's rule (``faiss/Clustering.cpp``, ``Clustering::train_encoded``, run by ``IndexIVF::train``): fewer training
points than lists is an error; fewer than ``min_points_per_centroid`` (39) a list prints ``WARNING clustering <n>
points to <k> centroids ...`` on stderr (the service log) and trains anyway. So no IVF trains on fewer than
:data:`IVF_TRAIN_FLOOR` (39) vectors (the serve CLI refuses a lower ``--ivf-train-min``; one made in code waits for
39), and ``nlist <= n // 39`` keeps every training at >= 39 points a list.
"""

from __future__ import annotations

import numpy as np

#: the fewest vectors an IVF trains on: FAISS's k-means wants 39 points a list (module docstring)
IVF_TRAIN_FLOOR = 39
#: 2 sqrt(n) lists up to this many; past it sqrt(n)'s (module docstring)
IVF_FINE_LISTS = 1024


def ivf_lists(n: int) -> int:
    """Lists of an IVF trained on ``n`` vectors: the power of two nearest 2 sqrt(n), at most :data:`IVF_FINE_LISTS` or
    the power of two nearest sqrt(n) (the larger), in [16, 65536], and at most n / 39 (module docstring)."""
    near = [2 ** round(float(np.log2(f * np.sqrt(max(n, 1))))) for f in (1, 2)]
    return int(min(min(65536, max(16, min(near[1], max(IVF_FINE_LISTS, near[0])))), max(1, n // IVF_TRAIN_FLOOR)))
