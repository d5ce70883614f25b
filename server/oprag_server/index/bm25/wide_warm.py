"""The BM25 wide rows of a large shard's segment, built between requests instead of by the queries
that first use them.

A wide term (:mod:`..kernels_wide`: segment df >= span / 16) is read by the top-M pass from a dense
``uint8[span]`` row of its term frequencies, which :class:`.wide_rows.WideRows` builds the first time
a query uses the term (``fill_row``, ~2 ms at 500K chunks a shard) and keeps until the segment is
replaced (a merge builds the rows the old segment had for the new one: :func:`.listed_top.successor`).
After a restart every row starts unbuilt, so the first few hundred queries each paid for one or
more: one 1M shard in process (session 44, 200 SciFact queries) 6.1 ms p50 / 23.4 ms p95 on the
first pass against 5.3 / 7.0 once its rows were built. A shard holds a few hundred wide terms
(360 at 500K chunks: 180 MB of rows, which a served workload builds anyway: 800 SciFact queries
used 292 of them), so the shard's loop builds them all, most frequent first, one per
:func:`step`, while no request waits (:meth:`oprag_server.shards.state.ShardState.background_step`).

Only segments of at least :data:`MIN_SPAN` slots: below it a query seldom reaches the pruned
path's ``_FULL_BELOW`` postings, and the rows stay built on first use.
"""

from __future__ import annotations

import numpy as np

from . import listed_top

#: the smallest segment span (slots) whose wide rows are built ahead (the pruned path needs
#: ``listed_top._FULL_BELOW`` postings in a query: a few wide terms of a segment this large)
MIN_SPAN = 65536


def _large(ix):
    """The index's current segment when it spans at least :data:`MIN_SPAN` slots, else None."""
    seg = ix._seg  # noqa: SLF001 - the index's own package
    return seg if seg.doc_slots.size and int(seg.doc_slots[-1]) + 1 >= MIN_SPAN else None


def _wide(ix):
    """The index's scratch and its current segment's :class:`.wide_rows.WideRows` (made as
    ``listed_top._pruned`` makes them), or ``(None, None)`` below :data:`MIN_SPAN`."""
    if (seg := _large(ix)) is None:
        return None, None
    sc = ix.__dict__.get("_topm_scratch")
    if sc is None:
        sc = ix.__dict__.setdefault("_topm_scratch", listed_top._Scratch())  # noqa: SLF001
    if sc.wide is None or sc.wide.seg is not seg:
        sc.wide = listed_top._Wide(seg, ix._doc_len)  # noqa: SLF001
    return sc, sc.wide


def due(ix) -> bool:
    """Whether the current segment (of at least :data:`MIN_SPAN` slots) has wide rows not built."""
    if (seg := _large(ix)) is None:
        return False
    sc = ix.__dict__.get("_topm_scratch")
    w = sc.wide if sc is not None else None
    return w is None or w.seg is not seg or bool((w.state == 0).any())


def step(ix, rows: int = 1) -> bool:
    """Build up to ``rows`` unbuilt wide rows of the current segment, the terms with the most
    segment postings first (the same ``fill_row`` a query's first use runs; the rows read the
    same); skipped while a query holds the scratch. :returns: whether rows are left to build."""
    from .. import kernels_wide  # noqa: PLC0415 - numba only in processes that score

    sc, w = _wide(ix)
    if w is None:
        return False
    if not sc.lock.acquire(blocking=False):
        return True
    try:
        todo = np.flatnonzero(w.state == 0)
        if not todo.size:
            return False
        terms = np.flatnonzero(w.row_of >= 0)  # (row r is the r-th wide term in term order)
        seg = w.seg
        df = seg.offsets[terms[todo] + 1] - seg.offsets[terms[todo]]
        for r in todo[np.argsort(-df, kind="stable")][:rows].tolist():
            ok = kernels_wide.fill_row(w.rows, w.bmax, w.bratio, r, int(terms[r]), seg.offsets, seg.slots, seg.tf,
                                       w.seg_len)
            w.state[r] = 1 if ok else 2
        return bool((w.state == 0).any())
    finally:
        sc.lock.release()
