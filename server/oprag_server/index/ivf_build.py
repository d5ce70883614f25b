"""IVF training, and retraining in the background while the shard serves (issue 13).

An IVF shard retrains each time it has grown 8x since its last training (:class:`.ann.AnnIndex`: the lists stay
balanced). Done inside the write that crossed the size, a retraining held every request to the shard for its whole
k-means and re-add: at 262K vectors and 1,024 lists 3.8 s of k-means and 2.3 s of adding the vectors on one core
(bench/RESULTS.md, sessions 38 and 40), and 2 sqrt(n) lists at 2M vectors ~28 s of k-means alone.

From :data:`BACKGROUND_MIN` vectors on, a retraining is an :class:`IvfBuild` instead:

1. (the shard's thread, in the write that crossed the size) the *trigger*: the live slots in row order (the new
   structure's ANN ids 0..n-1) are copied, and a thread starts. The write then adds its vectors to the current
   structure, which keeps answering every search until the install.
   The k-means sample is copied there too: the trigger's live vectors strided as a synchronous training strides them
   (at most 64 a list; :func:`train_sample`), so the new centroids depend on the writes up to the trigger alone (read
   on the thread, the sample held only the picked vectors still live then: a replay after a crash, whose deletes
   land faster than the first run's, trained other centroids and answered differently: trial58 #1).
2. (the build's thread; FAISS leaves the GIL) k-means on that sample (:func:`new_ivf`), then every trigger slot still
   live is encoded into the new lists, in blocks of :data:`FILL_BLOCK` read from the shard's float32 copy under the
   dense index's lock (a remove there moves rows: the lock keeps a block consistent); then the chunks written since,
   in rounds while a round finds at least :data:`FILL_BLOCK` of them.
3. (the shard's thread, between requests or at the next write once the thread is done; a write that finds the shard
   grown 2x past the trigger waits for it) the *install* (:func:`finish`): ids whose slot was removed since are
   dropped from the new lists, the chunks written since the thread's last round are added after them, and the new structure
   replaces the old one at once. Its contents are then exactly the live vectors, as a synchronous retraining's.

Between trigger and install a search sees the old lists plus every write (the old structure takes the writes); which
search runs before the install depends on timing, as with HNSW's deferred inserts, while every score stays canonical
and a certified top-k is the exact one whatever structure picked the candidates. A snapshot waits for a build
under way and writes the new structure (:mod:`..shards.snapjob`, trial58b #2: a snapshot of the old lists made the first
write after a restart retrain on the vectors live then); a kill -9 during a build loses it, and the replayed write that
crossed the size starts it again on the same sample.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import numpy as np

from . import hnsw_build
from .hnsw_build import GraphBuild, ThreadBuild, finish_graph
from .ivf_lists import ivf_lists

#: retrainings of at least this many vectors run in the background (at 40,000 vectors, 512 lists: 2.1 s of k-means;
#: at ~5,000, 128 lists: 0.08 s, in the write as before)
BACKGROUND_MIN = 16_384
#: vectors encoded per locked read of the shard's copy (~12 MB of float32 at D 384: a few ms under the lock)
FILL_BLOCK = 8192
#: a write that finds the shard this many times the trigger's size waits for the build
CATCH_UP = 2


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def locked(method):
    """A method of :class:`.ann.AnnIndex` that changes the structure: run holding its ``_mut`` (a build's thread
    reads the structure under it)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._mut:
            return method(self, *args, **kwargs)
    return run


def new_ivf(dim: int, n: int, vectors: np.ndarray):
    """A trained, empty FAISS ``IndexIVFScalarQuantizer`` (8-bit codes, inner product) for ``n`` vectors:
    :func:`.ivf_lists.ivf_lists` lists, k-means on ``vectors[::step]`` (at most 64 points a list).

    :param vectors: float32[n, D], or already the sample (then ``n`` is the size it was drawn from and the stride is
        applied only when it still holds more than 64 a list).
    """
    faiss = _faiss()
    nlist = ivf_lists(n)
    quantizer = faiss.IndexFlatIP(dim)
    idx = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    step = max(1, vectors.shape[0] // (64 * nlist))
    idx.train(np.ascontiguousarray(vectors[::step], dtype=np.float32))
    return idx


def train_sample(vectors: np.ndarray) -> np.ndarray:
    """float32[~64 x lists, D], a copy: what :func:`new_ivf` trains on for ``vectors`` (float32[n, D]), the same rows."""
    step = max(1, vectors.shape[0] // (64 * ivf_lists(vectors.shape[0])))
    return np.array(vectors[::step], dtype=np.float32, order="C", copy=True)  # (step 1: not a view of the shard's copy)


class IvfBuild(ThreadBuild):
    """One background retraining (module docstring).

    :param dim: D. :param slots: int64[n], the live slots at the trigger, in row order (new ANN ids 0..n-1).
    :param sample: float32[m, D], the k-means sample (:func:`train_sample` of the trigger's live vectors).
    :param source: ``(gather, live_slots)``, called on the build's thread, each reading the shard's current copy
        consistently (the dense index's lock): ``gather(slots int64[M]) -> (live bool[M], float32[live.sum(), D])``,
        ``live_slots() -> int64[m]`` (a copy).
    """

    def __init__(self, dim: int, slots: np.ndarray, sample: np.ndarray,
                 source: tuple[Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], Callable[[], np.ndarray]]) -> None:
        super().__init__()
        self.dim, self.slots, self._sample = int(dim), np.array(slots, dtype=np.int64), sample
        self.trained_at = int(self.slots.size)
        self.added = np.zeros(self.trained_at, dtype=bool)  # ids encoded into the new lists
        self.index = None  # set once trained and filled
        self._gather, self._live_slots = source
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            idx = new_ivf(self.dim, self.trained_at, self._sample)
            self._sample = None
            self._fill(idx, 0)
            while True:  # then what was written meanwhile, while that is much
                known = self.slots.size
                now = self._live_slots()
                new = now[~np.isin(now, self.slots)]
                if new.size < FILL_BLOCK or self.cancelled:
                    break
                self.slots = np.concatenate([self.slots, new])
                self.added = np.concatenate([self.added, np.zeros(new.size, dtype=bool)])
                self._fill(idx, known)
            self.index = idx if not self.cancelled else None
        except BaseException as exc:  # noqa: BLE001 - reported by finish(): the install retrains in the write
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def _fill(self, idx, start: int) -> None:
        """Encode the still-live ``slots[start:]`` into ``idx`` (ids = their positions), a locked read a block."""
        for a in range(start, self.slots.size, FILL_BLOCK):
            if self.cancelled:
                return
            live, vecs = self._gather(self.slots[a:a + FILL_BLOCK])
            ids = np.flatnonzero(live).astype(np.int64) + a
            if ids.size:
                idx.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
                self.added[ids] = True

    def nbytes(self) -> int:
        """Bytes of the lists filled so far (code + 8-byte id a vector) and the centroids."""
        return int(self.added.sum()) * (self.dim + 8) + ivf_lists(self.trained_at) * 4 * self.dim


def finish(build: IvfBuild, live_slots: np.ndarray, live_vectors: np.ndarray):
    """(The shard's thread) wait for ``build`` and make its structure hold exactly the live vectors.

    :param live_slots: int64[m], the shard's live slots now (row order). :param live_vectors: float32[m, D], theirs.
    :returns: ``(index, ann_slot int64[A], dead)``, ids of removed chunks ``-1`` in ``ann_slot``; None when the build
        failed or was cancelled (the caller retrains synchronously).
    """
    build.thread.join()
    if build.index is None:
        return None
    idx, live_slots = build.index, np.asarray(live_slots, dtype=np.int64)
    keep = build.added & np.isin(build.slots, live_slots)  # (slots are never reused: a live one kept its vector)
    gone = np.flatnonzero(build.added & ~keep).astype(np.int64)
    if gone.size:
        idx.remove_ids(_faiss().IDSelectorBatch(gone))
    ann_slot = np.where(keep, build.slots, -1)
    new = np.flatnonzero(~np.isin(live_slots, ann_slot[keep]))  # written since the trigger (or missed: none)
    if new.size:
        ids = np.arange(ann_slot.size, ann_slot.size + new.size, dtype=np.int64)
        idx.add_with_ids(np.ascontiguousarray(live_vectors[new], dtype=np.float32), ids)
        ann_slot = np.concatenate([ann_slot, live_slots[new]])
    return idx, ann_slot, int((ann_slot < 0).sum())


class IvfBuilds:
    """The background half of :class:`.ann.AnnIndex`, IVF retraining and HNSW compaction (a mixin: it uses its
    ``_build``, ``_mut``, ``_index``, ``ann_slot``, ``dead``, ``trained_at``, ``trainings`` and ``rebuild``)."""

    @property
    def building(self) -> bool | None:
        """None: no IVF retraining or HNSW compaction under way; False: one is running; True: one is done, to
        :meth:`install` (IVF) / :meth:`install_graph` (HNSW)."""
        return None if self._build is None else self._build.done

    @property
    def build_thread(self):
        """The thread of the IVF retraining or HNSW compaction under way or done (``threading.Thread``), None: none."""
        return None if self._build is None else self._build.thread

    @property
    def retraining(self) -> int | None:
        """The vectors an IVF retraining under way or done trains on (its trigger's live chunks), None: none."""
        return self._build.trained_at if isinstance(self._build, IvfBuild) else None

    def compact_later(self, cause: str = GraphBuild.CROSSED) -> bool:
        """HNSW past a quarter dead: start a background compaction (:mod:`.hnsw_build`) unless one runs; False (none
        started) below :data:`.hnsw_build.BACKGROUND_MIN` live vectors, where the caller compacts at once. ``cause``:
        what its log line gives as its trigger."""
        if self._build is None and self.live < hnsw_build.BACKGROUND_MIN:
            return False
        if self._build is None:
            self._build = GraphBuild(self, cause)
        return True

    def install_graph(self) -> np.ndarray | None:
        """HNSW: put a background compaction's graph in place (:func:`.hnsw_build.finish_graph`: old ANN id int64[A]
        of each new id), None when none was under way or it failed (the caller compacts at once). Waits for the
        thread first, without the lock (its reads take it)."""
        b, self._build = self._build, None
        if b is None:
            return None
        b.thread.join()
        with self._mut:
            return finish_graph(self, b)

    @locked
    def install(self, slots: np.ndarray, vectors) -> bool:
        """Put a background retraining in place (waiting for its thread), made to hold exactly the live ``slots``
        int64[n] / ``vectors`` float32[n, D] (:func:`.ivf_build.finish`); a failed one retrains here instead.
        :returns: whether one was under way."""
        b, self._build = self._build, None
        if b is None:
            return False
        out = finish(b, slots, vectors)
        if out is None:  # failed: retrained the old way, which the shard's log line says
            self.rebuild(slots, vectors)
            if self.trainings:
                n, lists, secs, _ = self.trainings[-1]
                self.trainings[-1] = (n, lists, secs, f"the background retraining failed ({b.error!r}); the write waited")
            return True
        self._index, self.ann_slot, self.dead = out
        self.trained_at = b.trained_at
        self.trainings.append((b.trained_at, int(self._index.nlist), b.seconds,
                               f"in the background while the shard served, installed "
                               f"{time.perf_counter() - b.started:.1f} s after the write that crossed the size"))
        return True

    def cancel_build(self) -> None:
        """Drop a background retraining (a rebuild or a load replaces the structure it would replace)."""
        if self._build is not None:
            self._build.cancel()
            self._build = None
