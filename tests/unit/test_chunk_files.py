"""A snapshot's stored fields in several files, the earlier ones linked (:mod:`oprag_server.shards.chunk_files`).

A snapshot after a write wrote every chunk's fields again (860 MB a 500K-chunk shard). Rows added since the last
snapshot follow the rows it wrote, so the next snapshot now links its files and writes the new rows alone, as long as
nothing was removed. These tests check the files a snapshot writes or links after appends, removals and many small
rounds, that a restart (and the snapshot just adopted) serves exactly the stored fields, for every dense index kind,
and that a chunk file whose rows disagree with ``meta.json`` is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from test_snap18 import _by_id, _fetch_all
from test_snapshot_beside import D, _batch

from oprag_server.config import DenseConfig
from oprag_server.shards import chunks as chunkstore
from oprag_server.shards import fields
from oprag_server.shards.state import ShardState


@pytest.fixture(autouse=True)
def _small_batches(monkeypatch):
    """Record batches of 64 rows: the shards here hold more than one (a smaller one keeps one file)."""
    monkeypatch.setattr(chunkstore, "BATCH_ROWS", 64)


def _current(tmp_path):
    d = tmp_path / "shard-0"
    return d / (d / "CURRENT").read_text().strip()


def _files(tmp_path) -> list:
    """``meta.json``'s ``chunk_files`` without the CRC-32s: ``[[name, rows], ...]``."""
    return [f[:2] for f in json.loads((_current(tmp_path) / "meta.json").read_text())["chunk_files"]]


def _ino(tmp_path, name: str) -> int:
    return (_current(tmp_path) / name).stat().st_ino


def _add(st: ShardState, lo: int, hi: int, seq: int) -> None:
    st.store.upsert(pa.Table.from_batches([_batch(lo, hi)]), seq)


def _restart(st: ShardState, tmp_path, dense: DenseConfig) -> ShardState:
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path, dense=dense)
    again.load(set())
    return again


KINDS = [DenseConfig(kind="flat"), DenseConfig(kind="hnsw"), DenseConfig(kind="ivf", train_min=64)]


@pytest.mark.parametrize("dense", KINDS, ids=["flat", "hnsw", "ivf"])
def test_appends_link_the_earlier_files_and_removals_write_one_file(tmp_path, dense):
    st = ShardState(0, D, tmp_path, dense=dense)
    st.load(set())
    _add(st, 0, 300, 1)
    st.snapshot()
    assert _files(tmp_path) == [["chunks.arrow", 300]]
    first = _ino(tmp_path, "chunks.arrow")
    _add(st, 300, 400, 2)
    want = _by_id(st)
    st.snapshot()
    assert _files(tmp_path) == [["chunks.arrow", 300], ["chunks.000000000300.arrow", 100]]
    assert _ino(tmp_path, "chunks.arrow") == first  # the earlier rows: a link
    assert _by_id(st) == want and len(_fetch_all(st)) == 400  # (served from the files just written)
    st = _restart(st, tmp_path, dense)
    assert _by_id(st) == want and _fetch_all(st) == sorted(_fetch_all(st))
    _add(st, 400, 420, 3)
    st.snapshot()  # both files kept: 300 >= 2 x 120, 100 >= 2 x 20
    assert [f for f, _ in _files(tmp_path)] == ["chunks.arrow", "chunks.000000000300.arrow", "chunks.000000000400.arrow"]
    assert _ino(tmp_path, "chunks.arrow") == first
    st.store.delete(["d5", "d310"], 4)  # a removal: every row again, in one file
    want = _by_id(st)
    st.snapshot()
    assert _files(tmp_path) == [["chunks.arrow", 418]] and _ino(tmp_path, "chunks.arrow") != first
    assert _by_id(st) == want
    st = _restart(st, tmp_path, dense)
    assert _by_id(st) == want
    assert st.store.dense.search(np.ones((1, D), np.float32) / np.sqrt(D), 5)[0][0].size == 5


def test_many_small_rounds_keep_few_files_and_every_row(tmp_path):
    dense = DenseConfig(kind="hnsw")
    st = ShardState(0, D, tmp_path, dense=dense)
    st.load(set())
    _add(st, 0, 64, 1)
    for i in range(30):
        _add(st, 64 + 8 * i, 72 + 8 * i, 2 + i)
        st.snapshot()
        files = _files(tmp_path)
        rows = [r for _, r in files]
        assert all(rows[j] >= 2 * sum(rows[j + 1:]) for j in range(len(rows) - 1))
        assert sum(rows) == len(st.store.fields)
    n = 64 + 8 * 30
    assert len(_files(tmp_path)) <= int(np.log2(n)) + 1
    want = _by_id(st)
    st = _restart(st, tmp_path, dense)
    assert _by_id(st) == want and len(want) == n


def _two_files(tmp_path) -> ShardState:
    """A shard of 340 chunks whose snapshot is ``chunks.arrow`` (300 rows) and a file of 40."""
    st = ShardState(0, D, tmp_path)
    st.load(set())
    _add(st, 0, 300, 1)
    st.snapshot()
    _add(st, 300, 340, 2)
    st.snapshot()
    return st


@pytest.mark.parametrize("damage", ["rows", "listing_cut", "byte", "truncate"])
def test_a_damaged_file_or_listing_is_refused_naming_it(tmp_path, damage):
    """trial54b: a listing cut short served a shard without its last file's chunks (#1), a changed byte in a file was
    served as text (#3), a truncated file was refused without its name (#4)."""
    _two_files(tmp_path).txns.wal.close()
    meta = _current(tmp_path) / "meta.json"
    m = json.loads(meta.read_text())
    second = _current(tmp_path) / m["chunk_files"][1][0]
    if damage == "rows":  # (both counts edited alike: the file's own count disagrees)
        m["chunk_files"][1][1], m["chunks"] = 39, 339
        err, want = ValueError, f"{second.name}: 40 rows, 39 listed in meta.json"
    elif damage == "listing_cut":
        m["chunk_files"] = m["chunk_files"][:1]
        err, want = RuntimeError, "chunk_files hold 300 rows, not the snapshot's 340 chunks"
    elif damage == "byte":
        b = bytearray(second.read_bytes())
        at = b.find(b"chunk 320 lighthouse")
        b[at + 6] = ord("9")  # (the same length: "chunk 920 ...")
        second.write_bytes(bytes(b))
        err, want = ValueError, f"{second.name}: its CRC-32 is"
    else:
        second.write_bytes(second.read_bytes()[:3000])
        err, want = ValueError, f"{second.name}: cannot be read"
    from oprag_server.shards.snapshot import meta_crc

    m["crc32"] = meta_crc(m)  # (edited whole: past meta.json's own CRC-32, to the listing's checks)
    meta.write_text(json.dumps(m))
    with pytest.raises(err, match=want):
        ShardState(0, D, tmp_path).load(set())


def test_the_benches_read_every_file(tmp_path):
    from bench._common import read_snapshot

    _two_files(tmp_path).txns.wal.close()
    assert len(_files(tmp_path)) == 2
    snap = read_snapshot(tmp_path)
    assert snap["chunk_id"] == [f"d{i}#0" for i in range(340)] and snap["vectors"].shape == (340, D)


def test_a_shard_of_one_record_batch_keeps_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(chunkstore, "BATCH_ROWS", 400)
    st = _two_files(tmp_path)  # 340 rows: one file, one batch
    assert _files(tmp_path) == [["chunks.arrow", 340]]
    f = st.store.fields
    assert len(f._parts) == 1 and all(c.plain() for c in f._readers(0, fields._HIT))  # (the compiled gather's case)
    _add(st, 340, 420, 3)
    st.snapshot()  # 420 rows: more than one batch, so the first file is linked
    assert [f for f, _ in _files(tmp_path)] == ["chunks.arrow", "chunks.000000000340.arrow"]
