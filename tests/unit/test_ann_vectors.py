"""HNSW's stored vectors saved in parts beside the graph, linked while they hold the same rows (trial52 #2).

Every snapshot after a write wrote a 500K-vector shard's whole HNSW file again (902 MB, 1.5-2.5 s, while the shard held
every write). The graph is now written alone and the vectors in parts (:mod:`oprag_server.index.ann_vectors`); a part
is linked by the next write only when the storage still holds exactly its rows (position, count, CRC-32). These tests
check that appends link the old parts and write only the new rows, that every change that moves or rewrites rows
(renumbering, compaction, a row changed in place) writes them anew, that what is loaded back is bit for bit the
structure that was written, that the parts stay few, and that a file of the earlier format (vectors inside) loads.
"""

from __future__ import annotations

import json
import zlib

import faiss
import numpy as np
import pytest
from test_ann_links import _current, _index, _queries
from test_snap18 import _by_id, _ingest
from test_snapshot_beside import D

from oprag_server.config import DenseConfig
from oprag_server.index import ann_vectors, graph_layout
from oprag_server.index.ann import AnnIndex
from oprag_server.index.ann_copies import hnsw_storage
from oprag_server.index.ann_read import read_vectors
from oprag_server.shards.state import ShardState


def _unit(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _append(ann: AnnIndex, n: int, seed: int) -> None:
    s = np.arange(ann.ann_slot.size, ann.ann_slot.size + n, dtype=np.int64)
    ann.add(s, _unit(n, seed), (np.concatenate([ann.ann_slot, s]), None))


def _parts(path) -> list[dict]:
    return json.loads(ann_vectors.sidecar(path).read_text())["parts"]


def _ino(path, start: int) -> int:
    return path.with_name(f"{path.name}.v{start:012d}.npy").stat().st_ino


def _loads_as(ann: AnnIndex, path) -> None:
    """The files at ``path`` hold ``ann``'s structure: the same stored vectors bit for bit, the same answers."""
    other = AnnIndex(D, DenseConfig(kind="hnsw"))
    other.load(path, ann.ann_slot.copy(), ann.trained_at)
    a, b = hnsw_storage(other._index), hnsw_storage(ann._index)
    assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    got, want = other.search(_queries(), 10, 64, 64), ann.search(_queries(), 10, 64, 64)
    assert all(np.array_equal(x, y) for x, y in zip(got[0], want[0]))
    assert all(np.array_equal(x, y) for x, y in zip(got[1], want[1]))


def test_appends_link_the_old_rows_and_write_only_the_new_ones(tmp_path):
    ann = _index("hnsw", 600)
    a, b, c = tmp_path / "a.faiss", tmp_path / "b.faiss", tmp_path / "c.faiss"
    assert ann.write(a) is False
    assert [(p["start"], p["rows"]) for p in _parts(a)] == [(0, 600)]
    full = len(faiss.serialize_index(ann._index))
    assert a.stat().st_size <= full - 600 * D * 4 + 64  # the graph alone: the vectors are in the part
    _append(ann, 40, 3)
    assert ann.write(b) is False  # the graph changed: written
    assert [(p["start"], p["rows"]) for p in _parts(b)] == [(0, 600), (600, 40)]
    assert _ino(b, 0) == _ino(a, 0)  # the old rows: a link
    _loads_as(ann, b)
    assert ann.write(c) is True  # nothing changed since: every file linked
    assert c.stat().st_ino == b.stat().st_ino and _ino(c, 600) == _ino(b, 600)
    assert json.loads(ann_vectors.sidecar(c).read_text())["graph_crc32"] == zlib.crc32(c.read_bytes())
    _loads_as(ann, c)


def _lay_out(ann):
    assert graph_layout.lay_out(ann, None, np.arange(int(ann._index.ntotal))[::-1].copy()) is not None


def _compact(ann):
    live = ann.ann_slot[ann.ann_slot >= 0]
    ann.rebuild(live[5:], ann.gather(np.flatnonzero(ann.ann_slot >= 0)[5:]))


def _row_in_place(ann):
    hnsw_storage(ann._index)[3] *= -1.0  # (what no code path does today: the CRC must see it anyway)


@pytest.mark.parametrize("change", [_lay_out, _compact, _row_in_place], ids=["renumbering", "compaction", "in_place"])
def test_rows_moved_or_changed_are_written_anew(tmp_path, change):
    ann = _index("hnsw", 600)
    a, b = tmp_path / "a.faiss", tmp_path / "b.faiss"
    ann.write(a)
    _append(ann, 40, 3)
    ann.write(b)
    change(ann)
    _append(ann, 10, 4)
    c = tmp_path / "c.faiss"
    assert ann.write(c) is False
    assert _ino(c, 0) != _ino(a, 0)  # rewritten, not linked to the stale rows
    _loads_as(ann, c)


def test_parts_stay_few_and_each_row_is_written_a_few_times(tmp_path, monkeypatch):
    written = []
    real = np.save
    monkeypatch.setattr(ann_vectors.np, "save",
                        lambda f, rows, **kw: (written.append(rows.shape[0]), real(f, rows, **kw)))
    ann = _index("hnsw", 256)
    prev = None
    for i in range(40):
        _append(ann, 8, 100 + i)
        p = tmp_path / f"s{i}.faiss"
        ann.write(p)
        if prev is not None:  # a snapshot keeps only the last one
            ann_vectors.remove(prev)
            prev.unlink()
        prev = p
        parts = _parts(p)
        assert [q["start"] for q in parts] == list(np.cumsum([0] + [q["rows"] for q in parts[:-1]]))
        assert all(parts[j]["rows"] >= 2 * sum(q["rows"] for q in parts[j + 1:]) for j in range(len(parts) - 1))
    n = 256 + 40 * 8
    assert len(_parts(prev)) <= int(np.log2(n)) + 1
    assert sum(written) <= 6 * n  # (rewriting every row each time: 40 writes of up to n rows)
    _loads_as(ann, prev)


def test_a_file_of_the_earlier_format_loads_and_the_next_write_uses_parts(tmp_path):
    ann = _index("hnsw", 300)
    old = tmp_path / "old.faiss"
    faiss.write_index(ann._index, str(old))  # (format 4 and before: the vectors inside the graph's file)
    _loads_as(ann, old)
    assert np.array_equal(read_vectors(old, ann.ann_slot, np.array([4, 2])), hnsw_storage(ann._index)[[4, 2]])
    other = AnnIndex(D, DenseConfig(kind="hnsw"))
    other.load(old, ann.ann_slot.copy(), 0)
    new = tmp_path / "new.faiss"
    assert other.write(new) is True and not ann_vectors.sidecar(new).exists()  # unchanged: the old file, linked
    _append(other, 5, 9)
    assert other.write(tmp_path / "next.faiss") is False and _parts(tmp_path / "next.faiss")[-1]["rows"] == 305


def test_missing_or_short_parts_are_refused(tmp_path):
    ann = _index("hnsw", 300)
    p = tmp_path / "a.faiss"
    ann.write(p)
    part = p.with_name(_parts(p)[0]["name"])
    rows = np.load(part)
    part.unlink()
    with pytest.raises(ValueError, match=f"{part.name}: cannot be read"):
        ann_vectors.read(p)
    np.save(part, rows[:-1])
    with pytest.raises(ValueError, match="does not hold rows"):
        ann_vectors.read(p)
    bad = rows.copy()
    bad.view(np.uint8).reshape(-1)[4001] ^= 0x40  # (a damaged file of the same size: trial54 #1)
    np.save(part, bad)
    with pytest.raises(ValueError, match=f"{part.name}: its rows' CRC-32 is"):
        ann_vectors.read(p)
    np.save(part, rows)
    _loads_as(ann, p)
    ann_vectors.sidecar(p).write_text('{"rows": 300, "dim"')
    with pytest.raises(ValueError, match="vectors.json: cannot be read"):
        ann_vectors.read(p)


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_list", "no_graph", "graph"])
def test_a_damaged_snapshot_stops_the_start_naming_the_file(tmp_path, damage):
    """trial54 #2, #3: a damaged part or parts list stopped the start with "nothing to rebuild from", after a log
    line announcing a conversion; a flat shard's conversion named ``dense.faiss``. Both now name the file. A byte of
    the graph file changed (a neighbour id: FAISS still reads it) is caught by the graph's CRC-32 in the parts list."""
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw"))
    st.load(set())
    _ingest(st)
    st.snapshot()
    st.txns.wal.close()
    g = _current(tmp_path / "shard-0") / "dense.faiss"
    part = g.with_name(_parts(g)[0]["name"])
    rows = np.load(part)
    if damage == "flip":
        rows.view(np.uint8).reshape(-1)[1001] ^= 0x40
        np.save(part, rows)
        want = f"{part.name}: its rows' CRC-32"
    elif damage == "truncate":
        part.write_bytes(part.read_bytes()[:5000])
        want = f"{part.name}: cannot be read"
    elif damage == "no_list":
        ann_vectors.sidecar(g).unlink()
        want = "dense.faiss.vectors.json: cannot be read"
    elif damage == "graph":
        data = bytearray(g.read_bytes())
        def in_range(off):  # positions of int32 values that could be neighbour ids, reading from byte ``off``
            ids = np.frombuffer(bytes(data[off:off + (len(data) - off) // 4 * 4]), np.int32)
            return np.flatnonzero((ids > 0) & (ids < 200))

        off = max(range(4), key=lambda o: in_range(o).size)  # (the neighbour lists' alignment in the file)
        hits = in_range(off)
        data[off + 4 * int(hits[hits.size // 2])] ^= 0x01  # (a neighbour id moved by one: FAISS's own check passes)
        g.write_bytes(bytes(data))
        faiss.read_index(str(g), faiss.IO_FLAG_SKIP_STORAGE)  # (FAISS reads it without a word)
        want = "dense.faiss: its CRC-32 is .* the HNSW graph file was damaged"
    else:
        g.unlink()
        want = "dense.faiss is missing"
    with pytest.raises(RuntimeError, match="the only copy of the chunks' vectors, cannot be loaded: .*" + want):
        ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw")).load(set())
    if damage == "no_graph":
        want = "No such file or directory: .*dense.faiss'"
    with pytest.raises(RuntimeError, match=want):  # (another kind reads the vectors out of the files: the same file)
        ShardState(0, D, tmp_path, dense=DenseConfig(kind="flat")).load(set())


def test_a_write_snapshot_links_the_vectors_and_a_restart_serves_the_same(tmp_path):
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw"))
    st.load(set())
    _ingest(st)
    st.snapshot()
    d = tmp_path / "shard-0"
    first = _current(d) / "dense.faiss"
    assert json.loads((first.parent / "meta.json").read_text())["format_version"] == 5
    ino = _ino(first, 0)
    st.store.delete(["d0"], 900)
    st.snapshot()  # a delete: the graph (its dead ids) and the id map change, the stored rows do not
    assert _ino(_current(d) / "dense.faiss", 0) == ino
    want = [st.store.dense.search(_queries(), 10)[1], _by_id(st)]
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw"))
    again.load(set())
    got = [again.store.dense.search(_queries(), 10)[1], _by_id(again)]
    assert all(np.array_equal(x, y) for x, y in zip(got[0], want[0])) and got[1] == want[1]


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_a_damaged_dense_npz_names_it_with_hnsw_and_is_rebuilt_with_ivf(tmp_path, kind):
    """trial55b: a cut ``dense.npz`` raised zipfile's BadZipFile through the load, or (HNSW) "nothing to rebuild from"
    without a file name. With HNSW it maps the only copy of the vectors: the start stops naming it; an IVF's lists
    are rebuilt from the chunks' vectors."""
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind))
    st.load(set())
    _ingest(st)
    st.snapshot()
    n = len(st.store.dense.slots)
    st.txns.wal.close()
    m = _current(tmp_path / "shard-0") / "dense.npz"
    m.write_bytes(m.read_bytes()[:100])
    again = ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind))
    if kind == "hnsw":
        with pytest.raises(RuntimeError, match=r"the only copy of the chunks' vectors, cannot be loaded: dense\.npz "
                                               r"cannot be read \(BadZipFile"):
            again.load(set())
    else:
        again.load(set())
        assert len(again.store.dense.slots) == n > 0
