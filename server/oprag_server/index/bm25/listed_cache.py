"""Per shard, what the wide-path BM25 pass of recent queries left (:mod:`..kernels_wide_keep`),
so that a dense-first widening round (:class:`oprag_server.operators.hybrid.Widening`: the
same query asking for the BM25 top-``4m`` after its top-``m``) is answered without a second
full pass over the segment.

An entry is :func:`..kernels_wide_keep.wide_pass`'s result for one query (its candidates for
the m asked, the listed count, the blocks' maxima) with the query's term arrays, keyed by
everything that defines them: the query terms, the idf bytes, ``avgdl``,
``k1``, ``b`` (unfiltered queries only: the wide path). Every entry belongs to one *generation*
of the index: the caller's write counter (``ChunkStore.version``, which grows on every apply
and delete) and the identity of the index's segment and delta layers (a merge's start and its
install replace them); any change drops every entry. So a cached list is never served after a
write. At most :data:`CAP` entries (least recently used dropped first); each holds the
candidates (typically a few hundred slots), the maxima (4 bytes per 256 slots: 8 KB at 500K
chunks) and the query's term arrays.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

#: entries kept per shard
CAP = 64


class ListedCache:
    """One shard's entries (module docstring); thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gen: tuple = ()
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(terms, idf: np.ndarray, avgdl: float, k1: float, b: float) -> tuple:
        return tuple(terms), np.ascontiguousarray(idf, np.float64).tobytes(), float(avgdl), float(k1), float(b)

    @staticmethod
    def generation(ix, version) -> tuple:
        """What a cached list is valid for: the write counter, the index's segment (a weak
        reference: a replaced segment is not kept alive by the cache, and a dead reference never
        equals a live one) and its delta layers' identities (they change with the counter, or
        with a merge's start, which also leaves scores as they were)."""
        return (version, weakref.ref(ix._seg), id(ix._delta), id(getattr(ix, "_frozen", None)))  # noqa: SLF001

    def _check(self, gen: tuple) -> None:
        if len(gen) != len(self.gen) or gen[0] != self.gen[0] or gen[1]() is None or gen[1]() is not self.gen[1]() \
                or gen[2:] != self.gen[2:]:
            self.entries.clear()
            self.gen = gen

    def get(self, gen: tuple, key: tuple):
        """The entry for ``key`` of generation ``gen``, or None."""
        with self.lock:
            self._check(gen)
            e = self.entries.get(key)
            if e is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return e

    def put(self, gen: tuple, key: tuple, entry: tuple) -> None:
        """Keep ``entry`` for ``key`` of generation ``gen``."""
        with self.lock:
            self._check(gen)
            self.entries[key] = entry
            self.entries.move_to_end(key)
            while len(self.entries) > CAP:
                self.entries.popitem(last=False)

    def nbytes(self) -> int:
        return sum(a.nbytes for e in list(self.entries.values()) for a in e if isinstance(a, np.ndarray))


def take(ix) -> list:
    """(The install of a merge) the index's cached entries, removed: they are views of the former
    segment's postings, and a segment loaded from a snapshot is a mapping of its files, which the
    next snapshot deletes; kept, they held those files open, mapped and on the disk (trial16).
    :returns: the entries, for the caller to free off the request loop. (The top-m scratch's
    term bounds and wide rows are switched to the new segment's by :func:`.listed_top.adopt`.)"""
    c = ix.__dict__.get("_listed_cache")
    if c is None:
        return []
    with c.lock:
        out = list(c.entries.values())
        c.entries.clear()
    return out


def of(ix) -> ListedCache:
    """The index's cache (created on first use)."""
    c = ix.__dict__.get("_listed_cache")
    return c if c is not None else ix.__dict__.setdefault("_listed_cache", ListedCache())
