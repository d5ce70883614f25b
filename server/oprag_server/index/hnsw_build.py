"""HNSW compaction in the background while the shard serves (issue 13: "an index type that cannot remove vectors
filters dead ids and compacts in the background").

HNSW cannot delete: a removed vector stays in the graph, marked dead and filtered from every search, until a quarter
of the graph is dead; then the graph is rebuilt from the live vectors (:meth:`.ann.AnnIndex.needs_compaction`). Done in
the remove that crossed the quarter, that rebuild held every request to the shard for as long as inserting every live
vector takes (FAISS's HNSW add on one core: ~4,000 vectors a second at M 32, efConstruction 80, D 384, so a shard of
400K live vectors ~100 s). From :data:`BACKGROUND_MIN` live vectors on it is a :class:`GraphBuild` instead:

1. (the shard's thread, in the remove) the live ANN ids and their slots are copied and a thread starts; the old graph
   keeps answering every search and taking every write (its dead ones filtered as before).
2. (the build's thread; FAISS leaves the GIL during its adds) a new graph gets those vectors, read from the old
   graph's storage and deferred tail a block at a time under the structure's lock (a write there may move FAISS's
   storage), in ANN-id order; then, in rounds while there are many, the vectors added since.
3. (the shard's thread, between requests or at the next write once the thread is done) the install
   (:func:`finish_graph`): the last few vectors added since are inserted, the ids removed meanwhile marked dead, and
   the new graph replaces the old one (its deferred tail included: the new graph holds every vector), the dense
   index renumbering its rows.

Memory: the new graph's storage is a second copy of the live vectors while it is built, as the synchronous rebuild's
was while it ran. A snapshot saves the graph that serves; a restart during a build loses it, and the next remove
starts it again. Searches before the install use the old graph, after it the new one (canonical scores either way).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .ann_copies import Copies, hnsw_storage

#: compactions of at least this many live vectors run in the background (a smaller one takes < ~0.5 s in the write;
#: at 16,384 a replacing ingest held every query ~1 s under the commit's write lock at 10K vectors a shard, session 41)
BACKGROUND_MIN = 2_048
#: vectors read from the old graph per locked read
BLOCK = 4096
#: after the trigger's vectors, the thread inserts those added since in rounds while a round finds at least this many
#: (however many rounds: an ingest faster than the build delays the install, never makes it insert thousands; trial40
#: saw 0.5-0.8 s stalls when eight rounds ended behind a replacing ingest)
ROUND_MIN = 256


class ThreadBuild:
    """A structure built by a thread of its own (this compaction, :class:`.ivf_build.IvfBuild`): ``_run`` is the
    thread's work, which checks :attr:`cancelled` between blocks and leaves its timing in :attr:`seconds`."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.cancelled = False
        self.seconds = 0.0
        self.started = time.perf_counter()
        # not a daemon: an exit waits for FAISS to return (a daemon thread ended inside C++ aborts the process)
        self.thread = threading.Thread(target=self._run, name=f"oprag-{type(self).__name__}")

    def _run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """True once the thread has ended (built, failed or cancelled)."""
        return not self.thread.is_alive()

    def cancel(self) -> None:
        """Stop at the next block (what it built is dropped)."""
        self.cancelled = True


class GraphBuild(ThreadBuild):
    """One background compaction of ``ann`` (an HNSW :class:`.ann.AnnIndex`; module docstring)."""

    #: what started a compaction, as its log line says
    CROSSED = "the delete or replacement that crossed a quarter dead"
    AT_START = "a graph loaded past a quarter dead: a restart had cut its compaction short"

    def __init__(self, ann, cause: str = CROSSED) -> None:
        super().__init__()
        self.ann, self.cause = ann, cause
        from .graph_layout import live_by_slot  # noqa: PLC0415 - (it imports this package's kernels)

        self.ids = live_by_slot(ann.ann_slot).astype(np.int64)  # old ANN ids -> new ids 0..n-1, in slot order
        self.known = int(ann.ann_slot.size)  # old ids below this are among ``ids`` or were dead at the trigger
        self.index = self.copies = self._growing = self.seeds = None
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            index, copies = self.ann._new_hnsw(), Copies()  # noqa: SLF001
            self._growing = index  # (what nbytes() counts meanwhile)
            self._fill(index, copies, self.ids)
            while True:  # (until caught up: the install then inserts only the last few on the shard's thread)
                new, end = self.ann.locked_ids_since(self.known)
                if new.size < ROUND_MIN or self.cancelled:
                    break
                self._fill(index, copies, new)
                self.ids, self.known = np.concatenate([self.ids, new]), end
            if not self.cancelled:
                self.seeds = _seeds_of(index, self.ann.dim)
                self.index, self.copies = index, copies
        except BaseException as exc:  # noqa: BLE001 - finish_graph() then compacts in the write
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def _fill(self, index, copies: Copies, ids: np.ndarray) -> None:
        for a in range(0, ids.size, BLOCK):
            if self.cancelled:
                return
            copies.add(index, self.ann.locked_gather(ids[a:a + BLOCK]))

    def nbytes(self) -> int:
        """(Estimated) bytes of the graph built so far, its stored vectors included (:func:`graph_bytes`)."""
        g = self._growing
        return graph_bytes(int(g.ntotal) if g is not None else 0, self.ann.params.hnsw_m, self.ann.dim)


def graph_bytes(n: int, m: int, dim: int = 0) -> int:
    """Estimated bytes of an ``IndexHNSWFlat`` of ``n`` vectors at ``M`` ``m``: ``n * (4*dim + 4*(2*M + 1) + 12)``
    (stored float32 vectors, ``dim`` 0 to leave them out; level-0 links 2M int32 plus the upper levels' ~M/(M-1)
    expected; offsets and levels). From FAISS's ``IndexHNSWFlat`` layout."""
    return n * (4 * dim + 4 * (2 * m + 1) + 12)


class _Graph:
    """What :meth:`.dense_low.LowSeeds._build` reads of an index: its FAISS graph, stored vectors and width."""

    def __init__(self, index, dim: int) -> None:
        self._index, self.dim = index, dim

    def storage(self) -> np.ndarray:
        return hnsw_storage(self._index)


def _seeds_of(index, dim: int):
    """(The build's thread) the dense-minimum seeds of the new graph (:class:`.dense_low.LowSeeds`), built here: built
    by the first query after the install they took that query 2.35 s at 100K vectors (session 40)."""
    from .dense_low import LowSeeds  # noqa: PLC0415 - (numba kernels: imported where used)

    seeds = LowSeeds()
    seeds._build(_Graph(index, dim))  # noqa: SLF001
    return seeds


def finish_graph(ann, build: GraphBuild) -> np.ndarray | None:
    """(The shard's thread, ``ann``'s lock held, ``build``'s thread ended: :meth:`.ivf_build.IvfBuilds.install_graph`
    joins it before taking the lock its reads take) insert what was added since its last round, and put its graph
    in place of ``ann``'s: ``ann_slot`` with the ids removed meanwhile dead, no deferred tail.

    :returns: int64[A] old ANN id of each new id (the caller renumbers its rows); None when the build failed or was
        cancelled (nothing changed: the caller compacts synchronously).
    """
    if build.index is None:
        return None
    rest = np.flatnonzero(ann.ann_slot[build.known:] >= 0).astype(np.int64) + build.known
    if rest.size:
        build.copies.add(build.index, ann.gather(rest))
    old, was_dead = np.concatenate([build.ids, rest]), ann.dead
    ann._index, ann._copies = build.index, build.copies  # noqa: SLF001
    ann.ann_slot = ann.ann_slot[old].copy()  # (-1 where removed since the trigger)
    ann.dead, ann._selector, ann.laid_at = int((ann.ann_slot < 0).sum()), None, 0  # noqa: SLF001
    ann.compactions.append((ann.live, was_dead - ann.dead, build.seconds, "in the background while the shard served, "
                            f"installed {time.perf_counter() - build.started:.1f} s after {build.cause}"))
    ann._tail, ann._tail_at, ann._tail_n, ann._groups = np.zeros((0, ann.dim), dtype=np.float32), 0, 0, []  # noqa: SLF001
    ann.seeds = build.seeds  # (the shard's searcher adopts them: shards/search.py, _ann_lows)
    return old
