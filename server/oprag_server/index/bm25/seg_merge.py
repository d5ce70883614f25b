"""The merge that folds a BM25 delta of recent writes into a new :class:`.segment.Segment` while
dropping dead postings (the layout: :mod:`.segment`; the thread and the install around it:
:mod:`.merging`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .delta import intern
from .segment import MAX_SLOT, Segment


def merge(seg: Segment, seg_live: np.ndarray, d_terms: list[str], d_key: np.ndarray, d_tf: np.ndarray,
          d_doc_slots: np.ndarray, out_dir: Path | None = None) -> Segment:
    """A new segment: the postings of ``seg`` whose chunk is live plus the delta's.

    :param seg: the current segment (not modified).
    :param seg_live: bool ``[>= max slot + 1]``: True where the chunk's postings in ``seg`` are
        live (a removed chunk is False).
    :param d_terms: the delta's term dictionary (delta term id -> term).
    :param d_key: int64 ``[Pd]`` ascending, ``delta term id << 32 | slot`` of the delta's live
        postings; :param d_tf: int ``[Pd]`` their term frequencies.
    :param d_doc_slots: int64 ``[Dd]`` ascending: every live delta chunk (also those without
        tokens); none of them live in ``seg``.
    :param out_dir: a directory (created) where each of the three posting-sized arrays (``slots``,
        ``tf``, ``doc_terms``) is written as ``<name>.npy`` as soon as it is built and served
        from a read-only map of that file from then on (:func:`_park`), so the merge does not
        hold them in anonymous memory (issue 13: the 1M tree's peak was a merge's new
        segment beside its temporaries); :meth:`Segment.spill` into the same directory then
        writes only the rest. An array whose file cannot be written stays in memory.
    :returns: the new segment; a term without live postings leaves the dictionary.
    :raises ValueError: a slot above :data:`MAX_SLOT`.

    Cost: O(P + T) numpy work plus one dictionary look-up per delta term (no per-posting
    Python). Chunks and postings keep ascending slot order (the delta may hold slots below
    the segment's).
    """
    # live part of the old segment; the dead chunks' terms (forward index) give each term's
    # dead postings without a pass over all postings
    old_counts, o_slots, o_tf = np.diff(seg.offsets), seg.slots, seg.tf
    o_doc_len = np.diff(seg.doc_off)
    o_doc_slots, o_doc_terms = seg.doc_slots, seg.doc_terms
    dkeep = seg_live[seg.doc_slots]
    if not dkeep.all():
        dead_terms = seg.doc_terms[np.repeat(~dkeep, o_doc_len)]
        if dead_terms.size:
            old_counts = old_counts - np.bincount(dead_terms, minlength=old_counts.size)
            keep = seg_live[seg.slots]
            o_slots, o_tf = o_slots[keep], o_tf[keep]
            o_doc_terms = o_doc_terms[np.repeat(dkeep, o_doc_len)]
        o_doc_slots, o_doc_len = o_doc_slots[dkeep], o_doc_len[dkeep]
    kept = old_counts > 0
    all_kept = bool(kept.all())
    terms = list(seg.terms) if all_kept else [t for t, k in zip(seg.terms, kept.tolist()) if k]
    vocab = dict(zip(terms, range(len(terms))))
    d_doc_slots = np.asarray(d_doc_slots, dtype=np.int64)
    if d_doc_slots.size and (d_doc_slots.min() < 0 or d_doc_slots.max() > MAX_SLOT):
        raise ValueError(f"postings slots must lie in [0, {MAX_SLOT}]")
    # delta term ids -> new term ids (one look-up per distinct delta term). The delta's per-posting
    # arrays are int32 where the values fit (term ids, slots <= MAX_SLOT, positions) and each is
    # dropped once used: at 1M chunks a shard's merge held ~1.1 GB of int64 temporaries for a
    # delta of ~10M postings beside the new segment (issue 13, 1M tree peak)
    d_key = np.asarray(d_key, np.int64)
    # keys strictly ascending (as documented: what a delta gives): grouped by delta term id, slots
    # ascending within a group, no pair twice; the sorts below then take linear shortcuts
    strict = bool(np.all(d_key[1:] > d_key[:-1]))
    dtid = (d_key >> 32).astype(np.int32)
    ds = (d_key & 0xFFFFFFFF).astype(np.int32)
    d_key = None  # (the caller's array lives on; this frame's reference goes)
    if strict:
        gstart = np.flatnonzero(np.diff(dtid, prepend=-1))  # first posting of each delta term
        gids = dtid[gstart]  # == np.unique(dtid)
    else:
        gids = np.unique(dtid)
    remap = np.zeros(len(d_terms), np.int32)
    for i in gids.tolist():
        remap[i] = intern(vocab, terms, d_terms[i])
    dt = remap[dtid]
    dtf = np.asarray(d_tf)
    if dtf.dtype.kind not in "iu":
        dtf = dtf.astype(np.int64)
    d_pos = _positions(d_doc_slots, ds).astype(np.int32)  # each posting's chunk, as a position in d_doc_slots
    d_doc_len = np.bincount(d_pos, minlength=d_doc_slots.size).astype(np.int64)
    if strict:
        # order by (new term id, slot) = the delta terms' groups in new-id order (a sort of the
        # distinct terms only; the same permutation as np.lexsort((ds, dt)), keys being unique)
        glen = np.diff(np.append(gstart, dtid.size))
        go = np.argsort(remap[gids])
        glen_o = glen[go]
        order = np.repeat(gstart[go] - (np.cumsum(glen_o) - glen_o), glen_o)
        order += np.arange(dtid.size)
        dtid = None
        # chunk order for the forward index (np.lexsort((dt, ds))): a stable sort of the
        # (term, slot)-ordered postings by chunk position (radix sort when it fits in 16 bits)
        p = d_pos[order]
        d_pos = None
        by_doc = np.argsort(p.astype(np.uint16) if d_doc_slots.size < 65536 else p, kind="stable")
        p = None
        by_doc = order[by_doc]
    else:
        dtid = d_pos = None
        by_doc = np.lexsort((dt, ds))
        order = np.lexsort((ds, dt))
    d_doc_terms_by_doc = dt[by_doc]
    by_doc = None
    dt, ds, dtf = dt[order], ds[order], dtf[order]
    order = None
    T = len(terms)
    new_counts = np.zeros(T, np.int64)
    new_counts[: kept.sum()] = old_counts[kept]
    delta_counts = np.bincount(dt, minlength=T)
    offsets = np.zeros(T + 1, np.int64)
    np.cumsum(new_counts + delta_counts, out=offsets[1:])
    # destination of each delta posting: old postings with a smaller (term, slot) key plus
    # the delta postings before it
    old_cum = np.zeros(T + 1, np.int64)
    np.cumsum(new_counts, out=old_cum[1:])
    if not o_slots.size or not ds.size or int(o_slots.max()) < int(ds.min()):
        before_old = old_cum[dt + 1]  # every old posting of the term has a smaller slot
    else:
        o_tid = np.repeat(np.arange(T, dtype=np.int64), new_counts)
        before_old = np.searchsorted((o_tid << 32) | o_slots.astype(np.int64),
                                     (dt.astype(np.int64) << 32) | ds.astype(np.int64))
    dest = before_old + np.arange(dt.size)
    before_old = dt = None
    P = int(offsets[-1])
    tf_dtype = np.uint16 if (not dtf.size or dtf.max() <= 65535) and o_tf.dtype == np.uint16 else np.uint32
    slots = _park(out_dir, "slots", _interleave(P, dest, o_slots, ds, np.int32))
    ds = None
    tf = _park(out_dir, "tf", _interleave(P, dest, o_tf, dtf, tf_dtype))
    dest = dtf = None
    # forward index: chunks in slot order, old term ids renumbered
    if not all_kept:
        old2new = (np.cumsum(kept) - 1).astype(np.int32)  # old term id -> new term id (where kept)
        o_doc_terms = old2new[o_doc_terms]
    ddest = np.searchsorted(o_doc_slots, d_doc_slots) + np.arange(d_doc_slots.size)
    D = o_doc_slots.size + d_doc_slots.size
    doc_slots = _interleave(D, ddest, o_doc_slots, d_doc_slots, np.int32)
    doc_len = _interleave(D, ddest, o_doc_len, np.asarray(d_doc_len, np.int64), np.int64)
    doc_off = np.zeros(D + 1, np.int64)
    np.cumsum(doc_len, out=doc_off[1:])
    if not d_doc_slots.size or not o_doc_slots.size or int(o_doc_slots[-1]) < int(d_doc_slots[0]):
        doc_terms = np.concatenate([o_doc_terms.astype(np.int32, copy=False), d_doc_terms_by_doc.astype(np.int32)])
    else:  # a delta chunk below a segment chunk: place its terms between
        starts = doc_off[ddest]
        d_len = np.asarray(d_doc_len, np.int64)
        first = np.repeat(np.cumsum(d_len) - d_len, d_len)
        edest = np.repeat(starts, d_len) + (np.arange(d_len.sum()) - first)
        doc_terms = _interleave(P, edest, o_doc_terms, d_doc_terms_by_doc, np.int32)
    doc_terms = _park(out_dir, "doc_terms", doc_terms)
    return Segment(terms, offsets, slots, tf, doc_slots, doc_off, doc_terms, vocab)


def _park(d: Path | None, name: str, a: np.ndarray) -> np.ndarray:
    """``a`` written to ``d / <name>.npy`` (:meth:`Segment.save`'s format) and returned as a
    read-only map of that file (same values, shape and dtype: the anonymous copy is freed when
    the caller drops ``a``); ``a`` itself when ``d`` is None or the file cannot be written
    (``OSError``: a full or read-only disk; the partial file is removed)."""
    if d is None:
        return a
    p = Path(d) / f"{name}.npy"
    try:
        Path(d).mkdir(parents=True, exist_ok=True)
        np.save(p, a)
        m = np.load(p, mmap_mode="r").view(np.ndarray)
    except (OSError, ValueError):
        p.unlink(missing_ok=True)
        return a
    return m


def _positions(sorted_slots: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``np.searchsorted(sorted_slots, slots)`` for ``slots`` that all occur in ``sorted_slots``
    (ascending, distinct): a look-up table over their range when it is at most 4x their number
    plus 4,096 (a bulk load's consecutive slots), else the binary search."""
    if not sorted_slots.size or not slots.size:
        return np.searchsorted(sorted_slots, slots)
    lo, span = int(sorted_slots[0]), int(sorted_slots[-1]) - int(sorted_slots[0]) + 1
    if span > 4 * sorted_slots.size + 4096 or int(slots.min()) < lo or int(slots.max()) >= lo + span:
        return np.searchsorted(sorted_slots, slots)
    table = np.empty(span, np.int64)
    table[sorted_slots - lo] = np.arange(sorted_slots.size)
    return table[slots - lo]


def _interleave(n: int, dest: np.ndarray, old: np.ndarray, new: np.ndarray, dtype) -> np.ndarray:
    """An array of ``n`` values: ``new`` at positions ``dest``, ``old`` in order elsewhere."""
    out = np.empty(n, dtype=dtype)
    if dest.size == 0:
        out[:] = old
        return out
    taken = np.zeros(n, dtype=bool)
    taken[dest] = True
    np.logical_not(taken, out=taken)  # (in place: no second mask of n bytes)
    out[taken] = old
    out[dest] = new
    return out
