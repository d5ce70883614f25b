"""Everything one shard holds, composed from one object per concern: the chunk store and its
writes (:mod:`.chunks`), search (:mod:`.search`), memory records (:mod:`.memory`), two-phase
commit staging (:mod:`.txn`) and snapshots (:mod:`.snapshot`). A pure in-process object: the
shard process (:mod:`.worker`) and the in-process transport (:mod:`.inprocess`) both drive it
through :func:`op_table`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import snapshot as snapshots
from .chunks import ChunkStore
from .memory import MemoryStore
from .protocol import TYPES, Op, ShutdownReply, ShutdownRequest, SnapshotReply, StatsReply, StatsRequest, UnknownOp
from .search import Searcher
from .storage import ShardStorage
from .txn import Transactions


class ShardState:
    """One shard: ``store`` (chunks, dense index, postings), ``search``, ``memory``, ``txns``.

    :param data_dir: parent directory of the shard's snapshot and log (None = memory only).
    :param storage: a storage URI (``--storage-uri``) holding the snapshot and log as objects
        too (:mod:`.storage`); ``data_dir`` is then the local working copy.
    :raises ValueError: ``storage`` without ``data_dir``, or not a storage URI.
    """

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False, dense=None,
                 storage: str | None = None) -> None:
        if storage and data_dir is None:
            raise ValueError("a shard on object storage needs a local working directory (data_dir)")
        self.storage = ShardStorage(storage, shard_id) if storage else None
        self.shard_id = shard_id
        self.dim = dim
        self.data_dir = data_dir
        self.store = ChunkStore(dim, stem=stem, dense=dense)
        self.search = Searcher(self.store)
        self.memory = MemoryStore()
        self.txns = Transactions(self.store)

    def stats(self, req: StatsRequest | None = None) -> StatsReply:
        """Counts; with ``req.lexical`` also the full BM25 statistics ``(N, total length, df)``
        (the whole vocabulary: only for rebuilding the frontend's corpus statistics)."""
        st = self.store
        return StatsReply(shard=self.shard_id, documents=len(st.doc_slots), chunks=len(st.chunks),
                          memory_records=len(self.memory), applied_seq=st.applied_seq, nbytes=self._nbytes(),
                          ann_pending=st.dense.pending,
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
        """Write a snapshot (see :func:`.snapshot.write`); nothing in a memory-only shard."""
        if self.data_dir is None:
            return SnapshotReply(written=False)
        return snapshots.write(self._dir(), self.store, self.memory, self.txns, self.storage)

    def load(self, committed: set[str] | None = None) -> int:
        """Load the snapshot and replay committed log records (see :func:`.snapshot.load`).

        :returns: log records replayed. :raises RuntimeError: incompatible snapshot.
        """
        if self.data_dir is None:
            return 0
        return snapshots.load(self._dir(), self.store, self.memory, self.txns, committed, self.storage)

    #: deferred HNSW inserts per background step: ~40-60 ms at efConstruction 80 (a request that
    #: arrives meanwhile waits at most that long; FAISS's add costs O(graph size) per call besides
    #: O(batch), so much smaller steps cost more per vector)
    BACKGROUND_STEP = 192

    def background_step(self) -> bool:
        """Do a little deferred work (insert the oldest :attr:`BACKGROUND_STEP` deferred HNSW
        vectors into the graph) between requests, unless a prepared transaction waits for its
        apply (the commit is waiting for this shard: it comes first).

        :returns: whether deferred work waits that a step may do now."""
        if self.txns.prepared:
            return False
        self.store.dense.insert_pending(self.BACKGROUND_STEP)
        return self.store.dense.pending > 0

    def shutdown(self, req: ShutdownRequest) -> ShutdownReply:
        """Snapshot when asked; the run loop exits after replying."""
        return ShutdownReply(self.snapshot() if req.snapshot else None)


Handler = Callable[[Any], Any]


def op_table(state: ShardState) -> dict[Op, Handler]:
    """The handler of every :class:`Op` on ``state`` (each takes the op's request type)."""
    return {
        Op.SEARCH: state.search.search,
        Op.EXACT_MINMAX: state.search.exact_minmax,
        Op.EXACT_LISTS: state.search.exact_lists,
        Op.FETCH: state.search.fetch,
        Op.REUSE: state.store.reuse,
        Op.STAGE: state.txns.stage,
        Op.PREPARE: state.txns.prepare,
        Op.APPLY: state.txns.apply,
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
