"""A shard's snapshot written beside its request loop, so that queries keep being answered
while it is written (issue 13, snap14: at 1M chunks a snapshot takes 7-20 s, and a shard that
wrote it inside its one request loop left every query that reached it waiting that long).

The loop (:mod:`.worker`) starts a :class:`SnapshotJob` on :attr:`.protocol.Op.SNAPSHOT` and
calls :meth:`SnapshotJob.step` between requests until it returns the reply. Meanwhile it answers
the read ops (:data:`.state.READS`: they change nothing a snapshot reads) and holds every other
request, in order, until the reply is sent; it does no deferred HNSW insert and no idle BM25
merge either. The snapshot is therefore the one the shard would have written at the
request's place in its order, with nothing else to interleave with:

1. (the shard's thread, at the start) a pending HNSW structure settled, the BM25 delta's merge
   started in the background, unless the delta only holds chunks added after the segment's and
   none was removed (:func:`..index.bm25.delta_files.keeps`: it is then written beside the segment,
   and a 1M shard skips a 0.7-3.0 s merge that held its writes);
2. (the shard's thread, between requests) an IVF retraining under way installed once its thread is done
   (``ivf_done``: the snapshot holds the new lists, as a run that no restart cut would serve; with the old
   lists saved, the first write after a restart retrained on the vectors live then: trial58b #2); the merge
   installed once its thread is done; then a
   writer thread starts on :func:`.snapshot.write_files`, which only reads the store and the
   memory records (Arrow, numpy, FAISS and file I/O leave the GIL for most of it) and does everything through the
   ``CURRENT`` switch, the log's reset and the publication to ``--storage-uri``;
3. (the shard's thread, once the writer is done) the stored fields adopted from the new file
   (:func:`.snapshot.adopt`), and the reply; the parts they replace are freed by a thread of
   their own (a 1M shard's previous mapping took 150-260 ms to unmap: snap15).

Thread shards (:mod:`.threaded`) run the same job: a helper thread steps it on the shard's thread
(:meth:`SnapshotJob.drive`) and waits for the merge and the writer in between (:meth:`SnapshotJob.blocker`),
while the transport answers reads and holds every other request; in-process shards
(:mod:`.inprocess`) step it on the event loop. Ray actors (:mod:`.ray_transport`) and a SHUTDOWN's
snapshot still write it in one go (:meth:`SnapshotJob.wait`).

Durability is that of :func:`.snapshot.write`, which this is: files, then ``CURRENT``, then the
log's reset; a crash before ``CURRENT`` switches leaves the previous snapshot live and the log
whole. A SNAPSHOT is answered only once all of it is done.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from ..index.bm25 import delta_files
from . import snapshot as snapshots
from .chunks import ChunkStore
from .memory import MemoryStore
from .protocol import SnapshotReply
from .storage import ShardStorage
from .txn import Transactions


def _drop(parts: list) -> None:
    """(A thread of its own) the stored fields' former parts freed, then the memory handed back."""
    parts.clear()
    snapshots.release_memory()


class ShardGone(Exception):
    """Raised by :meth:`SnapshotJob.drive`'s ``on_shard`` when the shard's thread has stopped."""


class SnapshotJob:
    """One snapshot of ``store``, ``memory`` and ``txns``' log under ``d`` (see the module
    docstring). Created, stepped and waited for on the shard's thread only.

    :param log: called with a line once the snapshot is written (times of its parts).
    :param on_written: called once the snapshot is written and adopted (not when it failed).
    """

    def __init__(self, d: Path, store: ChunkStore, memory: MemoryStore, txns: Transactions,
                 storage: ShardStorage | None = None, log: Callable[[str], None] | None = None,
                 on_written: Callable[[], None] | None = None, ivf_done: Callable[[], None] | None = None) -> None:
        self.d, self.store, self.memory, self.txns, self.storage, self.log = d, store, memory, txns, storage, log
        self.on_written, self.ivf_done = on_written, ivf_done
        self.t0 = time.perf_counter()
        dense = store.dense
        if getattr(dense, "_pending", None) is not None:  # (an HNSW structure a load left pending)
            dense.compact_ann()
        p = store.postings
        self._merges = 0  # background merges started by this job
        if not p.merging and not delta_files.keeps(p):  # (else the delta is written beside the segment)
            p.merge(background=True)  # (a merge already under way is waited for instead)
            self._merges = 1
        self._thread: threading.Thread | None = None
        self._out: tuple[Path, int] | None = None
        self._error: BaseException | None = None
        self.merge_s = self.write_s = 0.0
        self.loop_s = time.perf_counter() - self.t0  # time taken from the request loop (start and steps)
        self.start_s = self.loop_s  # of it: settling HNSW, starting the merge
        # of the steps before the writer starts: those that found the merge still running (their count and
        # time: GIL waits beside the merge's thread, mostly), and the longest step (the install's)
        self.polls, self.polls_s, self.longest_s = 0, 0.0, 0.0
        self.sync = False  # wait(): all of it in the caller's thread

    def _write(self) -> None:
        t = time.perf_counter()
        try:
            self._out = snapshots.write_files(self.d, self.store, self.memory, self.txns, self.storage)
        except BaseException as exc:  # noqa: BLE001 - raised by step() in the shard's thread
            self._error = exc
        self.write_s = time.perf_counter() - t

    def step(self) -> SnapshotReply | None:
        """Advance without waiting: the reply once the snapshot is written, else None.

        :raises Exception: what the merge or the write raised (the job is over then).
        """
        t, polls, merging = time.perf_counter(), self.polls, self._thread is None
        try:
            return self._step()
        finally:
            dt = time.perf_counter() - t
            self.loop_s += dt
            if self.polls != polls:
                self.polls_s += dt
            elif merging:
                self.longest_s = max(self.longest_s, dt)

    def _ivf_build(self) -> threading.Thread | None:
        """The thread of an IVF retraining this snapshot waits for (module docstring, step 2): none without
        ``ivf_done``, for HNSW (whose compaction a restart starts again itself) or while a prepared transaction
        waits for its apply (nothing is installed then)."""
        dense = self.store.dense
        if self.ivf_done is None or dense.one_copy or dense.ann_building is None or self.txns.prepared:
            return None
        return dense.ann.build_thread

    def _step(self) -> SnapshotReply | None:
        if self._thread is None:
            if (b := self._ivf_build()) is not None:
                if b.is_alive():
                    self.polls += 1
                    return None
                self.ivf_done()  # type: ignore[misc]
            p = self.store.postings
            if p.merging:
                if p._pending[0].is_alive():  # noqa: SLF001
                    self.polls += 1
                    return None
                p.poll_merge(raise_errors=False)  # install it (a failed one left its delta: merged below)
                if self._merges < 2 and not delta_files.keeps(p):  # (an idle merge was under way: fold what was
                    self._merges += 1                               # written meanwhile, unless written beside)
                    p.merge(background=True)
                    if p.merging:
                        return None
            if not delta_files.keeps(p):
                p.merge()  # a check when nothing is left to fold; in this thread what a failed merge left
            self.merge_s = time.perf_counter() - self.t0
            self._thread = threading.Thread(target=self._write, name="oprag-snapshot", daemon=True)
            self._thread.start()
            return None
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        assert self._out is not None
        snap, n = self._out
        t = time.perf_counter()
        old = snapshots.adopt(snap, self.store)
        # not a daemon: an exit waits for it. A daemon thread freeing the former Arrow mapping when the
        # interpreter finalises is ended inside Arrow's C++ destructor (pthread_exit as it takes the GIL
        # back after munmap): std::terminate, exit status 134 (a thread-shard server stopped right after
        # a snapshot; seen in a probe that exits after one)
        threading.Thread(target=_drop, args=(old,), name="oprag-snapshot-drop").start()
        del old  # (dropped there: the previous mapping's munmap leaves the GIL, not this thread's time)
        if self.on_written is not None:
            self.on_written()
        if self.log is not None:
            adopt_s = time.perf_counter() - t
            total, loop = time.perf_counter() - self.t0, self.loop_s + adopt_s
            self.log(f"snapshot written in {total:.2f} s (BM25 merge {self.merge_s:.2f} s, files {self.write_s:.2f} s"
                     + (")" if self.sync else f"; {loop * 1e3:.0f} ms of it on the request loop: start "
                        f"{self.start_s * 1e3:.0f}, merge install {(self.loop_s - self.start_s) * 1e3:.0f}, adopt "
                        f"{adopt_s * 1e3:.0f}; of the merge install: {self.polls} polls {self.polls_s * 1e3:.0f}, "
                        f"longest other step {self.longest_s * 1e3:.1f})"))
        return SnapshotReply(written=True, chunks=n)

    def blocker(self) -> threading.Thread | None:
        """(The shard's thread) the thread whose end the next :meth:`step` waits for: the BM25
        merge's, then the writer's; None when a step has work now."""
        if self._thread is not None:
            return self._thread if self._thread.is_alive() else None
        if (b := self._ivf_build()) is not None:
            return b if b.is_alive() else None
        p = self.store.postings
        pending = p._pending if p.merging else None  # noqa: SLF001
        return pending[0] if pending and pending[0].is_alive() else None

    def drive(self, on_shard: Callable[[Callable[[], object]], object]) -> SnapshotReply:
        """Finish from a helper thread for a shard served by an executor (thread shards,
        :mod:`.threaded`): every step runs on the shard's thread (``on_shard(fn)`` runs ``fn``
        there, between its requests, and returns what it returned, raising what it raised), and
        this thread waits for the merge's and the writer's ends in between. Should ``on_shard``
        raise :class:`ShardGone` (the shard's thread has stopped), the rest runs in this thread.

        :raises Exception: as :meth:`step`."""
        while True:
            try:
                out, t = on_shard(lambda: (self.step(), self.blocker()))
            except ShardGone:
                return self.wait()
            if out is not None:
                return out  # type: ignore[return-value]
            if t is not None:
                t.join()  # type: ignore[union-attr]
            else:
                time.sleep(0.001)

    def wait(self) -> SnapshotReply:
        """Finish in this thread (a merge under way is waited for): the reply. :raises Exception:
        as :meth:`step`."""
        self.sync = True
        self.store.postings.wait_merge()
        while True:
            out = self.step()
            if out is not None:
                return out
            if (t := self.blocker()) is not None:
                t.join()
