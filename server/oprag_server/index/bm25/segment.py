"""Immutable BM25 postings segment (CSR by term, with a forward index by chunk); the merge that
folds a delta of recent writes into a new segment while dropping dead postings is
:func:`.seg_merge.merge`.

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
    def save(self, d: Path, parked: tuple[str, ...] = ()) -> list[Path]:
        """Write every array as ``<name>.npy`` and the terms as ``terms.json`` under ``d``
        (the caller makes them durable); a file the arrays map (a load, :meth:`map_files`,
        :meth:`spill`) as a hard link to it while that path names the same file (:mod:`.files`:
        ~0.74 GB not written again per 1M-chunk shard after a spilled merge). A file already at
        a destination is unlinked, never truncated (it may be linked elsewhere). ``parked``: arrays
        whose file under ``d`` already holds them (:func:`.seg_merge.merge`'s ``out_dir``), left as they are.
        :returns: the files."""
        d.mkdir(parents=True, exist_ok=True)
        src = self.__dict__.get("_source")
        out = []
        for n in (*_ARRAYS, "terms"):
            p = d / (f"{n}.npy" if n != "terms" else "terms.json")
            if n in parked:
                out.append(p)
                continue
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
        """Move the arrays out of anonymous memory: write them under ``d`` (:meth:`save`; an
        array :func:`.seg_merge.merge` already wrote there, ``out_dir``, is not written again) and
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
            self.save(d, tuple(n for n in _ARRAYS if _maps(getattr(self, n), d / f"{n}.npy")))
            old = self.map_files(d)
        except OSError:
            old = None
        if old is None:
            shutil.rmtree(d, ignore_errors=True)
            return False
        del old
        self.__dict__["_spilled"] = weakref.finalize(self, shutil.rmtree, str(d), True)
        return True

    def save_renumbered(self, d: Path) -> tuple[list[Path], bool]:
        """:meth:`renumbered`'s :meth:`save` under ``d``: ``(files, whether they are this segment as it is)``. When its
        renumbered image is already in files (:meth:`note_renumbered`, a complete snapshot's) that still hold it (same
        device and inode), they are hard-linked instead of renumbered and written again (trial53 #5: after a delete,
        every snapshot that only session turns caused wrote a 1M-chunk shard's ~0.74 GB of postings anew)."""
        src = self.__dict__.get("_renumbered")
        if src is not None:
            d.mkdir(parents=True, exist_ok=True)
            out = []
            for name in src[1]:
                (d / name).unlink(missing_ok=True)
                if not link_same(src, name, d / name):
                    break
                out.append(d / name)
            else:
                return out, False
        out = self.renumbered()
        return out.save(d), out is self

    def note_renumbered(self, d: Path) -> None:
        """Remember that the files under ``d`` hold this segment renumbered (:meth:`save_renumbered` wrote or linked
        them there for a snapshot now complete); they are never written in place, so while they are there they do."""
        self._note_files("_renumbered", d)

    def _note_source(self, d: Path) -> None:
        """Remember the files under ``d`` that the arrays map (for :meth:`save`'s links)."""
        self._note_files("_source", d)

    def _note_files(self, key: str, d: Path) -> None:
        """Keep the ids of the segment's files under ``d`` as ``key`` (dropped when one cannot be read)."""
        src = file_ids(d, [f"{n}.npy" for n in _ARRAYS] + ["terms.json"])
        if src is None:
            self.__dict__.pop(key, None)
        else:
            self.__dict__[key] = src

    def check(self) -> None:
        """:raises ValueError: shapes or offsets do not fit together."""
        T, P, D = len(self.terms), self.slots.size, self.doc_slots.size
        ok = (self.offsets.shape == (T + 1,) and self.tf.shape == (P,) and self.doc_terms.shape == (P,)
              and self.doc_off.shape == (D + 1,) and int(self.offsets[0]) == 0 and int(self.offsets[-1]) == P
              and int(self.doc_off[0]) == 0 and int(self.doc_off[-1]) == P and len(self.vocab) == T)
        if not ok:
            raise ValueError("postings segment arrays are inconsistent")


def _maps(a: np.ndarray, p: Path) -> bool:
    """Whether ``a`` is a read-only map of the whole of file ``p`` as :func:`.seg_merge._park` made it."""
    m = getattr(a, "base", None)
    return isinstance(m, np.memmap) and m.filename is not None and Path(m.filename) == p.absolute() \
        and m.size == a.size and not a.flags.writeable


def _map_of(a: np.ndarray) -> mmap.mmap | None:
    """The memory map of a file that ``a`` is (a view of), found along its ``base`` chain; None for any other array."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None)
    return a


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is (a view of) a memory map of a file."""
    return _map_of(a) is not None
