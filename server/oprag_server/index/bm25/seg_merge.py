"""The merge that folds a BM25 delta of recent writes into a new :class:`.segment.Segment` while
dropping dead postings (the layout: :mod:`.segment`; the thread and the install around it:
:mod:`.merging`).

The old segment's posting-sized arrays (``slots``, ``tf``, ``doc_terms``) are read in blocks of
:data:`BLOCK` values (:class:`_Old`) and the new ones are written in blocks (:class:`_Sink`): a
merge holds O(delta + block) of them in memory, not O(segment). Where the old arrays are
read-only maps of files (a snapshot's, a spilled merge's), each block's pages are given back to
the kernel once read (:func:`_release`, ``madvise(MADV_DONTNEED)``): they stay in its page cache,
out of the shard's resident set (session 49: a 73M-posting merge mapped its whole old segment,
+0.69 GiB of file-backed RSS for its duration, the 1M tree's peak).
"""

from __future__ import annotations

import errno
import io
import mmap
import os
from pathlib import Path

import numpy as np

from .delta import intern
from .segment import MAX_SLOT, Segment, _map_of

#: values of a posting-sized array a merge reads or writes at a time (16 MB of int32)
BLOCK = 1 << 22


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
        ``tf``, ``doc_terms``) is written as ``<name>.npy`` block by block and served from a
        read-only map of that file (:class:`_Sink`), so the merge does not hold them in anonymous
        memory (issue 13: the 1M tree's peak was a merge's new segment beside its temporaries);
        :meth:`Segment.spill` into the same directory then writes only the rest. An array whose
        file cannot be written is built in memory.
    :returns: the new segment; a term without live postings leaves the dictionary.
    :raises ValueError: a slot above :data:`MAX_SLOT`.

    Cost: O(P + T) numpy work plus one dictionary look-up per delta term (no per-posting
    Python); memory O(delta + :data:`BLOCK`) besides the outputs, except where a delta chunk's slot
    is below a live old chunk's (the old slots are then searched whole). Chunks and postings keep
    ascending slot order (the delta may hold slots below the segment's).
    """
    # live part of the old segment: the dead chunks' terms (forward index) give each term's dead
    # postings without a pass over all postings; the posting arrays are read in blocks (_Old)
    old_counts, o_doc_len = np.diff(seg.offsets), np.diff(seg.doc_off)
    o_doc_slots = seg.doc_slots
    dkeep = seg_live[seg.doc_slots]
    filt = False  # whether postings of removed chunks are left out as the old arrays are read
    if not dkeep.all():
        dead_terms = seg.rows_of(seg.doc_slots[~dkeep].astype(np.int64))
        if dead_terms.size:
            old_counts = old_counts - np.bincount(dead_terms, minlength=old_counts.size)
            filt = True
        dead_terms = None
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
    if not o_doc_slots.size or not ds.size or int(o_doc_slots[-1]) < int(ds.min()):
        before_old = old_cum[dt + 1]  # every old posting of the term has a smaller slot
    else:  # (a delta chunk below an old one: the old slots whole, as (term, slot) keys)
        o_sl = seg.slots[seg_live[seg.slots]] if filt else seg.slots
        o_tid = np.repeat(np.arange(T, dtype=np.int64), new_counts)
        before_old = np.searchsorted((o_tid << 32) | o_sl.astype(np.int64),
                                     (dt.astype(np.int64) << 32) | ds.astype(np.int64))
        o_sl = o_tid = None
    dest = before_old + np.arange(dt.size)
    before_old = dt = None
    P = int(offsets[-1])
    tf_dtype = np.uint16 if (not dtf.size or dtf.max() <= 65535) and seg.tf.dtype == np.uint16 else np.uint32
    p_edges = np.append(np.arange(0, seg.slots.size, BLOCK, dtype=np.int64), seg.slots.size)
    masks: list = []  # per block of the old postings: the live ones (packed bits), read once from slots

    def post_keep(i: int, lo: int, hi: int):
        if i == len(masks):
            masks.append(np.packbits(seg_live[seg.slots[lo:hi]]))
        return np.unpackbits(masks[i], count=hi - lo).view(bool)

    keep = post_keep if filt else None
    slots = _interleave(P, dest, _Old(seg.slots, p_edges, keep), ds, np.int32, _path(out_dir, "slots"))
    ds = None
    tf = _interleave(P, dest, _Old(seg.tf, p_edges, keep), dtf, tf_dtype, _path(out_dir, "tf"))
    dest = dtf = masks = None
    # forward index: chunks in slot order, old term ids renumbered
    old2new = None if all_kept else (np.cumsum(kept) - 1).astype(np.int32)  # old term id -> new (where kept)
    ddest = np.searchsorted(o_doc_slots, d_doc_slots) + np.arange(d_doc_slots.size)
    D = o_doc_slots.size + d_doc_slots.size
    doc_slots = _interleave(D, ddest, o_doc_slots, d_doc_slots, np.int32)
    doc_len = _interleave(D, ddest, o_doc_len, np.asarray(d_doc_len, np.int64), np.int64)
    doc_off = np.zeros(D + 1, np.int64)
    np.cumsum(doc_len, out=doc_off[1:])
    # the old terms in blocks of whole chunks (a removed chunk's terms are left out by chunk)
    so = seg.doc_off
    t_edges = np.unique(np.append(so[np.searchsorted(so, np.arange(0, int(so[-1]), BLOCK), "right") - 1], so[-1]))

    def doc_keep(i: int, lo: int, hi: int):
        d0, d1 = np.searchsorted(so, [lo, hi])
        return np.repeat(dkeep[d0:d1], np.diff(so[d0:d1 + 1]))

    old_terms = _Old(seg.doc_terms, t_edges, None if dkeep.all() else doc_keep, old2new)
    d_len = np.asarray(d_doc_len, np.int64)
    if not d_doc_slots.size or not o_doc_slots.size or int(o_doc_slots[-1]) < int(d_doc_slots[0]):
        edest = np.arange(P - d_len.sum(), P)  # (every delta chunk after the old ones)
    else:  # a delta chunk below a segment chunk: place its terms between
        first = np.repeat(np.cumsum(d_len) - d_len, d_len)
        edest = np.repeat(doc_off[ddest], d_len) + (np.arange(d_len.sum()) - first)
    doc_terms = _interleave(P, edest, old_terms, d_doc_terms_by_doc.astype(np.int32, copy=False), np.int32,
                            _path(out_dir, "doc_terms"))
    return Segment(terms, offsets, slots, tf, doc_slots, doc_off, doc_terms, vocab)


def _path(d: Path | None, name: str) -> Path | None:
    return None if d is None else Path(d) / f"{name}.npy"


def _release(a: np.ndarray, lo: int, hi: int) -> None:
    """Give back the pages of ``a[lo:hi]`` when ``a`` is (a view of) a read-only map of a file: the
    kernel keeps them in its page cache and maps them again on the next read (``madvise(2)``
    ``MADV_DONTNEED`` on a shared file mapping drops no data); nothing for any other array (on
    anonymous memory that call would zero it, on a copy-on-write map undo its changes)."""
    m = _map_of(a)
    dontneed = getattr(mmap, "MADV_DONTNEED", None)  # (Linux; elsewhere nothing is given back)
    if m is None or a.flags.writeable or not a.flags.c_contiguous or hi <= lo or dontneed is None:
        return
    with memoryview(m) as view:  # (an ACCESS_READ map only: a copy-on-write one would lose its changes, review49)
        if not view.readonly:
            return
    base = np.frombuffer(m, np.uint8).ctypes.data
    start, end = a.ctypes.data + lo * a.itemsize - base, a.ctypes.data + hi * a.itemsize - base
    ps = mmap.PAGESIZE
    s, e = start // ps * ps, min(len(m), -(-end // ps) * ps)
    if 0 <= s < e:
        try:
            m.madvise(dontneed, s, e - s)
        except (OSError, ValueError):
            pass


class _Old:
    """An old posting-sized array read in order in the blocks ``edges`` (int64, from 0 to its size), the values a
    block's ``keep(i, lo, hi)`` mask leaves out dropped (None: all kept) and, with ``remap``, mapped through it;
    each block's pages given back once read (:func:`_release`). A plain array (``edges`` None) is read whole."""

    def __init__(self, a: np.ndarray, edges: np.ndarray | None = None, keep=None, remap=None) -> None:
        self.a, self.keep, self.remap = a, keep, remap
        self.edges = np.array([0, a.size], np.int64) if edges is None else edges
        self.block, self.buf, self.at = 0, a[:0], 0

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` values (fewer at the end): views of the array where nothing is left out or mapped. A
        block's pages are given back once its last value is taken."""
        parts = []
        while k > 0:
            if self.at == self.buf.size:
                if self.block + 1 >= self.edges.size:
                    break
                i, lo, hi = self.block, int(self.edges[self.block]), int(self.edges[self.block + 1])
                v = self.a[lo:hi]
                if self.keep is not None:
                    v = v[self.keep(i, lo, hi)]
                self.buf, self.at, self.block = (v if self.remap is None else self.remap[v]), 0, i + 1
                if not self.buf.size:
                    _release(self.a, lo, hi)
                continue
            n = min(k, self.buf.size - self.at)
            parts.append(self.buf[self.at: self.at + n])
            self.at, k = self.at + n, k - n
            if self.at == self.buf.size:
                lo, hi = int(self.edges[self.block - 1]), int(self.edges[self.block])
                if self.keep is None and self.remap is None:
                    parts[-1] = np.array(parts[-1])  # (a view of pages about to be given back: read now)
                _release(self.a, lo, hi)
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else self.a[:0]


def _reserve(fd: int, offset: int, size: int) -> None:
    """Reserve ``size`` bytes of the file from ``offset`` (``posix_fallocate``). :raises OSError: no space (ENOSPC,
    EDQUOT, EFBIG); a file system that cannot reserve (EOPNOTSUPP, EINVAL) is written without it (a write that fails
    then goes on in memory: :meth:`_Sink.write`)."""
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise


class _Sink:
    """An array of ``n`` values written in order: into the ``.npy`` file ``path`` (:meth:`Segment.save`'s format,
    its space reserved first) and returned as a read-only map of it, or in memory (no ``path``; a file that cannot
    be made or written: an ``OSError``, a full or read-only disk: the blocks written so far are read back). The file
    is written through its descriptor, unbuffered, so a block's write has ended, whole or with an error, when
    :meth:`write` returns (review49: a buffered tail written at ``close`` could fail after the blocks were gone)."""

    def __init__(self, n: int, dtype, path: Path | None) -> None:
        self.n, self.dtype, self.path, self.i, self.fd, self.arr = n, np.dtype(dtype), path, 0, None, None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                head = io.BytesIO()
                np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                            "fortran_order": False, "shape": (n,)})
                self._all(head.getvalue())
                self.head = head.tell()
                if n:
                    _reserve(self.fd, self.head, n * self.dtype.itemsize)
            except (OSError, ValueError):
                self._drop_file()
        if self.fd is None:
            self.arr = np.empty(n, self.dtype)

    def _drop_file(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = None
        try:
            self.path.unlink(missing_ok=True)
        except OSError:  # (a read-only file system: the directory is the caller's to remove)
            pass

    def _all(self, data) -> None:
        """Write every byte of ``data`` (``os.write`` may write part of it)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            view = view[os.write(self.fd, view):]

    def buffer(self, k: int) -> np.ndarray:
        """Where the next ``k`` values are to be put before :meth:`write`: the array's own slice in memory."""
        return self.arr[self.i: self.i + k] if self.fd is None else np.empty(k, self.dtype)

    def _put(self, buf: np.ndarray) -> None:
        self._all(np.ascontiguousarray(buf, self.dtype))

    def write(self, buf: np.ndarray) -> None:
        if self.fd is not None:
            try:
                self._put(buf)
            except OSError:  # (to memory: the whole blocks written so far read back, then this one kept)
                written = self.i
                self.arr = np.empty(self.n, self.dtype)
                try:
                    self.arr[:written] = np.fromfile(self.path, self.dtype, written, offset=self.head)
                finally:
                    self._drop_file()
        if self.fd is None and not np.shares_memory(buf, self.arr):
            self.arr[self.i: self.i + buf.size] = buf
        self.i += buf.size

    def done(self) -> np.ndarray:
        """The array: a read-only map of the file (an ``OSError`` from closing it, such as a deferred write error,
        is raised: the merge fails and the old segment keeps serving), or the array in memory."""
        if self.fd is None:
            return self.arr
        fd, self.fd = self.fd, None
        os.close(fd)
        try:
            return np.load(self.path, mmap_mode="r").view(np.ndarray)
        except (OSError, ValueError):  # (cannot be mapped: read whole, every byte having been written)
            arr = np.fromfile(self.path, self.dtype, self.n, offset=self.head)
            self.path.unlink(missing_ok=True)
            if arr.size != self.n:
                raise OSError(f"{self.path}: {arr.size} of {self.n} values read back") from None
            return arr


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


def _interleave(n: int, dest: np.ndarray, old, new: np.ndarray, dtype, path: Path | None = None) -> np.ndarray:
    """An array of ``n`` values: ``new`` at positions ``dest`` (int64, ascending), the values of ``old`` (an array, or
    an :class:`_Old` read block by block) in order elsewhere; built :data:`BLOCK` values at a time into a
    :class:`_Sink` (the ``.npy`` file ``path``, mapped back, or memory)."""
    src = old if isinstance(old, _Old) else _Old(np.asarray(old))
    out = _Sink(n, dtype, path)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        i0, i1 = np.searchsorted(dest, [lo, hi])
        buf = out.buffer(hi - lo)
        at = dest[i0:i1] - lo
        gap = np.ones(hi - lo, bool)
        gap[at] = False
        buf[gap] = src.take(hi - lo - int(i1 - i0))
        buf[at] = new[i0:i1]
        out.write(buf)
    return out.done()
