"""What a shard's start does with a lost ``CURRENT`` or a damaged ``meta.json`` (trial55 #1, #3) and how it reports
BM25 postings it cannot use (trial55 #4): it never starts empty over a snapshot it could load, never deletes one, and
names the file."""

from __future__ import annotations

import pyarrow as pa
import pytest

from oprag_server.shards.state import ShardState

from test_bm25_delta_files import _answers, _snap
from test_snapshot_beside import D, _batch


def _shard(tmp_path, said=None) -> ShardState:
    st = ShardState(0, D, tmp_path)
    if said is not None:
        st.say = lambda line, level="INFO": said.append((level, line))
    st.load(set())
    return st


def _seeded(tmp_path):
    st = _shard(tmp_path)
    st.store.upsert(pa.Table.from_batches([_batch(0, 300)]), 1)
    st.snapshot()
    st.store.upsert(pa.Table.from_batches([_batch(300, 320)]), 2)
    st.snapshot()
    before = _answers(st)
    st.txns.wal.close()
    return before


def test_a_lost_current_loads_the_newest_snapshot_written_whole_and_keeps_it(tmp_path):
    before = _seeded(tmp_path)
    snap = _snap(tmp_path)
    (tmp_path / "shard-0" / "CURRENT").unlink()
    cut = tmp_path / "shard-0" / "snap-000000000000-1"  # an older, cut-off directory (no meta.json): swept
    cut.mkdir()
    said: list = []
    st = _shard(tmp_path, said)
    assert len(st.store.postings) == 320 and _answers(st) == before
    assert any(level == "WARNING" and "CURRENT is missing" in line and snap.name in line for level, line in said), said
    assert snap.is_dir() and not cut.exists()
    st.store.upsert(pa.Table.from_batches([_batch(320, 330)]), 3)
    st.snapshot()  # (CURRENT written again)
    st.txns.wal.close()
    again = _shard(tmp_path)
    assert len(again.store.postings) == 330
    again.txns.wal.close()


def test_a_damaged_meta_json_stops_the_start_naming_it(tmp_path):
    _seeded(tmp_path)
    meta = _snap(tmp_path) / "meta.json"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(RuntimeError, match="meta.json cannot be read"):
        _shard(tmp_path)
    assert meta.exists()


@pytest.mark.parametrize("gone", ["delta.npz", "postings"])
def test_postings_a_start_cannot_use_are_named_in_a_warning(tmp_path, gone):
    before = _seeded(tmp_path)
    p = _snap(tmp_path) / "postings"
    assert (p / "delta.npz").exists()
    if gone == "postings":
        import shutil

        shutil.rmtree(p)
    else:
        (p / gone).unlink()
    said: list = []
    st = _shard(tmp_path, said)
    assert _answers(st) == before
    assert any(level == "WARNING" and "analysed again" in line for level, line in said), said


@pytest.mark.parametrize("name", ["offsets.npy", "tf.npy", "doc_len.npy", "terms.json", "slots.npy"])
def test_a_flipped_byte_in_a_postings_file_is_never_served(tmp_path, name):
    """trial55 #2: the segment's files have CRC-32s (``postings/crc32.json``); a start that finds one damaged says
    so, naming it, and analyses the stored texts again: the same answers as before the damage."""
    import json
    import zlib

    before = _seeded(tmp_path)
    p = _snap(tmp_path) / "postings"
    listed = json.loads((p / "crc32.json").read_text())
    assert {"offsets.npy", "tf.npy", "doc_len.npy", "terms.json", "slots.npy"} <= set(listed)
    assert all(zlib.crc32((p / n).read_bytes()) == c for n, c in listed.items())
    b = bytearray((p / name).read_bytes())
    b[len(b) // 2] ^= 0x04  # (a byte inside the data, past the .npy header)
    (p / name).unlink()  # (a file of its own: the loaded CRCs are remembered per inode)
    (p / name).write_bytes(bytes(b))
    said: list = []
    st = _shard(tmp_path, said)
    assert _answers(st) == before
    assert any(level == "WARNING" and name in line and "CRC-32" in line for level, line in said), said
    st.txns.wal.close()


def test_without_current_the_snapshot_is_chosen_by_its_applied_sequence_not_its_name(tmp_path):
    """trial55b: an older snapshot directory copied in under a newer-looking name must not win."""
    import shutil

    st = _shard(tmp_path)
    st.store.upsert(pa.Table.from_batches([_batch(0, 300)]), 1)
    st.snapshot()
    old = tmp_path / "old-copy"
    shutil.copytree(_snap(tmp_path), old)
    st.store.upsert(pa.Table.from_batches([_batch(300, 320)]), 2)
    st.snapshot()
    before = _answers(st)
    st.txns.wal.close()
    shutil.copytree(old, tmp_path / "shard-0" / "snap-999999999999-9999999999999999999")
    shutil.rmtree(old)
    (tmp_path / "shard-0" / "CURRENT").unlink()
    again = _shard(tmp_path)
    assert len(again.store.postings) == 320 and _answers(again) == before
    again.txns.wal.close()


@pytest.mark.parametrize("content", ["", "snap-xyz", "snap-0000"])
def test_a_current_that_names_no_snapshot_is_refused_naming_it_and_nothing_is_removed(tmp_path, content):
    """trial55b #2: the start swept every other snapshot directory before it found out, deleting the live one."""
    before = _seeded(tmp_path)
    snap = _snap(tmp_path)
    cur = tmp_path / "shard-0" / "CURRENT"
    cur.write_text(content)
    with pytest.raises(RuntimeError, match="CURRENT names"):
        _shard(tmp_path)
    assert (snap / "meta.json").exists()
    cur.write_text(snap.name)
    again = _shard(tmp_path)
    assert _answers(again) == before
    again.txns.wal.close()


def test_a_damaged_memory_json_stops_the_start_naming_it(tmp_path):
    _seeded(tmp_path)
    mem = _snap(tmp_path) / "memory.json"
    mem.write_bytes(b'[{"session_id": ')  # cut short
    with pytest.raises(RuntimeError, match=r"memory\.json or memory_vectors\.npy beside it cannot be read"):
        _shard(tmp_path)
    assert mem.read_bytes() == b'[{"session_id": '


@pytest.mark.parametrize("damage", [b"PK\x03\x04garbage", b"", b"\x00" * 64])
def test_a_damaged_dense_seeds_file_is_rebuilt_not_refused(tmp_path, damage):
    """``dense_seeds.npz`` is rebuilt by the next warm-up: a damaged one (a zip cut short raised BadZipFile through the
    load, trial55b) reads as absent."""
    import numpy as np

    from oprag_server.index import low_seeds_state

    p = tmp_path / low_seeds_state.NAME
    np.savez(p, probes=np.zeros((2, 4), np.float32), thresh=np.zeros(2, np.float32), ids=np.arange(2),
             built_at=np.int64(0), seen=np.int64(2))
    assert low_seeds_state.decode(p) is not None
    p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2] if not damage else damage)
    assert low_seeds_state.decode(p) is None


def test_a_flipped_digit_in_meta_json_is_refused_and_a_missing_crc_list_re_analyses(tmp_path):
    """``meta.json`` carries a CRC-32 of its fields (a flipped digit of ``applied_seq`` still parses: the shard would
    skip or replay log records by it), and says the snapshot wrote ``postings/crc32.json``, so a deleted list is not
    read as a snapshot from before the lists (trial55b)."""
    import json

    before = _seeded(tmp_path)
    snap = _snap(tmp_path)
    meta = snap / "meta.json"
    m = json.loads(meta.read_text())
    assert m["postings_crc"] is True and isinstance(m["crc32"], int)
    good = meta.read_bytes()
    meta.write_bytes(good.replace(f'"applied_seq": {m["applied_seq"]}'.encode(), b'"applied_seq": 9'))
    with pytest.raises(RuntimeError, match="meta.json cannot be read .*CRC-32 does not match"):
        _shard(tmp_path)
    meta.write_bytes(good)
    (snap / "postings" / "crc32.json").unlink()
    said: list = []
    st = _shard(tmp_path, said)
    assert _answers(st) == before
    assert any(level == "WARNING" and "crc32.json is missing" in line for level, line in said), said


def test_a_torn_tail_of_the_shard_log_is_a_shard_warning_line(tmp_path):
    """trial56b F3: the shard process printed it bare (no time, level or shard), so ``grep WARNING`` missed it."""
    _seeded(tmp_path)
    wal = tmp_path / "shard-0" / "wal.log"
    wal.write_bytes(wal.read_bytes() + b"\x40\x00\x00\x00\x01\x02")  # a crash in the middle of an append
    said: list = []
    _shard(tmp_path, said).txns.wal.close()
    assert any(level == "WARNING" and "torn tail of 6 bytes" in line for level, line in said), said
