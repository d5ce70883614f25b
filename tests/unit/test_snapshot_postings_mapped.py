"""A shard that wrote a snapshot serves its BM25 segment from the snapshot's ``postings/*.npy``,
memory-mapped, as a shard that loaded that snapshot does (issue 13, mem17): before, a shard that
had ingested kept the segment it merged in anonymous memory after writing the same arrays to the
snapshot, every posting resident (a 1M-chunk shard: ~700 MB, where a query pass reads ~15% of
the map), so the served RSS of a server depended on whether it had been restarted since its
ingest. Replies stay bit-identical; a segment whose files were renumbered (deletes) is kept."""

from __future__ import annotations

import mmap
import pickle

import numpy as np
import pyarrow as pa

from oprag_server.index.bm25.segment import _ARRAYS
from oprag_server.shards.protocol import ExactMinmaxRequest, QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

from test_snapshot_beside import D, _batch


def _mapped_from(a: np.ndarray) -> str | None:
    """The file ``a`` is a read-only map of (a ``np.memmap`` in its base chain), else None."""
    b = a
    while b is not None:
        if isinstance(b, np.memmap):
            return str(b.filename)
        if isinstance(b, mmap.mmap):
            return "?"
        b = getattr(b, "base", None)
    return None


def _replies(st: ShardState) -> bytes:
    """Hybrid, lexical and exact replies of a few queries, serialised (bit-for-bit comparison)."""
    q = np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    terms = [["lighthouse", "topic", "chunk"], ["17", "topic"], ["lighthouse"]]
    qb = QueryBatch(q, terms, [np.ones(len(t)) for t in terms], 5.0, 1.5, 0.75)
    out = [st.search.search(SearchRequest(qb, mode=mode, n=32, m=32)) for mode in ("hybrid", "lexical")]
    out.append(st.search.exact_minmax(ExactMinmaxRequest(qb, [10, 10, 10], 20, [(0.5, 0.5)] * 3)))
    return pickle.dumps(out)


def test_a_snapshot_serves_the_bm25_segment_from_its_files_with_identical_replies(tmp_path):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 3000)]), 1)
    st.store.postings.merge()  # the segment in memory, as a shard's after an ingest
    seg = st.store.postings.segment
    assert all(_mapped_from(getattr(seg, n)) is None for n in _ARRAYS)
    before = _replies(st)
    st.snapshot()
    snap = tmp_path / "shard-0" / (tmp_path / "shard-0" / "CURRENT").read_text().strip()
    seg = st.store.postings.segment
    assert {n: _mapped_from(getattr(seg, n)) for n in _ARRAYS} == {n: str(snap / "postings" / f"{n}.npy")
                                                                   for n in _ARRAYS}
    assert _replies(st) == before
    # (a write, then the next snapshot: a new segment in memory, mapped from that snapshot once written)
    st.store.upsert(pa.Table.from_batches([_batch(3000, 3100)]), 2)
    st.store.postings.merge()
    assert _mapped_from(st.store.postings.segment.slots) is None
    before = _replies(st)
    st.snapshot()
    snap = tmp_path / "shard-0" / (tmp_path / "shard-0" / "CURRENT").read_text().strip()
    assert _mapped_from(st.store.postings.segment.slots) == str(snap / "postings" / "slots.npy")
    assert _replies(st) == before
    st.txns.wal.close()
    # a restart serves the same replies
    again = ShardState(0, D, tmp_path)
    again.load(set())
    assert _replies(again) == before
    again.txns.wal.close()


def test_a_segment_written_renumbered_stays_in_memory(tmp_path):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 500)]), 1)
    st.store.delete(["d3", "d7"], 2)
    st.store.postings.merge()  # drops their postings: the segment's chunks are not at slots 0..n-1
    seg = st.store.postings.segment
    assert int(seg.doc_slots[-1]) != seg.doc_slots.size - 1
    before = _replies(st)
    st.snapshot()  # (the files hold them renumbered: not this segment)
    assert _mapped_from(st.store.postings.segment.slots) is None
    assert _replies(st) == before
    st.txns.wal.close()


def test_stats_report_the_segment_bytes_no_snapshot_holds(tmp_path):
    """``StatsReply.segment_unsaved`` (``PostingsIndex.unsaved_nbytes``): a segment a merge built
    since the last snapshot counts in full; 0 once a snapshot wrote it (mapped, or kept in memory
    when its files are renumbered) and after a restart's load (mapped), so the frontend's snapshot
    loop takes one snapshot per merge, not one per period."""
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 800)]), 1)
    st.store.postings.merge()
    built = st.store.postings.segment.nbytes()[0]
    assert built > 0 and st.stats().segment_unsaved == built
    st.store.postings.save(tmp_path / "written-not-adopted", merge=False)  # a snapshot still being written
    assert st.stats().segment_unsaved == built
    st.snapshot()
    assert st.stats().segment_unsaved == 0
    st.store.delete(["d3"], 2)
    st.store.upsert(pa.Table.from_batches([_batch(800, 900)]), 3)
    st.store.postings.merge()  # renumbered in its files at the next snapshot: kept in memory
    assert st.stats().segment_unsaved == st.store.postings.segment.nbytes()[0] > 0
    st.snapshot()
    assert _mapped_from(st.store.postings.segment.slots) is None and st.stats().segment_unsaved == 0
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path)
    again.load(set())
    assert again.stats().segment_unsaved == 0
    again.txns.wal.close()
