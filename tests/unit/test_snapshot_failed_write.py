"""A snapshot whose files cannot be written (a full disk) leaves no directory behind, the previous
snapshot stays live and the log whole; a start removes a ``snap-*`` directory that ``CURRENT``
does not name (trial15's finding #12: every failed 30 s attempt left one, and they outlived
restarts)."""

from __future__ import annotations

import errno

import pyarrow as pa
import pytest
from test_snapshot_beside import D, _batch

from oprag_server.shards import memory_files, snapshot_current
from oprag_server.shards import snapshot as snapshots
from oprag_server.shards.state import ShardState


def _snaps(d) -> list[str]:
    return sorted(p.name for p in d.glob("snap-*"))


def test_a_failed_snapshot_leaves_no_directory_and_the_previous_stays_live(tmp_path, monkeypatch):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 50)]), 1)
    st.snapshot()
    d = tmp_path / "shard-0"
    live = _snaps(d)
    assert len(live) == 1 and (d / "CURRENT").read_text().strip() == live[0]
    st.store.upsert(pa.Table.from_batches([_batch(50, 80)]), 2)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    for module in (snapshots, memory_files, snapshot_current):  # memory.json, meta.json: the disk is full
        monkeypatch.setattr(module, "fsync_write", full)
    for _ in range(3):  # three tries (the shard's periodic snapshots)
        with pytest.raises(OSError, match="No space"):
            st.snapshot()
    monkeypatch.undo()
    assert _snaps(d) == live and (d / "CURRENT").read_text().strip() == live[0]
    st.txns.wal.close()
    back = ShardState(0, D, tmp_path)
    back.load(set())
    assert len(back.store.fields) == 50  # the live snapshot; the log held nothing committed beyond it


def test_a_start_removes_snapshot_directories_current_does_not_name(tmp_path):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 20)]), 1)
    st.snapshot()
    st.txns.wal.close()
    d = tmp_path / "shard-0"
    live = _snaps(d)
    (d / "snap-000000000009-1").mkdir()  # what a crash before CURRENT's switch (or an old build) left
    (d / "snap-000000000009-1" / "chunks.arrow").write_bytes(b"partial")
    back = ShardState(0, D, tmp_path)
    back.load(set())
    assert _snaps(d) == live and len(back.store.fields) == 20
