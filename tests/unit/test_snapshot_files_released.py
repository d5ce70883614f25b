"""A snapshot's memory-mapped ``chunks.arrow`` is released once the next snapshot replaces it
(trial16). The stored fields cached string readers of each part they served hits from, and
the cache was cleared only when it held 64 entries: every snapshot after a fetch left the
previous snapshot's file open and mapped, deleted from its directory but not from the disk (a
long-running server held up to ~64 former snapshots' worth of disk space, one open file each;
at a million chunks a snapshot file is ~1.5 GB). Likewise the BM25 postings a shard loaded
from its snapshot (memory-mapped ``postings/*.npy``): the top-m scratch and the widening
cache kept the former segment after a merge replaced it, until the next pruned-path query."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pyarrow as pa

from oprag_server.shards.protocol import FetchRequest, QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

from test_snapshot_beside import D, _batch, _seed


def _mapped_snapshot_files(name: str = "chunks.arrow") -> tuple[list[str], list[str]]:
    """(open file descriptors, mappings) of this process on snapshot files (paths containing
    ``name``) no longer in their directory."""
    fds = []
    for f in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        if name in t and t.endswith("(deleted)"):
            fds.append(t)
    with open("/proc/self/maps") as fh:
        maps = [ln.split(None, 5)[-1].strip() for ln in fh if name in ln and "(deleted)" in ln]
    return fds, maps


def _drops_done(timeout: float = 10.0) -> None:
    """Wait for the snapshot job's drop threads (the former parts are freed there)."""
    end = time.monotonic() + timeout
    while any(t.name == "oprag-snapshot-drop" for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.01)
    gc.collect()


def test_a_replaced_snapshot_file_is_closed_unmapped_and_freed(tmp_path):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    _drops_done()  # (what earlier tests in this process left mapped is freed first, not counted against this one)
    before = _mapped_snapshot_files()
    for i in range(6):
        st.store.upsert(pa.Table.from_batches([_batch(100 * i, 100 * i + 100)]), i + 1)
        st.snapshot()  # serves the fields from this snapshot's file (mapped)
        st.search.fetch(FetchRequest([0, 1, 100 * i + 5]))  # a query's hits read from it
        _drops_done()
        assert len(list((tmp_path / "shard-0").glob("snap-*"))) == 1
    st.store.upsert(pa.Table.from_batches([_batch(600, 610)]), 7)
    st.snapshot()
    _drops_done()
    fds, maps = _mapped_snapshot_files()
    assert (fds, maps) == before, f"former snapshot files still open ({len(fds)}) or mapped ({len(maps)}): {fds[:3]}"
    rep = st.search.fetch(FetchRequest([0, 605]))
    assert rep.found == [True, True] and rep.doc_ids == ["d0", "d605"]
    st.txns.wal.close()


def test_the_postings_a_shard_loaded_are_released_once_a_merge_replaced_them(tmp_path):
    _seed(tmp_path, 24_000)  # a query of its three common terms reads >= 65,536 postings: the pruned path
    st = ShardState(0, D, tmp_path)
    st.load(set())  # the BM25 segment is the snapshot's postings/*.npy, memory-mapped
    before = _mapped_snapshot_files("postings")
    q = np.ones((1, D), np.float32) / np.sqrt(D)

    def search():
        for mode, m in (("hybrid", 64), ("lexical", 0)):
            st.search.search(SearchRequest(QueryBatch(q, [["lighthouse", "topic", "chunk"]], [np.ones(3)], 5.0, 1.5,
                                                      0.75), mode=mode, n=64, m=m))

    search()
    st.store.upsert(pa.Table.from_batches([_batch(30_000, 30_010)]), 2)
    search()
    st.snapshot()  # merges the delta into a new segment, writes it, deletes the loaded snapshot
    _drops_done()
    fds, maps = _mapped_snapshot_files("postings")
    assert (fds, maps) == before, f"former postings files still open ({len(fds)}) or mapped ({len(maps)}): {fds[:3]}"
    search()  # (the caches rebuild for the new segment)
    st.txns.wal.close()
