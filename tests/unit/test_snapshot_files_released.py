"""A snapshot's memory-mapped ``chunks.arrow`` is released once the next snapshot replaces it
(trial16). The stored fields cached string readers of each part they served hits from, and
the cache was cleared only when it held 64 entries: every snapshot after a fetch left the
previous snapshot's file open and mapped, deleted from its directory but not from the disk (a
long-running server held up to ~64 former snapshots' worth of disk space, one open file each;
at a million chunks a snapshot file is ~1.5 GB)."""

from __future__ import annotations

import gc
import os
import threading
import time

import pyarrow as pa

from oprag_server.shards.protocol import FetchRequest
from oprag_server.shards.state import ShardState

from test_snapshot_beside import D, _batch


def _mapped_snapshot_files() -> tuple[list[str], list[str]]:
    """(open file descriptors, mappings) of this process on a ``chunks.arrow`` no longer in its directory."""
    fds = []
    for f in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        if "chunks.arrow" in t and t.endswith("(deleted)"):
            fds.append(t)
    with open("/proc/self/maps") as fh:
        maps = [ln.split(None, 5)[-1].strip() for ln in fh if "chunks.arrow" in ln and "(deleted)" in ln]
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
