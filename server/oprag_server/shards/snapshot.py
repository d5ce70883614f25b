"""Snapshots of one shard and loading them back.

Layout under ``<data_dir>/shard-<i>/``: ``snap-<applied_seq>-<ns>/{chunks.arrow, memory.json,
memory_vectors.npy, meta.json}`` (the memory records' vectors in binary; a snapshot without the file has them in
``memory.json``; both files' CRC-32s in ``meta.json``: :mod:`.memory_files`) (plus ``dense.faiss`` and ``dense.npz`` for an HNSW or IVF dense index: the
structure as FAISS serialised it and its id map, loaded on start instead of rebuilt), a ``CURRENT`` file naming the live snapshot, and ``wal.log`` (the shard's
write-ahead log). Format 2 adds ``postings/`` (the BM25 segment as ``.npy`` arrays and
``terms.json``, :meth:`PostingsIndex.save`), memory-mapped on load instead of re-analysing
every chunk's text; a format-1 snapshot, or one whose analyzer settings differ, is loaded by
re-analysing the texts (and written anew by the next snapshot). Format 3: with HNSW the vectors
are saved once, in ``dense.faiss`` (the graph's own storage), and ``chunks.arrow`` has no
``vector`` column; a shard of another index kind reads them out of that file. Format 4 (only
when the shard has some): ``dense_tail.npy``, the HNSW vectors acknowledged but not inserted into
the graph yet (deferred inserts, :mod:`..index.ann`), loaded back as such. Format 5: with HNSW, ``dense.faiss`` is
the graph alone and the vectors are in ``dense.faiss.v<start>.npy`` parts listed by ``dense.faiss.vectors.json``,
which later snapshots link while they hold the same rows (:mod:`..index.ann_vectors`). With HNSW,
``dense_seeds.npz`` (when the shard has built them): the dense minimum's seeds, restored at start
(:mod:`..index.low_seeds_state`; optional, an older snapshot's shard builds them anew). Every file is written
atomically (temporary file, fsync, rename, fsync of the directory); ``CURRENT`` switches last, so a crash leaves
the previous snapshot live.
``chunks.arrow`` is an Arrow IPC stream of record batches of at most
:data:`.chunks.BATCH_ROWS` rows (one batch before snap18: every format reads both); format 5 may follow it with
``chunks.<start>.arrow`` files, listed in ``meta.json``'s ``chunk_files``, and links the previous snapshot's files
while the stored fields begin with their rows (:mod:`.chunk_files`); so are the BM25 segment's arrays
(:meth:`..index.bm25.segment.Segment.save`) and ``dense.faiss`` when the structure did not change since it was
written or loaded (:meth:`..index.ann_persist.AnnPersist.write`).
With ``--storage-uri`` every log record and snapshot is also on object storage (:mod:`.storage`).
"""

from __future__ import annotations

import io
import json
import mmap
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import records
from ..index import ann_vectors, low_seeds_state
from ..index.bm25 import PostingsIndex, crc_files
from ..index.low_seeds_state import NPZ_ERRORS
from ..index.objstore import MirroredLog
from ..index.wal import WriteAheadLog, fsync_write
from ..index.wal import _fsync_dir as _fsync_file  # (any path: file or directory)
from . import chunk_files, memory_files
from .chunks import ChunkStore
from .memory import MemoryStore
from .protocol import SnapshotReply
from .snapshot_current import current, meta_crc, read_meta, warn, write_meta  # noqa: F401 - meta_crc: re-exported
from .storage import ShardStorage, local_copy
from .txn import Transactions

FORMAT_VERSION = 3
#: formats :func:`load` reads (3: with HNSW, ``chunks.arrow`` has no ``vector`` column, the
#: vectors are in ``dense.faiss`` only; 4: format 3 plus ``dense_tail.npy``, the HNSW vectors
#: acknowledged but not inserted into the graph yet, written only when there are some; 5: with HNSW,
#: ``dense.faiss`` holds the graph only and the vectors are in parts beside it, :mod:`..index.ann_vectors`, and/or
#: the stored fields are in several files with CRC-32s, ``meta.json``'s ``chunk_files``, :mod:`.chunk_files`)
READABLE_FORMATS = (1, 2, 3, 4, 5)


def write(d: Path, store: ChunkStore, memory: MemoryStore, txns: Transactions,
          storage: ShardStorage | None = None) -> SnapshotReply:
    """Write chunks (with vectors) and memory into a new snapshot directory under ``d``, switch
    ``CURRENT`` to it, then drop older snapshots and the log records the snapshot now covers
    (records of transactions still in flight stay). With ``storage`` the snapshot is then
    published there (:meth:`.storage.ShardStorage.publish`) before this returns. In the caller's
    thread from start to end (:class:`.snapjob.SnapshotJob` writes beside the shard's loop)."""
    from .snapjob import SnapshotJob  # noqa: PLC0415

    return SnapshotJob(d, store, memory, txns, storage).wait()


def write_files(d: Path, store: ChunkStore, memory: MemoryStore, txns: Transactions,
                storage: ShardStorage | None = None) -> tuple[Path, int]:
    """The files of :func:`write`, from ``CURRENT``'s switch to the log's reset and the
    publication: ``(snapshot directory, chunks)``. Reads the store and the memory records
    only (any thread, while nothing writes to them and the BM25 postings are merged:
    :meth:`.snapjob.SnapshotJob.step`)."""
    snap = d / f"snap-{store.applied_seq:012d}-{time.time_ns()}"
    snap.mkdir()
    try:
        rows = _write_snapshot_files(snap, store, memory)
    except BaseException:  # (a full disk): no half-written directory left behind, every failed try
        shutil.rmtree(snap, ignore_errors=True)
        raise
    fsync_write(d / "CURRENT", snap.name.encode())
    sweep(d, snap.name)
    if txns.wal is not None:
        txns.wal.reset(txns.in_flight())
    if storage is not None and isinstance(txns.wal, MirroredLog):
        storage.publish(snap, txns.wal)
    return snap, rows


def sweep(d: Path, keep: str | None) -> None:
    """Remove the ``snap-*`` directories under ``d`` other than ``keep`` (the live one): older
    snapshots, and one a crash or a failed write left before ``CURRENT`` named it; and a damaged local copy that a
    crash left set aside while the storage's copy was downloaded (:meth:`.storage.ShardStorage.load_again`)."""
    for old in [*d.glob("snap-*"), *d.glob("damaged-snap-*")]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def _write_snapshot_files(snap: Path, store: ChunkStore, memory: MemoryStore) -> int:
    """Every file of snapshot directory ``snap`` (fsync'ed), ``meta.json`` last. :returns: chunks."""
    one = store.dense.one_copy  # HNSW: the vectors are saved once, in dense.faiss
    # record batches of <= BATCH_ROWS rows, each built, streamed to the file and dropped (issue 13: one batch of every
    # row was a ~0.85 GB copy per 1M-chunk shard, at the snapshot's memory peak); the last snapshot's files linked
    files = chunk_files.write(snap, store, vectors=not one)
    rows = [sum(f[1] for f in files)]
    memory_crc = memory_files.write(snap, memory)  # (the records' vectors beside memory.json, in binary)
    tail_crc = None
    for p in store.postings.save(snap / "postings", merge=False):  # (merged by the caller: SnapshotJob)
        _fsync_file(p)
    _fsync_file(snap / "postings")
    if store.dense.ann_state(with_bytes=False) is not None:
        for p in store.dense.write_ann(snap / "dense.faiss"):  # written by FAISS, no serialised copy in memory
            _fsync_file(p)
        tail = store.dense.deferred_vectors()  # (ANN ids after the graph's; still deferred on load)
        if tail.shape[0]:  # (their only copy, CRC'd in meta.json: trial58b #1 served flipped ones)
            tail_crc = memory_files.save_npy(snap / "dense_tail.npy", tail)
        ann = store.dense.ann_state(with_bytes=False)
        buf = io.BytesIO()  # (the batch holds the chunks in slot order)
        np.savez(buf, ann_slot=ann["ann_slot"], live_slots=store.fields.slots(), trained_at=ann["trained_at"],
                 kind=ann["kind"], laid_at=ann["laid_at"], tail_groups=store.dense.deferred_groups())
        fsync_write(snap / "dense.npz", buf.getvalue())
        if (seeds := low_seeds_state.encode(store.dense.ann)) is not None:  # HNSW: the dense minimum's seeds
            fsync_write(snap / low_seeds_state.NAME, seeds)
    parts = ann_vectors.sidecar(snap / "dense.faiss").exists() or len(files) > 1  # (format 5: files in parts)
    meta = {"format_version": 5 if parts else 4 if (snap / "dense_tail.npy").exists() else FORMAT_VERSION,
            "applied_seq": store.applied_seq, "dim": store.dim, "next_slot": store.next_slot, "chunks": rows[0],
            "chunk_files": files, "analyzer": {"stem": store.analyzer.stem}, "postings_crc": True,
            "memory_crc": memory_crc, **({"tail_crc": tail_crc} if tail_crc is not None else {})}
    write_meta(snap, meta)
    return rows[0]


def _mapped(store: ChunkStore, files: list, table, maps: list) -> None:
    """Tell the stored fields they now serve ``files`` (``[(path, rows, crc32)]``, mapped as ``maps``, as ``table``),
    reusable by the next snapshot when the files' columns are the ones this store writes (:mod:`.chunk_files`)."""
    want = records.chunk_schema(store.dim)
    if store.dense.one_copy:
        want = want.remove(want.get_field_index("vector"))
    store.fields.mapped(files, maps, table.schema.equals(want) and table.num_rows == len(store.fields))


def adopt(snap: Path, store: ChunkStore) -> list:
    """Serve the stored fields and the BM25 segment from the snapshot just written
    (memory-mapped: :meth:`..index.bm25.PostingsIndex.adopt_files`), on the shard's thread
    (fetches and queries read them).

    :returns: the parts served so far (the batches since the last snapshot, the previous
        snapshot's mapping), for the caller to drop, then :func:`release_memory` (dropping a 1M
        shard's previous mapping took 150-260 ms, its munmap without the GIL: snap15)."""
    old = store.fields._parts  # noqa: SLF001 - adopt replaces the list: the old one is only ours then
    table, maps, files = chunk_files.map_all(chunk_files.listed(snap, json.loads((snap / "meta.json").read_text())))
    store.fields.adopt(table, store.fields.slots())
    _mapped(store, files, table, maps)
    for m in maps:
        m.madvise(mmap.MADV_DONTNEED)
    # the BM25 segment too, from the postings just written (its anonymous copy: ~700 MB resident
    # per 1M-chunk shard, as a restart's map holds only the pages read; issue 13, mem17)
    old.extend(store.postings.adopt_files(snap / "postings"))
    return old


def release_memory() -> None:
    """Hand memory the allocators keep after a snapshot back to the OS: Arrow's pool
    (``release_unused``) and glibc's heap (``malloc_trim``, where there is one). In process, 20K
    chunks: RSS after ingest and a snapshot 11.8 -> 7.4 KB per chunk (issue 13)."""
    import ctypes  # noqa: PLC0415

    import pyarrow as pa  # noqa: PLC0415

    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


#: a line for the service log (:meth:`.state.ShardState.say`), or None: nothing is logged
Say = Callable[[str], None] | None


class _Step:
    """A long start-up step: ``say(start)`` now (when ``loud``), ``say("<end> in <s> s")`` at :meth:`done`."""

    def __init__(self, say: Say, start: str, loud: bool = True) -> None:
        self.say = say if loud else None
        self.t = time.perf_counter()
        if self.say is not None:
            self.say(start)

    def done(self, end: str) -> None:
        if self.say is not None:
            self.say(f"{end} in {time.perf_counter() - self.t:.1f} s")


def _load_ann(snap: Path, snap_meta: dict, store: ChunkStore, say: Say = None) -> None:
    """Adopt the snapshot's approximate dense structure, or build one from the vectors (no
    such file, another index kind, unreadable): a conversion, logged with ``say`` before and
    after (it takes minutes for 10^4-10^5 HNSW rows). Slots were renumbered by the load: the snapshot
    held its live chunks in slot order, and they now hold slots 0..n-1 in that order. ``snap_meta``: its
    ``meta.json``, as :func:`load` read it."""
    f, m = snap / "dense.faiss", snap / "dense.npz"
    if store.dense.ann_state(with_bytes=False) is None:  # flat now: a saved structure is not used (trial38 #6)
        was = "flat"
        if say is not None and m.exists():
            try:
                with np.load(m) as meta:  # (closed at once: only its kind is read)
                    was = str(meta["kind"])
            except NPZ_ERRORS:
                pass
        if was != "flat":
            say(f"the snapshot's {was} search structure is not used: --dense-index flat scans every vector (the next snapshot drops it)")
        return
    was, failed = "flat", None  # (what a snapshot without the structure's files held)
    if m.exists():
        try:
            try:
                meta = np.load(m)
                was = str(meta["kind"])
            except NPZ_ERRORS as exc:
                raise ValueError(f"{m.name} cannot be read ({type(exc).__name__}: {exc})") from exc
            if not f.exists():  # (an IVF's lists rebuild from the chunks' vectors; HNSW's vectors were only there)
                raise FileNotFoundError(f"{f} is missing")
            live = np.asarray(meta["live_slots"], dtype=np.int64)
            now = np.sort(store.dense.slots)
            if live.size == now.size:
                def remap(old: np.ndarray) -> np.ndarray:
                    if not live.size:
                        return np.full(old.shape, -1, np.int64)
                    pos = np.clip(np.searchsorted(live, old), 0, live.size - 1)
                    return np.where((old >= 0) & (live[pos] == old), now[pos], -1)

                state = {"kind": str(meta["kind"]), "faiss": f, "ann_slot": meta["ann_slot"],
                         "trained_at": int(meta["trained_at"]), "tail": _tail(snap, snap_meta),
                         "laid_at": int(meta["laid_at"]) if "laid_at" in meta.files else 0,
                         "tail_groups": meta["tail_groups"] if "tail_groups" in meta.files else None}
                if store.dense.load_ann(state, remap):
                    if not (a := store.dense.ann).ready and a.live >= a.train_min:  # --ivf-train-min lowered (trial58
                        store.dense.compact_ann()  # #2): trained now, not at the next write (logged as a training)
                    seeds = snap / low_seeds_state.NAME
                    if not low_seeds_state.stash(store.dense.ann, seeds) and seeds.exists():
                        warn(say, f"{seeds} cannot be read: the dense minimum's seeds are built anew (HYBRID's fused "
                                  "scores may move slightly from those before the restart)")
                    return _built_with(store, say)
        except (*NPZ_ERRORS, RuntimeError) as exc:  # rebuilt below, from the chunks' vectors
            failed = exc
            only = snap_meta.get("format_version", 1) >= 3  # (format 3: only there)
            if was == "hnsw" and store.dense.one_copy and only:  # (nothing to rebuild from: trial54 #2)
                raise RuntimeError(f"{snap}: the HNSW structure, the only copy of the chunks' vectors, cannot be "
                                   f"loaded: {exc}; restore the snapshot directory from a backup (README: "
                                   "Durability)") from None
    kind, n = store.dense.params.kind, int(store.dense.slots.size)
    why = f"the snapshot's index is {was}" if was != kind else f"the snapshot's {kind} structure cannot be used"
    step = _Step(say, f"converting the dense index to {kind}: {n} rows ({why})", n > 0)
    try:
        store.dense.compact_ann()
    except RuntimeError as exc:  # (no vectors but the structure's: what stopped its load is the cause)
        if failed is None:
            raise
        raise RuntimeError(f"{snap}: the dense structure, the only copy of the chunks' vectors, cannot be loaded: "
                           f"{failed}; restore the snapshot directory from a backup (README: Durability)") from exc
    step.done(f"converted the dense index to {kind}: {n} rows")


def _built_with(store: ChunkStore, say: Say) -> None:
    """Say so when the adopted HNSW graph was built with other ``--hnsw-m`` / ``--ef-construction``
    than this start's (trial36: a restart with new values silently kept the old graph)."""
    ix = getattr(store.dense.ann, "_index", None)
    p = store.dense.params
    if say is None or p.kind != "hnsw" or not hasattr(ix, "hnsw"):
        return
    m, efc = int(ix.hnsw.nb_neighbors(1)), int(ix.hnsw.efConstruction)
    if (m, efc) != (p.hnsw_m, p.ef_construction):
        say(f"WARNING: the saved HNSW graph was built with --hnsw-m {m} --ef-construction {efc}, not {p.hnsw_m} / "
            f"{p.ef_construction}: it is kept (new chunks join it with its own M) until a compaction rebuilds it; to "
            "rebuild it now, start once with --dense-index flat, then again with hnsw")


def _tail(snap: Path, meta: dict) -> np.ndarray | None:
    """The snapshot's deferred HNSW vectors float32[P, D] (``dense_tail.npy``, memory-mapped), or None; checked
    against ``meta``'s (``meta.json``'s) ``tail_crc`` when it has one."""
    p = snap / "dense_tail.npy"
    if not p.exists():
        return None
    if (want := meta.get("tail_crc")) is not None and (got := crc_files.crc_of(p)) != want:
        raise ValueError(f"{p}: its CRC-32 is {got}, not the {want} meta.json records: the HNSW vectors not yet in the "
                         "graph were damaged after they were written")
    return np.load(p, mmap_mode="r")


def _with_vectors(snap: Path, meta: dict, table, dim: int):
    """``table`` (the snapshot's chunks in slot order, without vectors) with its ``vector``
    column read out of the HNSW structure file, the only place such a snapshot keeps them.

    :raises RuntimeError: the structure file is missing or does not hold every chunk.
    """
    import pyarrow as pa  # noqa: PLC0415

    from ..index.ann_read import read_vectors  # noqa: PLC0415

    try:
        m = np.load(snap / "dense.npz")
        vecs = read_vectors(snap / "dense.faiss", m["ann_slot"], np.asarray(m["live_slots"], dtype=np.int64),
                            _tail(snap, meta))
    except (*NPZ_ERRORS, RuntimeError) as exc:
        raise RuntimeError(f"{snap}: the chunks' vectors are in dense.faiss (and the parts beside it), which cannot be "
                           f"read: {exc}") from exc
    col = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(vecs, np.float32).reshape(-1)), dim)
    return table.append_column(pa.field("vector", pa.list_(pa.float32(), dim)), col)


def _load_postings(snap: Path, meta: dict, store: ChunkStore, rows: int, say: Say = None) -> PostingsIndex | None:
    """The snapshot's BM25 postings, memory-mapped, when it has them for this analyzer and they
    cover its ``rows`` chunks; None otherwise (the caller re-analyses the texts; ``say`` is told why
    when its files cannot be read or do not fit together)."""
    if meta.get("analyzer") != {"stem": store.analyzer.stem}:
        return None
    try:
        if meta.get("postings_crc") and not (snap / "postings" / crc_files.NAME).exists():
            raise OSError(f"{snap / 'postings' / crc_files.NAME} is missing (the snapshot wrote one)")
        ix = PostingsIndex.load(snap / "postings", mmap=True)
        why = None if len(ix) == rows else f"they hold {len(ix)} chunks"
    except (OSError, ValueError) as exc:
        why = str(exc)
    if why is not None and rows:
        warn(say, f"the BM25 postings of {snap.name} cannot be used ({why}): the {rows} stored texts are analysed again")
    return None if why is not None else ix


def load(d: Path, store: ChunkStore, memory: MemoryStore, txns: Transactions, committed: set[str] | None,
         storage: ShardStorage | None = None, say: Say = None) -> int:
    """Load the current snapshot under ``d`` if any, then replay the write-ahead log: memory
    records in log order (:meth:`.memory.MemoryStore.replay`) and records of committed transactions (``committed`` txn ids, from the frontend's commit log) with a
    sequence number above the snapshot's are applied in order; others are ignored.

    :returns: number of log records replayed (transactions and memory records).
    With ``storage``, ``d`` is first brought to the storage's current snapshot and log
    (:meth:`.storage.ShardStorage.open_log`; a new node's empty directory downloads them).

    ``say`` (a line for the service log) is told when each long step starts and ends, with its
    size and time: the snapshot's load, a dense index conversion (:func:`_load_ann`), the log's replay.

    :raises RuntimeError: the snapshot's format version or vector width differ.
    :raises LocalCopyDamaged: with ``storage``, the local copy of its snapshot cannot be loaded.
    """
    wal = storage.open_log(d, say=say) if storage is not None else WriteAheadLog(d / "wal.log")
    wal.warn = lambda line: warn(say, line)  # (a shard's WARNING line: trial56b F3)
    snap = current(d, say)
    if snap is not None:  # (a snapshot written directly into the shard directory: first layout)
        with local_copy(storage, snap):  # (damaged: the storage's copy is downloaded, ShardStorage.load_again)
            meta = read_meta(snap)
        if meta.get("format_version") not in READABLE_FORMATS:
            raise RuntimeError(f"{snap}: snapshot format {meta.get('format_version')} is not one of {READABLE_FORMATS}")
        if meta.get("dim") != store.dim:
            raise RuntimeError(f"{snap}: vectors have width {meta.get('dim')}, the embedder produces {store.dim}")
        with local_copy(storage, snap):
            table, maps, files = chunk_files.map_all(chunk_files.listed(snap, meta), verify=True)
            loading = _Step(say, f"loading snapshot {snap.name}: {table.num_rows} chunks")
            file = table  # (as read: without the vectors _with_vectors adds)
            if "vector" not in table.column_names and not store.dense.one_copy:
                step = _Step(say, f"reading {table.num_rows} vectors out of the snapshot's hnsw index (the dense index "
                                  f"is now {store.dense.params.kind})", table.num_rows > 0)
                table = _with_vectors(snap, meta, table, store.dim)  # written with HNSW, read by another kind
                step.done(f"read {table.num_rows} vectors out of the snapshot's hnsw index")
            postings = _load_postings(snap, meta, store, table.num_rows, say)
            if table.num_rows:
                store.upsert(table, 0, index_ann=False, index_lexical=postings is None, copy_fields=False)
                _mapped(store, files, file, maps)
            for m in maps:  # what the load read (vectors copied out, ids) leaves RSS
                m.madvise(mmap.MADV_DONTNEED)
            if postings is not None:
                postings.gate = store.postings.gate  # (the merge gate the shard gave the index it replaces)
                store.postings = postings
            _load_ann(snap, meta, store, say)
            store.applied_seq = int(meta.get("applied_seq", 0))
            store.next_slot = max(store.next_slot, int(meta.get("next_slot", 0)))
            memory_files.load(snap, meta, memory)
            loading.done(f"snapshot {snap.name} loaded: {table.num_rows} chunks")
    if storage is not None:
        storage.seed()  # (an empty prefix: seeded from the local directory once its snapshot has loaded)
    size = wal.path.stat().st_size if wal.path.exists() else 0
    replaying = _Step(say, f"replaying the write-ahead log: {size} bytes", size > 0)
    replayed = txns.replay(wal, committed)
    replayed += memory.replay(wal)
    replaying.done(f"write-ahead log replayed: {replayed} records applied")
    # what a failed or cut-off snapshot left, once this one has loaded (a refused start removes nothing: trial55b)
    sweep(d, snap.name if snap is not None and snap != d else None)
    store.postings.drain_delta()
    release_memory()  # what the load's temporaries left in the allocators (a file of several batches
    return replayed   # has its vector column combined once for a flat index's copy)
