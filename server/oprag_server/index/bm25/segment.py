"""Immutable BM25 postings segment (CSR by term, with a forward index by chunk) and the merge
that folds a delta of recent writes into a new segment while dropping dead postings.

A :class:`Segment` holds, for ``T`` terms, ``D`` chunks and ``P`` postings:

* ``terms``: ``list[str]`` ``[T]`` term id -> term, and ``vocab``: ``dict[str, int]`` its
  inverse (the term dictionary);
* ``offsets`` int64 ``[T+1]``: the postings of term id ``t`` are positions
  ``offsets[t]:offsets[t+1]`` of ``slots`` (int32 ``[P]``, ascending within a term) and
  ``tf`` (uint16 ``[P]``, or uint32 when some term frequency exceeds 65,535);
* the forward index: ``doc_slots`` int32 ``[D]`` ascending, ``doc_off`` int64 ``[D+1]`` and
  ``doc_terms`` int32 ``[P]`` (the term ids of chunk ``doc_slots[d]`` are
  ``doc_terms[doc_off[d]:doc_off[d+1]]``), used to find a removed chunk's terms.

Memory: 10 bytes per posting with uint16 tf (4 slot + 2 tf + 4 forward term id), plus 12
bytes per term and 12 per chunk of offsets, plus the term dictionary. Every array may be a
read-only memory map (:meth:`Segment.load` with ``mmap=True``); nothing here writes to them.
"""

from __future__ import annotations

import json
import mmap
import shutil
import sys
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from .files import file_ids, link_same

_ARRAYS = ("offsets", "slots", "tf", "doc_slots", "doc_off", "doc_terms")
#: largest slot a segment can hold (slots are stored as int32)
MAX_SLOT = np.iinfo(np.int32).max


@dataclass(eq=False)
class Segment:
    """One immutable postings segment (see the module docstring for shapes and dtypes)."""

    terms: list[str]
    offsets: np.ndarray
    slots: np.ndarray
    tf: np.ndarray
    doc_slots: np.ndarray
    doc_off: np.ndarray
    doc_terms: np.ndarray
    vocab: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.vocab and self.terms:
            self.vocab = dict(zip(self.terms, range(len(self.terms))))

    @classmethod
    def empty(cls) -> "Segment":
        z32, z64 = np.zeros(0, np.int32), np.zeros(1, np.int64)
        return cls([], z64, z32, np.zeros(0, np.uint16), z32, z64.copy(), z32.copy())

    @property
    def n_postings(self) -> int:
        return int(self.slots.size)

    def df(self) -> np.ndarray:
        """int32 ``[T]``: postings per term (dead ones included)."""
        return np.diff(self.offsets).astype(np.int32)

    def postings(self, tid: int) -> tuple[np.ndarray, np.ndarray]:
        """``(slots int32 [n], tf uint [n])`` of term id ``tid`` (views, not copies)."""
        a, b = int(self.offsets[tid]), int(self.offsets[tid + 1])
        return self.slots[a:b], self.tf[a:b]

    def doc_term_ids(self, slot: int) -> np.ndarray | None:
        """int32 term ids of chunk ``slot``, or None when the segment does not hold it."""
        if not 0 <= slot <= MAX_SLOT:
            return None
        # (an int32 needle: a Python int makes numpy cast all of doc_slots, ~0.4 ms at 500K chunks)
        d = int(np.searchsorted(self.doc_slots, np.int32(slot)))
        if d >= self.doc_slots.size or int(self.doc_slots[d]) != slot:
            return None
        return self.doc_terms[int(self.doc_off[d]):int(self.doc_off[d + 1])]

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """int32 ``[sum of their term counts]``: the term ids of chunks ``slots`` (int64 ``[K]``,
        each held here), one chunk's after another. O(K + their terms), not O(segment).

        :raises ValueError: a slot the segment does not hold."""
        d = np.searchsorted(self.doc_slots, slots.astype(np.int32))
        if slots.size and (int(d.max()) >= self.doc_slots.size or not np.array_equal(self.doc_slots[d], slots)):
            raise ValueError("rows_of: a slot the segment does not hold")
        lo, n = self.doc_off[d], self.doc_off[d + 1] - self.doc_off[d]
        return self.doc_terms[np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))]

    def renumbered(self) -> "Segment":
        """The same postings with chunk ``doc_slots[i]`` moved to slot ``i`` (the order a
        snapshot load assigns slots in); the segment itself when they are ``0..D-1`` already (a
        bulk load into a fresh or just loaded shard: no O(P log D) search per snapshot)."""
        D = self.doc_slots.size
        if not D or (int(self.doc_slots[0]) == 0 and int(self.doc_slots[-1]) == D - 1):  # ascending, unique
            return self
        slots = np.searchsorted(self.doc_slots, self.slots).astype(np.int32)
        return Segment(self.terms, self.offsets, slots, self.tf, np.arange(self.doc_slots.size, dtype=np.int32),
                       self.doc_off, self.doc_terms, self.vocab)

    def nbytes(self) -> tuple[int, int]:
        """``(array bytes, term dictionary bytes)``; see :attr:`terms_nbytes`."""
        return sum(int(getattr(self, n).nbytes) for n in _ARRAYS), self.terms_nbytes

    def unmapped_nbytes(self) -> int:
        """Bytes of the arrays held in anonymous memory: every array but a read-only map of a
        file (:meth:`load`, :meth:`map_files`), whose pages the kernel may drop again."""
        return sum(int(a.nbytes) for a in (getattr(self, n) for n in _ARRAYS) if not _mapped(a))

    @cached_property
    def terms_nbytes(self) -> int:
        """Term dictionary bytes: ``sys.getsizeof`` of the dict, the list, every term string
        and every id int above 256 (CPython caches the small ones). Computed once."""
        n = len(self.terms)
        return (sys.getsizeof(self.vocab) + sys.getsizeof(self.terms) + sum(map(sys.getsizeof, self.terms))
                + 28 * max(0, n - 257))

    # ------------------------------------------------------------------ files
    def save(self, d: Path) -> list[Path]:
        """Write every array as ``<name>.npy`` and the terms as ``terms.json`` under ``d``
        (the caller makes them durable); a file the arrays map (a load, :meth:`map_files`,
        :meth:`spill`) as a hard link to it while that path names the same file (:mod:`.files`:
        ~0.74 GB not written again per 1M-chunk shard after a spilled merge). A file already at
        a destination is unlinked, never truncated (it may be linked elsewhere). :returns: the files."""
        d.mkdir(parents=True, exist_ok=True)
        src = self.__dict__.get("_source")
        out = []
        for n in (*_ARRAYS, "terms"):
            p = d / (f"{n}.npy" if n != "terms" else "terms.json")
            p.unlink(missing_ok=True)
            if src is None or not link_same(src, p.name, p):
                if n == "terms":  # \u escapes: any str survives
                    p.write_text(json.dumps(self.terms), encoding="ascii")
                else:
                    np.save(p, np.ascontiguousarray(getattr(self, n)))
            out.append(p)
        return out

    @classmethod
    def load(cls, d: Path, mmap: bool = True) -> "Segment":
        """Read a segment written by :meth:`save` (arrays memory-mapped read-only when ``mmap``).

        :raises ValueError: the arrays are inconsistent. :raises OSError: a file is missing.
        """
        # a plain ndarray view of each map: same pages, but slicing it on the query path does not
        # go through np.memmap's Python-level __array_finalize__ / __getitem__ (~2 us per slice)
        arrs = {n: np.load(d / f"{n}.npy", mmap_mode="r" if mmap else None).view(np.ndarray) for n in _ARRAYS}
        terms = json.loads((d / "terms.json").read_text(encoding="ascii"))
        seg = cls(terms, **arrs)
        seg.check()
        if mmap:
            seg._note_source(d)
        return seg

    def map_files(self, d: Path) -> list[np.ndarray] | None:
        """Swap every array for a read-only memory map of its file under ``d`` (written by
        :meth:`save` from this segment: same values), when each file's shape and dtype match.

        :returns: the former arrays (the caller frees them), or None (nothing changed: a file
            missing, unreadable or of another shape or dtype)."""
        try:
            maps = {n: np.load(d / f"{n}.npy", mmap_mode="r").view(np.ndarray) for n in _ARRAYS}
        except (OSError, ValueError):
            return None
        if any(maps[n].shape != getattr(self, n).shape or maps[n].dtype != getattr(self, n).dtype for n in _ARRAYS):
            return None
        old = [getattr(self, n) for n in _ARRAYS]
        for n in _ARRAYS:
            setattr(self, n, maps[n])
        self._note_source(d)
        spilled = self.__dict__.pop("_spilled", None)
        if spilled is not None:  # (the spill's files are not served any more: gone now)
            spilled()
        return old

    def spill(self, d: Path) -> bool:
        """Move the arrays out of anonymous memory: write them under ``d`` (:meth:`save`) and
        serve them from read-only maps of those files (:meth:`map_files`); values, shapes and
        dtypes are unchanged. ``d`` (a directory of its own, not a snapshot) is removed when this
        segment is freed or serves another copy of its files (:meth:`map_files`: a snapshot's).
        No fsync: the files are a cache of memory, never read after a restart.

        Issue 13: a merge builds the new segment in anonymous memory (~700 MB per 1M-chunk
        shard), where it stayed until the next snapshot mapped its copy; the shards merge one
        after another (:mod:`.merge_gate`), so each shard's merged segment stayed resident
        through the next shard's merge, the process tree's peak.

        :returns: True if spilled; False (arrays kept as they were, ``d`` removed) when a file
            could not be written or mapped back (``OSError``: a full disk, a read-only one).
        """
        d = Path(d)
        try:
            self.save(d)
            old = self.map_files(d)
        except OSError:
            old = None
        if old is None:
            shutil.rmtree(d, ignore_errors=True)
            return False
        del old
        self.__dict__["_spilled"] = weakref.finalize(self, shutil.rmtree, str(d), True)
        return True

    def _note_source(self, d: Path) -> None:
        """Remember the files under ``d`` that the arrays map (for :meth:`save`'s links)."""
        src = file_ids(d, [f"{n}.npy" for n in _ARRAYS] + ["terms.json"])
        if src is None:
            self.__dict__.pop("_source", None)
        else:
            self.__dict__["_source"] = src

    def check(self) -> None:
        """:raises ValueError: shapes or offsets do not fit together."""
        T, P, D = len(self.terms), self.slots.size, self.doc_slots.size
        ok = (self.offsets.shape == (T + 1,) and self.tf.shape == (P,) and self.doc_terms.shape == (P,)
              and self.doc_off.shape == (D + 1,) and int(self.offsets[0]) == 0 and int(self.offsets[-1]) == P
              and int(self.doc_off[0]) == 0 and int(self.doc_off[-1]) == P and len(self.vocab) == T)
        if not ok:
            raise ValueError("postings segment arrays are inconsistent")


def merge(seg: Segment, seg_live: np.ndarray, d_terms: list[str], d_key: np.ndarray, d_tf: np.ndarray,
          d_doc_slots: np.ndarray) -> Segment:
    """A new segment: the postings of ``seg`` whose chunk is live plus the delta's.

    :param seg: the current segment (not modified).
    :param seg_live: bool ``[>= max slot + 1]``: True where the chunk's postings in ``seg`` are
        live (a removed chunk is False).
    :param d_terms: the delta's term dictionary (delta term id -> term).
    :param d_key: int64 ``[Pd]`` ascending, ``delta term id << 32 | slot`` of the delta's live
        postings; :param d_tf: int ``[Pd]`` their term frequencies.
    :param d_doc_slots: int64 ``[Dd]`` ascending: every live delta chunk (also those without
        tokens); none of them live in ``seg``.
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
        t = d_terms[i]
        j = vocab.get(t)
        if j is None:
            j = vocab[t] = len(terms)
            terms.append(t)
        remap[i] = j
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
    before_old = None
    P = int(offsets[-1])
    tf_dtype = np.uint16 if (not dtf.size or dtf.max() <= 65535) and o_tf.dtype == np.uint16 else np.uint32
    slots = _interleave(P, dest, o_slots, ds, np.int32)
    tf = _interleave(P, dest, o_tf, dtf, tf_dtype)
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
    return Segment(terms, offsets, slots, tf, doc_slots, doc_off, doc_terms, vocab)


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


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is (a view of) a memory map of a file."""
    while a is not None:
        if isinstance(a, mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False
