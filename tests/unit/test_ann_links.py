"""A snapshot links the dense structure's file when the structure did not change (trial52 #4).

With HNSW the graph file (``dense.faiss``) holds the only copy of the vectors: ~0.9 GB a 500K-vector shard, written
again by every snapshot, also one that only session turns caused. :meth:`..index.ann_persist.AnnPersist.write` now
hard-links the file it last wrote or loaded when the structure's change count (:class:`ChangeLock`), FAISS object and
vector count are the same. These tests check both sides: an unchanged structure is linked (the same inode in the next
snapshot, after a restart too, and the restart serves the same results), and every kind of change writes a new file
whose contents are the changed structure.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_snap18 import _by_id, _ingest
from test_snapshot_beside import D

from oprag_server.config import DenseConfig
from oprag_server.index import graph_layout
from oprag_server.index.ann import AnnIndex
from oprag_server.shards.protocol import PromoteRequest
from oprag_server.shards.state import ShardState


def _current(d):
    return d / (d / "CURRENT").read_text().strip()


def _queries(n: int = 16) -> np.ndarray:
    q = np.random.default_rng(7).standard_normal((n, D)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def _results(st: ShardState) -> list:
    """Each query's top-10 as (chunk ids, scores): slots are renumbered by a load, chunk ids are not."""
    slots, scores = st.store.dense.search(_queries(), 10)
    return [([r.chunk_id for r in st.store.fields.records(s)], np.round(v, 6).tolist()) for s, v in zip(slots, scores)]


def _turn(st: ShardState, sid: str) -> None:
    v = _queries(1)[0]
    st.memory.promote(PromoteRequest(session_id=sid, question="where is the lighthouse", summary="s", chunk_ids=["d1#0"],
                                     titles=[""], vector=v, max_turns=8, max_total=100))


@pytest.mark.parametrize("dense", [DenseConfig(kind="hnsw"), DenseConfig(kind="ivf", train_min=64)], ids=["hnsw", "ivf"])
def test_a_turns_only_snapshot_links_the_dense_file_and_a_restart_serves_the_same(tmp_path, dense):
    st = ShardState(0, D, tmp_path, dense=dense)
    st.load(set())
    _ingest(st)
    st.snapshot()
    d = tmp_path / "shard-0"
    first = _current(d) / "dense.faiss"
    ino, size = first.stat().st_ino, first.stat().st_size
    assert size > 270 * D  # (the structure itself: an IVF trained, 8-bit codes; an HNSW with its vectors)
    want, fields = _results(st), _by_id(st)
    _turn(st, "alice")  # only session memory changed
    st.snapshot()
    second = _current(d)
    assert (second / "dense.faiss").stat().st_ino == ino and not first.exists()  # linked, and alive after the sweep
    assert len(st.memory) == 1
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path, dense=dense)
    again.load(set())
    assert _results(again) == want and _by_id(again) == fields and len(again.memory) == 1
    _turn(again, "bob")
    again.snapshot()  # the structure is the one loaded from the file: linked again
    assert (_current(d) / "dense.faiss").stat().st_ino == ino
    again.store.delete(["d0", "d1"], 900)  # a write: a new file
    again.snapshot()
    third = _current(d) / "dense.faiss"
    assert third.stat().st_ino != ino
    after = _results(again)
    again.txns.wal.close()
    last = ShardState(0, D, tmp_path, dense=dense)
    last.load(set())
    assert _results(last) == after and len(last.memory) == 2 and len(last.store.fields) == 268


def _index(kind: str, n: int = 600) -> AnnIndex:
    params = DenseConfig(kind=kind, train_min=64, layout_min=1)
    ann = AnnIndex(D, params)
    v = np.random.default_rng(1).standard_normal((n, D)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    ann.add(np.arange(n, dtype=np.int64), v, (np.arange(n, dtype=np.int64), v))
    return ann


def _same_as_file(ann: AnnIndex, path, kind: str) -> None:
    """The file holds ``ann``'s structure: loaded into a fresh index it answers the same."""
    other = AnnIndex(D, DenseConfig(kind=kind, train_min=64))
    other.load(path, ann.ann_slot.copy(), ann.trained_at)
    q = _queries()
    got, want = other.search(q, 10, 64, 64), ann.search(q, 10, 64, 64)
    assert all(np.array_equal(a, b) for a, b in zip(got[0], want[0]))


def _changes(kind: str):
    rng = np.random.default_rng(5)
    more = rng.standard_normal((40, D)).astype(np.float32)
    more /= np.linalg.norm(more, axis=1, keepdims=True)

    def add(ann):
        s = np.arange(ann.ann_slot.size, ann.ann_slot.size + 40, dtype=np.int64)
        ann.add(s, more, (np.concatenate([ann.ann_slot, s]), None))

    def remove(ann):
        ann.remove(np.arange(0, 30, dtype=np.int64))

    out = {"add": add, "remove": remove}
    if kind == "hnsw":
        def defer_insert(ann):
            s = np.arange(ann.ann_slot.size, ann.ann_slot.size + 40, dtype=np.int64)
            ann.defer(s, more)
            ann.insert_pending()

        def compact(ann):
            live = ann.ann_slot[ann.ann_slot >= 0]
            ann.rebuild(live[5:], ann.gather(np.flatnonzero(ann.ann_slot >= 0)[5:]))

        def lay_out(ann):
            assert graph_layout.lay_out(ann, None, np.arange(int(ann._index.ntotal))[::-1].copy()) is not None

        out.update(defer_insert=defer_insert, compact=compact, lay_out=lay_out)
    return out


@pytest.mark.parametrize("kind,change", [(k, c) for k in ("hnsw", "ivf") for c in _changes(k)])
def test_every_change_writes_a_new_file_that_holds_it(tmp_path, kind, change):
    ann = _index(kind)
    assert ann.write(tmp_path / "a.faiss") is False
    assert ann.write(tmp_path / "b.faiss") is True  # unchanged: linked
    assert (tmp_path / "b.faiss").stat().st_ino == (tmp_path / "a.faiss").stat().st_ino
    _changes(kind)[change](ann)
    assert ann.write(tmp_path / "c.faiss") is False, change
    assert (tmp_path / "c.faiss").stat().st_ino != (tmp_path / "a.faiss").stat().st_ino
    if ann.params.kind == "hnsw" and ann.pending:
        ann.insert_pending()
        assert ann.write(tmp_path / "c.faiss") is False
    _same_as_file(ann, tmp_path / "c.faiss", kind)
    assert ann.write(tmp_path / "d.faiss") is True  # and unchanged since: linked to it


def test_a_saved_file_gone_or_replaced_is_written_anew_and_no_name_is_truncated(tmp_path):
    ann = _index("hnsw")
    ann.write(tmp_path / "a.faiss")
    (tmp_path / "a.faiss").unlink()
    assert ann.write(tmp_path / "b.faiss") is False  # gone: written
    (tmp_path / "b.faiss").rename(tmp_path / "moved.faiss")
    (tmp_path / "b.faiss").write_bytes(b"another file under the saved name")
    assert ann.write(tmp_path / "c.faiss") is False  # the name holds another file: written, not linked to it
    _same_as_file(ann, tmp_path / "c.faiss", "hnsw")
    assert ann.write(tmp_path / "c.faiss") is False and (tmp_path / "c.faiss").stat().st_nlink == 1  # (its own path)
    linked = tmp_path / "d.faiss"
    assert ann.write(linked) is True
    before = (tmp_path / "c.faiss").read_bytes()
    ann.add(np.array([10_000]), _queries(1), (np.arange(1), None))
    ann.write(tmp_path / "c.faiss")  # a changed structure written to a name that shares its file with d.faiss
    assert linked.read_bytes() == before  # the other name keeps its bytes: the file was replaced, not truncated


def test_a_loaded_structure_is_linked_until_it_changes(tmp_path):
    ann = _index("hnsw")
    ann.write(tmp_path / "a.faiss")
    other = AnnIndex(D, DenseConfig(kind="hnsw"))
    other.load(tmp_path / "a.faiss", ann.ann_slot.copy(), 0)
    assert other.write(tmp_path / "b.faiss") is True
    other.load(ann.to_bytes(), ann.ann_slot.copy(), 0)  # from bytes: no file to link
    assert other.write(tmp_path / "c.faiss") is False
