"""Everything one shard holds, composed from one object per concern: the chunk store and its
writes (:mod:`.chunks`), search (:mod:`.search`), memory records (:mod:`.memory`), two-phase
commit staging (:mod:`.txn`) and snapshots (:mod:`.snapshot`). A pure in-process object: the
shard process (:mod:`.worker`) and the in-process transport (:mod:`.inprocess`) both drive it
through :func:`op_table`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..index import low_seeds_state
from ..index.bm25 import wide_warm
from ..index.bm25.merge_gate import MergeGate
from . import snapshot as snapshots
from .chunks import ChunkStore
from .memory import MemoryStore
from .protocol import TYPES, Op, ShutdownReply, ShutdownRequest, SnapshotReply, StatsReply, StatsRequest, UnknownOp
from .search import Searcher
from .snapjob import SnapshotJob
from .storage import LocalCopyDamaged, ShardStorage
from .txn import Transactions


class ShardState:
    """One shard: ``store`` (chunks, dense index, postings), ``search``, ``memory``, ``txns``.

    :param data_dir: parent directory of the shard's snapshot and log (None = memory only).
    :param storage: a storage URI (``--storage-uri``) holding the snapshot and log as objects
        too (:mod:`.storage`); ``data_dir`` is then the local working copy.
    :raises ValueError: ``storage`` without ``data_dir``, or not a storage URI.
    """

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False, dense=None,
                 storage: str | None = None, who: str | None = None) -> None:
        if storage and data_dir is None:
            raise ValueError("a shard on object storage needs a local working directory (data_dir)")
        self.storage = ShardStorage(storage, shard_id) if storage else None
        self.shard_id = shard_id
        self.who = who or f"shard {shard_id}"  # its log lines' name: ``shard i replica r`` with --replicas (say)
        self.dim = dim
        self.data_dir = data_dir
        self._store_args = (dim, stem, dense)
        # one BM25 merge build at a time among the shards on this data directory (merge_gate)
        self.merge_gate = MergeGate.at(data_dir) if data_dir is not None else None
        self._fresh()
        self._quiet = (-1, 0.0)  # (store version, when idle_wait first saw it): the quiet time
        # (dense index changes installed between requests, the count a written snapshot holds): StatsReply.ann_unsaved
        self._ann_changes = [0, 0]
        self._logged = (False, 0, 0)  # (merging, merges, spills) at the last note

    def _fresh(self) -> None:
        """An empty ``store``, ``search``, ``memory`` and ``txns`` (a start loads into them)."""
        dim, stem, dense = self._store_args
        self.store = ChunkStore(dim, stem=stem, dense=dense)
        self.store.postings.gate = self.merge_gate
        self.search = Searcher(self.store)
        self.memory = MemoryStore()
        self.txns = Transactions(self.store)

    def stats(self, req: StatsRequest | None = None) -> StatsReply:
        """Counts; with ``req.lexical`` also the full BM25 statistics ``(N, total length, df)``
        (the whole vocabulary: only for rebuilding the frontend's corpus statistics)."""
        st, nbytes = self.store, self._nbytes()
        return StatsReply(shard=self.shard_id, documents=len(st.doc_slots), chunks=len(st.chunks),
                          memory_records=len(self.memory), applied_seq=st.applied_seq, nbytes=nbytes,
                          ann_pending=st.dense.pending + st.dense.rebuild_pending, merge_pending=st.postings.merge_pending(),
                          seeds_pending=low_seeds_state.pending(self.search._low, st.dense.ann),  # noqa: SLF001
                          segment_unsaved=st.postings.unsaved_nbytes(),
                          ann_unsaved=nbytes.get("ann", 0) if self._ann_changes[0] != self._ann_changes[1] else 0,
                          lexical=st.postings.full_stats() if req is not None and req.lexical else None)

    def _nbytes(self) -> dict[str, int]:
        """:meth:`.chunks.ChunkStore.nbytes`, with the dense-minimum search's int8 copy of the
        graph and its seeds (:meth:`..index.dense_low.LowSeeds.nbytes`) counted in ``ann``."""
        n = self.store.nbytes()
        n["ann"] = n.get("ann", 0) + self.search._low.nbytes()  # noqa: SLF001
        return n

    def _dir(self) -> Path:
        assert self.data_dir is not None
        d = self.data_dir / f"shard-{self.shard_id}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def snapshot(self, req: Any = None) -> SnapshotReply:
        """Write a snapshot (see :func:`.snapshot.write`) in this thread; nothing in a
        memory-only shard."""
        job = self.snapshot_begin()
        return SnapshotReply(written=False) if job is None else job.wait()

    def snapshot_begin(self) -> SnapshotJob | None:
        """Start a snapshot written beside the request loop (:class:`.snapjob.SnapshotJob`: the
        caller steps it between requests and answers only :data:`READS` meanwhile); None for a
        memory-only shard."""
        if self.data_dir is None:
            return None
        changes = self._ann_changes[0]  # (none is installed while the job runs: the loop steps it instead)
        return SnapshotJob(self._dir(), self.store, self.memory, self.txns, self.storage, log=self.note,
                           on_written=lambda: self._ann_changes.__setitem__(1, changes), ivf_done=self._ivf_done)

    def _ivf_done(self) -> None:
        """(A snapshot job) install the IVF retraining it waited for, logged (not counted as unsaved: it saves it)."""
        self.store.dense.install_ann()
        self.say_trainings()

    def load(self, committed: set[str] | None = None) -> int:
        """Load the snapshot and replay committed log records (see :func:`.snapshot.load`), each
        long step logged when it starts and ends (:meth:`say`).

        :returns: log records replayed. :raises RuntimeError: incompatible snapshot.
        """
        if self.data_dir is None:
            return 0
        def load() -> int:
            return snapshots.load(self._dir(), self.store, self.memory, self.txns, committed, self.storage, say=self.say)

        try:
            try:
                return load()
            except LocalCopyDamaged as exc:  # (the storage holds the snapshot: downloaded into a fresh shard)
                assert self.storage is not None
                return self.storage.load_again(exc, lambda: (self._fresh(), load())[1], self.say)
        finally:
            self.say_trainings("at start, before serving")  # (a conversion or a replay may train)

    def apply(self, req):
        """:attr:`Op.APPLY` (:meth:`.txn.Transactions.apply`), then :meth:`say_trainings`."""
        try:
            return self.txns.apply(req)
        finally:
            self.say_trainings()

    _announced = None  # the background IVF retraining whose start was logged (its thread)

    def say_trainings(self, when: str = "the write that crossed the size waited for it") -> None:
        """Log each IVF (re)training since the last call: its lists, vectors and time, and ``when`` (for one in the
        write; one in the background says so); and each HNSW compaction."""
        ann = self.store.dense.ann
        if ann is not None and ann.retraining is not None and ann.build_thread is not self._announced:
            self._announced = ann.build_thread  # (trial59 F4: only its end was logged)
            self.say(f"IVF retraining started in the background on {ann.retraining} vectors (the shard grew 8x since "
                     "its last training); the current lists serve until it is installed")
        for n, lists, secs, how in ann.trainings if ann is not None else ():
            what = "k-means on one core, then every vector re-added"
            self.say(f"IVF trained: {lists} lists on {n} vectors in {secs:.1f} s ({what}; {how or when})")
        for n, dropped, secs, how in ann.compactions if ann is not None else ():
            self.say(f"HNSW graph compacted: {n} live vectors in a new graph, {dropped} deleted ones dropped, in "
                     f"{secs:.1f} s ({how or 'the delete or replacement that crossed a quarter dead waited for it'})")
        if ann is not None:
            ann.trainings.clear()
            ann.compactions.clear()

    #: deferred HNSW inserts per background step: ~20 ms at efConstruction 80, M 32, D 384 on this machine's cores
    #: (a request that arrives meanwhile waits at most that long). FAISS's add costs about the same per vector from
    #: 16 a call to 192 (0.62-0.68 ms at 20K vectors, 0.90-1.1 ms at 50K; session 41), and 192 a step held a query
    #: up to 130-180 ms (60% of a shard's time during an ingest is these steps)
    BACKGROUND_STEP = 32

    def background_step(self) -> bool:
        """Do a little deferred work between requests, unless a prepared transaction waits for its apply (the commit
        is waiting for this shard: it comes first): insert the oldest :attr:`BACKGROUND_STEP` deferred HNSW vectors
        into the graph; once none wait, build one of a large segment's BM25 wide rows (:mod:`..index.bm25.wide_warm`,
        ~1-2 ms at 500K chunks).

        :returns: whether deferred work waits that a step may do now (:meth:`background_due`)."""
        if self.txns.prepared:
            return False
        if self.store.dense.pending > 0:
            self.store.dense.insert_pending(self.BACKGROUND_STEP)
        elif self._rows_due():
            wide_warm.step(self.store.postings)
        return self.background_due()

    def background_due(self) -> bool:
        """Whether :meth:`background_step` has work now: deferred HNSW inserts, or wide rows to build."""
        return not self.txns.prepared and (self.store.dense.pending > 0 or self._rows_due())

    def _rows_due(self) -> bool:
        """Wide rows to build, and no merge running or due (its new segment would need them again; a merge builds
        the rows its old segment had: :func:`..index.bm25.listed_top.successor`)."""
        p = self.store.postings
        return wide_warm.due(p) and not p.merging and not p.idle_merge_due()

    #: seconds without a write before an idle merge starts (a trickle of writes closer together
    #: than this merges at the write-time rule only, 1/MERGE_DIV); IDLE_SMALL_QUIET_S for a delta below
    #: 1/IDLE_DIV (``idle_merge_due(small=True)``: about when the periodic snapshot merged it before it
    #: wrote the delta beside the segment; an unmerged 3-6% delta costs a 1M shard's BM25 part 40-70%, settle11)
    IDLE_QUIET_S, IDLE_SMALL_QUIET_S = 5.0, 30.0
    #: how often the loop looks whether a background merge finished, to install it between requests
    MERGE_POLL_S = 0.05

    def idle_wait(self) -> float | None:
        """Seconds the shard loop may wait for a request before :meth:`idle_step` has work (0:
        now); None when there is none (also while deferred HNSW inserts wait: they go first, so
        the two do not compete for the CPU with the queries at once; and while a prepared
        transaction waits for its apply). A write (a new store version) restarts the quiet time."""
        built = None if self.txns.prepared else self.store.dense.ann_building
        if built:  # a background IVF retraining or HNSW compaction is done: installed between requests
            return 0.0
        if not self.txns.prepared and getattr(self.store.dense.ann, "seeds", None) is not None:
            return 0.0  # (a compaction's seeds: taken between requests)
        wait = self._merge_wait()
        for other in (self._seeds_wait(), self._layout_wait(), self._compact_wait()):
            if other is not None:
                wait = other if wait is None else min(wait, other)
        return wait if built is None else min(self.MERGE_POLL_S, self.MERGE_POLL_S if wait is None else wait)

    def _seeds_wait(self) -> float | None:
        """The dense minimum's seeds (:mod:`..index.low_seeds_state`): 0 when a thread made new ones (taken now) or
        the graph doubled and writes have been quiet for :attr:`IDLE_QUIET_S` (the thread started now: not during a
        bulk ingest, whose every doubling would rebuild them); the seconds until then; the poll interval while the
        thread runs; None when none is due, a prepared transaction waits or deferred HNSW inserts do (they go first)."""
        low, ann = self.search._low, self.store.dense.ann  # noqa: SLF001
        if self.txns.prepared or self.store.dense.pending or not low_seeds_state.pending(low, ann):
            return None
        if low_seeds_state.done(low):
            return 0.0
        return self._quiet_left() if low_seeds_state.due(low, ann) else self.MERGE_POLL_S

    def _layout_wait(self) -> float | None:
        """The HNSW graph's renumbering for locality (:mod:`..index.graph_layout`): the seconds until writes will have
        been quiet for :attr:`IDLE_QUIET_S` when it is due (0: now); None when not due or a prepared transaction
        waits."""
        if self.txns.prepared or not self.store.dense.layout_due(self.search._low):  # noqa: SLF001
            return None
        return self._quiet_left()

    def _compact_wait(self) -> float | None:
        """An HNSW compaction due with no delete to start it (:meth:`..index.dense.DenseIndex.compaction_due`: a graph
        loaded past a quarter dead): the seconds until writes will have been quiet for :attr:`IDLE_QUIET_S` (0:
        now); None when none is due, a prepared transaction waits or deferred HNSW inserts do (they go first)."""
        if self.txns.prepared or self.store.dense.pending or not self.store.dense.compaction_due():
            return None
        return self._quiet_left()

    def _quiet_left(self, quiet_s: float | None = None) -> float:
        """Seconds until writes will have been quiet for ``quiet_s`` (None: :attr:`IDLE_QUIET_S`; a write restarts
        the quiet time)."""
        now = time.monotonic()
        if self._quiet[0] != self.store.version:
            self._quiet = (self.store.version, now)
        return max(0.0, self._quiet[1] + (self.IDLE_QUIET_S if quiet_s is None else quiet_s) - now)

    def _merge_wait(self) -> float | None:
        p = self.store.postings
        if p.merging:
            return 0.0 if not p._pending[0].is_alive() else self.MERGE_POLL_S  # noqa: SLF001
        if self.store.dense.pending or self.txns.prepared:
            return None  # (the HNSW catch-up first, one at a time; a prepared transaction's apply first)
        quiet = self.IDLE_QUIET_S if p.idle_merge_due() else self.IDLE_SMALL_QUIET_S if p.idle_merge_due(True) else None
        return None if quiet is None else max(self._quiet_left(quiet), p.gate_retry_at - time.monotonic())

    def idle_step(self) -> None:
        """Idle maintenance: install a finished background merge; start one in the background
        (:meth:`..index.bm25.PostingsIndex.merge`) once no write came for :attr:`IDLE_QUIET_S`
        and :meth:`..index.bm25.PostingsIndex.idle_merge_due` (none while a prepared transaction
        waits for its apply). Queries and writes go on meanwhile, as during a write-time merge."""
        if self.install_finished():
            return
        p = self.store.postings
        if p.merging:
            p.poll_merge(raise_errors=False)
        elif self.idle_wait() == 0.0:
            p.merge(background=True)
        self.note()

    def install_finished(self) -> bool:
        """Put a finished background IVF retraining or HNSW compaction in place (:meth:`.dense.DenseIndex.install_ann`),
        or take the dense minimum's seeds a thread made (:func:`..index.low_seeds_state.adopt_done`); not while a
        prepared transaction waits for its apply: :returns: whether one was. Between requests only (a
        shard process's idle step; a Ray actor before each call, its snapshot being written in one call). Each one
        counts as an `ann` change no snapshot holds yet (:attr:`.protocol.StatsReply.ann_unsaved`: the frontend's
        snapshot loop saves it, and a restart does not compact or renumber the graph again)."""
        done = self._install_finished()
        self._ann_changes[0] += done
        return done

    def _install_finished(self) -> bool:
        if self.txns.prepared:
            return False
        low, ann = self.search._low, self.store.dense.ann  # noqa: SLF001
        if ann is not None and ann.seeds is not None:  # a compaction's seeds (installed here or in a write)
            self.search._low = low_seeds_state.take_built(low, ann)  # noqa: SLF001
            return True
        if self._layout_wait() == 0.0 and self.store.lay_out(low):  # (before new seeds: they would wait)
            self.say("HNSW graph renumbered for locality: %d vectors in %.2f s" % ann.layouts.pop())
            return True
        if low_seeds_state.adopt_done(low, ann) or (self._seeds_wait() == 0.0 and low_seeds_state.start_due(low, ann)):
            self.note()  # (logs the seeds' build)
            return True
        if self._compact_wait() == 0.0 and self.store.dense.compact_due():
            self.say_trainings()  # (logs one done here at once; a background one when installed)
            return True
        if not self.store.dense.ann_building:
            return False
        self.store.dense.install_ann()
        if self.store.dense.one_copy:  # (HNSW: the compaction's graph renumbered the rows; an IVF's keep theirs)
            self.store.rows_moved()
        self.say_trainings()
        return True

    def note(self, msg: str | None = None) -> None:
        """Log (stderr, the service log) ``msg`` and the merges that started or were installed
        since the last call, with a wall-clock timestamp (issue 13, settle11: what overlaps queries)."""
        p, (was, n, spills) = self.store.postings, self._logged
        lines = [msg] if msg else []
        if p.merges != n:
            lines.append(f"BM25 merge installed: build {p.last_merge_s:.2f} s, swap {p.last_swap_s * 1e3:.1f} ms, "
                         f"segment {p.segment.n_postings} postings, delta {p._delta.n}"  # noqa: SLF001
                         + (", served from a file map (.bm25-spill)" if p.spills != spills else ""))
        if p.merging and (not was or p.merges != n):
            lines.append(f"BM25 merge started: {p._frozen.n if p._frozen is not None else 0} delta postings into a "  # noqa: SLF001
                         f"segment of {p.segment.n_postings}")
        self._logged = (p.merging, p.merges, p.spills)
        low = self.search._low  # noqa: SLF001 - (HNSW dense-minimum seeds: trial40b's 1.7 s query said nothing)
        lines += [f"HNSW dense-minimum seeds restored from the snapshot for a graph of {a} vectors (deleted ones included)"
                  f" in {s:.2f} s (the graph's int8 copy made anew)" if how == "from the snapshot" else  # (trial51b F6)
                  f"HNSW dense-minimum seeds built for a graph of {a} vectors (deleted ones included) in {s:.2f} s ({how})"
                  for a, s, how in low.built]
        low.built.clear()
        for line in lines:
            self.say(line)

    def say(self, line: str, level: str = "INFO") -> None:
        """Write ``line`` to the service log (stderr: the shard process's is the server's) as
        ``<local time>,<ms> INFO shard <i>: <line>`` (``shard <i> replica <r>`` when its shard has several
        replicas: :attr:`who`, trial47b #1) (the frontend's lines are ``<local time>,<ms>
        <LEVEL> oprag: ...``; a shard line is INFO, or ``level`` WARNING for damage a start worked around, and a level
        lets log filters keep them)."""
        t = time.time()
        # one write of the whole line, newline included: print() writes the text and the newline
        # separately, and two shard processes sharing the server's stderr then interleaved their
        # lines ("...: 5 chunks2026-12-03 ... shard 1: ...", found by test_fix22a under load)
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))},{int(t * 1000) % 1000:03d} "
                         f"{level} {self.who}: {line}\n")
        sys.stderr.flush()

    def shutdown(self, req: ShutdownRequest) -> ShutdownReply:
        """Snapshot when asked; the run loop exits after replying (a background IVF retraining is dropped)."""
        if self.store.dense.ann is not None:
            self.store.dense.ann.cancel_build()
        return ShutdownReply(self.snapshot() if req.snapshot else None)


Handler = Callable[[Any], Any]

#: ops that change nothing a snapshot reads (or a snapshot's cut: a memory lookup): a shard answers
#: them while it writes a snapshot (:mod:`.snapjob`) and holds every other op until it is written
READS = frozenset({Op.SEARCH, Op.EXACT_MINMAX, Op.EXACT_LISTS, Op.FETCH, Op.FIELDS, Op.REUSE, Op.MEMORY_LOOKUP,
                   Op.STATS})


def op_table(state: ShardState) -> dict[Op, Handler]:
    """The handler of every :class:`Op` on ``state`` (each takes the op's request type)."""
    return {
        Op.SEARCH: state.search.search,
        Op.EXACT_MINMAX: state.search.exact_minmax,
        Op.EXACT_LISTS: state.search.exact_lists,
        Op.FETCH: state.search.fetch,
        Op.FIELDS: state.search.fields_later,
        Op.REUSE: state.store.reuse,
        Op.STAGE: state.txns.stage,
        Op.PREPARE: state.txns.prepare,
        Op.APPLY: state.apply,
        Op.ABORT: state.txns.abort,
        Op.PROMOTE: state.memory.promote,
        Op.MEMORY_LOOKUP: state.memory.lookup,
        Op.MEMORY_CLEAR: state.memory.clear,
        Op.STATS: state.stats,
        Op.SNAPSHOT: state.snapshot,
        Op.SHUTDOWN: state.shutdown,
    }


def dispatch(table: dict[Op, Handler], op: Any, req: Any) -> Any:
    """Run ``op`` on ``req``.

    :raises UnknownOp: ``op`` is not an :class:`Op` this table serves, or ``req`` is not the
        op's request type.
    """
    handler = table.get(op) if isinstance(op, Op) else None
    if handler is None:
        raise UnknownOp(f"unknown shard op {op!r}: a shard serves {', '.join(o.value for o in table)}")
    want = TYPES[op][0]
    if type(req) is not want:
        raise UnknownOp(f"shard op {op.value} takes a {want.__name__}, got {type(req).__name__}")
    return handler(req)
