"""A BM25 merge's transient memory (issue 13, 1M chunks: a shard's merge held ~1.1 GB of int64
temporaries for a ~10M-posting delta beside its new segment, and made the process tree's peak).
numpy reports its allocations to tracemalloc, so the traced peak is the merge's array memory."""

from __future__ import annotations

import tracemalloc

import numpy as np

from oprag_server.index import bm25 as B

from test_bm25_segments import check


def _docs(rng, lo: int, hi: int) -> dict[int, tuple[list[str], int]]:
    return {s: ([f"t{i}" for i in np.minimum(rng.zipf(1.3, 60), 20_000) - 1], 0) for s in range(lo, hi)}


def test_a_merge_holds_less_than_half_its_new_segment_in_temporaries():
    rng = np.random.default_rng(7)
    ix, live = B.PostingsIndex(), _docs(rng, 0, 21_000)
    ix.add_batch(list(live), [t for t, _ in live.values()])
    ix.merge()
    delta = _docs(rng, 21_000, 24_000)  # a seventh of the segment, as a 1M ingest's tail left
    ix.add_batch(list(delta), [t for t, _ in delta.values()])
    live.update(delta)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        ix.merge()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    seg = ix.segment
    new_bytes = seg.slots.nbytes + seg.tf.nbytes + seg.doc_terms.nbytes
    # before: ~1.7x the new segment's posting arrays on top of what the merge kept; now ~0.5x
    assert peak - kept < 0.9 * new_bytes, (peak - start, kept - start, new_bytes)
    check([ix], live, ["t0", "t1", "t77", "t19999"])
