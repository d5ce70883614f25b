"""Deferred HNSW inserts (issue 13): vectors an ingest adds with ``defer=True`` are searchable at
once (an exact scan of the tail beside the graph), read back exactly as given, keep their ANN ids
when the shard inserts them later, and survive removal, compaction, the tail bound and a
snapshot; the shard's background step drains them."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import DenseConfig
from oprag_server.index.ann import PIECE
from oprag_server.index.dense import DenseIndex
from oprag_server.shards.state import ShardState

D = 24


def _clustered(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((6, D))[rng.integers(0, 6, n)] + 0.4 * rng.standard_normal((n, D))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _uniform_sphere(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, D))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _exact_top(V: np.ndarray, slots: np.ndarray, q: np.ndarray, k: int) -> list[set[int]]:
    s = q @ V.T
    return [set(slots[np.argsort(-row, kind="stable")[:k]].tolist()) for row in s]


@pytest.mark.parametrize("make", [_clustered, _uniform_sphere])
def test_deferred_vectors_are_found_read_back_and_keep_their_ids(make):
    V = make(600, seed=1)
    slots = np.arange(600, dtype=np.int64) * 3 + 2
    cfg = DenseConfig(kind="hnsw", hnsw_m=8, ann_tail=100_000)
    h, f = DenseIndex(D, cfg), DenseIndex(D)
    h.add(slots[:200], V[:200])  # in the graph
    for part in np.array_split(np.arange(200, 600), 3):  # deferred
        h.add(slots[part], V[part], defer=True)
    f.add(slots, V)
    assert h.pending == 400 and len(h) == 600 and h._ann._index.ntotal == 200
    q = make(5, seed=2)
    # the 400 deferred vectors are scanned exactly: every one of them in the exact top-10 is found
    got, scores = h.search(q, 10)
    want = _exact_top(V, slots, q, 10)
    tail = set(slots[200:].tolist())
    for g, w in zip(got, want):
        assert (w & tail) <= set(g.tolist())
    assert all(np.all(np.diff(s) <= 0) for s in scores)
    probe = slots[::7]
    assert np.array_equal(h.vectors_of(probe), f.vectors_of(probe))
    assert np.array_equal(h.exact_slots(q[0], probe), f.exact_slots(q[0], probe))
    order, forder = np.argsort(h.slots), np.argsort(f.slots)
    assert np.array_equal(h.slots[order], f.slots[forder])
    assert np.array_equal(h.vectors[order], f.vectors[forder])
    assert np.allclose(h.score_all(q)[:, order], f.score_all(q)[:, forder], atol=1e-5)
    # removal of a deferred and of an indexed slot: never returned, before or after the insert
    dead = np.array([slots[3], slots[250], slots[599]])
    h.remove(dead)
    f.remove(dead)
    done = 0
    for _ in range(2):
        got, _ = h.search(np.concatenate([q, V[[3, 250, 599]]]), 10)
        assert not set(np.concatenate(got).tolist()) & set(dead.tolist())
        done += h.insert_pending(150)  # (at least 150: whole pieces of ann.PIECE from the write's first vector)
    assert 300 <= done < 300 + 2 * PIECE and h.insert_pending() == 400 - done
    assert h.pending == 0 and h._ann._index.ntotal == 600
    live = f.slots
    assert np.array_equal(h.vectors_of(live), f.vectors_of(live))  # ids stayed aligned
    assert np.array_equal(h._ann.storage(), np.asarray(V))  # the graph holds them in id order


def test_the_tail_bound_inserts_the_oldest_at_once_and_zero_means_never_deferred():
    V = _clustered(300, seed=4)
    s = np.arange(300, dtype=np.int64)
    h = DenseIndex(D, DenseConfig(kind="hnsw", hnsw_m=8, ann_tail=50))
    for part in np.array_split(s, 6):
        h.add(part, V[part], defer=True)
        assert h.pending <= 50
    assert h.pending == 50 and h._ann._index.ntotal == 250
    z = DenseIndex(D, DenseConfig(kind="hnsw", hnsw_m=8, ann_tail=0))
    z.add(s, V, defer=True)
    assert z.pending == 0 and z._ann._index.ntotal == 300
    flat = DenseIndex(D, DenseConfig(kind="flat", ann_tail=50))
    flat.add(s, V, defer=True)
    assert flat.pending == 0
    with pytest.raises(ValueError):
        DenseConfig(kind="hnsw", ann_tail=-1)


def test_compaction_and_a_synchronous_add_absorb_the_tail():
    V = _uniform_sphere(400, seed=5)
    s = np.arange(400, dtype=np.int64)
    h = DenseIndex(D, DenseConfig(kind="hnsw", hnsw_m=8))
    h.add(s[:100], V[:100], defer=True)
    h.add(s[100:200], V[100:200])  # a plain add inserts what waits first: ids stay in order
    assert h.pending == 0 and np.array_equal(h._ann.storage(), V[:200])
    h.add(s[200:], V[200:], defer=True)
    h.remove(s[:150])  # past a quarter dead: rebuilt from the live vectors, tail included
    assert h.pending == 0 and h._ann.dead == 0
    assert np.array_equal(h.vectors_of(s[150:]), V[150:])


def _upsert(st: ShardState, lo: int, hi: int, seq: int, V: np.ndarray) -> None:
    texts = [f"chunk {i} topic {i % 5}" for i in range(lo, hi)]
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(lo, hi)], doc_ids=[f"d{i}" for i in range(lo, hi)],
        titles=[""] * (hi - lo), texts=texts, metadata=[{}] * (hi - lo), ordinals=[0] * (hi - lo),
        generations=[1] * (hi - lo), content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=V[lo:hi])]), seq)


def test_a_shard_defers_its_ingest_inserts_and_drains_them_between_requests(tmp_path):
    V = _clustered(760, seed=6)
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw", hnsw_m=8))
    st.load(set())
    _upsert(st, 0, 300, 1, V)
    _upsert(st, 300, 700, 2, V)
    assert st.store.dense.pending == 700 and st.stats().ann_pending == 700
    got, _ = st.store.dense.search(V[[10, 650]], 1)
    assert [g.tolist() for g in got] == [[10], [650]]
    steps = 1
    while st.background_step():
        steps += 1
    assert st.store.dense.pending == 0 and steps == -(-700 // st.BACKGROUND_STEP)
    st.txns.prepared["t"] = {}  # a prepared transaction waits for its apply: no background work
    _upsert(st, 700, 710, 3, V)
    assert not st.background_step() and st.store.dense.pending == 10
    st.txns.prepared.clear()
    assert not st.background_step() and st.store.dense.pending == 0
    st.store.delete(["d1"], 3)
    _upsert(st, 710, 760, 4, V)  # deferred again: the snapshot keeps them apart (dense_tail.npy)
    assert st.store.dense.pending == 50
    st.snapshot()
    assert st.store.dense.pending == 50
    snap = next((tmp_path / "shard-0").glob("snap-*"))
    assert np.load(snap / "dense_tail.npy").shape == (50, D)
    keep = np.delete(np.arange(760), 1)
    for kind in ("hnsw", "flat"):  # (flat: the vectors read out of the graph file and the tail)
        again = ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind, hnsw_m=8))
        again.load(set())
        assert again.store.dense.pending == (50 if kind == "hnsw" else 0) and len(again.store.dense) == 759
        assert np.array_equal(again.store.dense.vectors_of(np.arange(759)), V[keep])  # slots renumbered in order
        got, _ = again.store.dense.search(V[[0, 755]], 1)
        assert [g.tolist() for g in got] == [[0], [754]]
    while st.background_step():
        pass
    st.snapshot()  # nothing deferred: a format-3 snapshot
    snap = next((tmp_path / "shard-0").glob("snap-*"))
    assert not (snap / "dense_tail.npy").exists()


def test_canonical_scores_with_deferred_and_dead_rows_read_only_those_rows():
    """While HNSW inserts are deferred (or ids dead), a query's canonical scores gather only the
    rows they need (``DenseIndex.vectors`` would copy every live vector: seconds a query at 1M,
    issue 13 settle11), with the same values as fixed_order_dot over the full copy."""
    from oprag_server.index.dense import fixed_order_dot

    V = _clustered(400, seed=7)
    st = ShardState(0, D, None, dense=DenseConfig(kind="hnsw", hnsw_m=8))
    _upsert(st, 0, 300, 1, V)
    while st.background_step():
        pass
    d, q = st.store.dense, V[11] + 0.1 * V[350]
    rows = np.array([0, 5, 250, 299, 7], np.int64)
    mat, pos = d.vectors_for(rows)
    assert mat.shape[0] == 300 and np.array_equal(pos, rows)  # nothing deferred or dead: the view
    _upsert(st, 300, 400, 2, V)  # deferred
    st.store.delete(["d3"], 3)  # and a dead id
    assert d.pending == 100 and len(d) == 399
    rows = np.array([0, 5, 298, 350, 398, 2], np.int64)
    mat, pos = d.vectors_for(rows)
    assert mat.shape == (rows.size, D) and np.array_equal(mat[pos], d.vectors[rows])
    np.testing.assert_array_equal(st.search._canonical(q, rows), fixed_order_dot(d.vectors[rows], q))
    while st.background_step():
        pass
    mat, pos = d.vectors_for(rows)  # the dead id remains: the graph's storage, read at the rows' ANN ids (no copy)
    assert d.pending == 0 and mat.shape == (400, D) and np.array_equal(mat[pos], d.vectors[rows])
    np.testing.assert_array_equal(st.search._canonical(q, rows), fixed_order_dot(d.vectors[rows], q))


def test_damaged_deferred_vectors_stop_the_start_naming_the_file(tmp_path):
    """trial58b #1: a byte flipped in ``dense_tail.npy`` (the HNSW vectors not yet in the graph, their only copy) was
    loaded and served without a word; its CRC-32 is in meta.json now."""
    V = _clustered(400, seed=8)
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw", hnsw_m=8))
    st.load(set())
    _upsert(st, 0, 400, 1, V)
    assert st.store.dense.pending == 400
    st.snapshot()
    snap = next((tmp_path / "shard-0").glob("snap-*"))
    p = snap / "dense_tail.npy"
    b = bytearray(p.read_bytes())
    b[-100] ^= 0x10  # a vector's byte: still a valid .npy file
    p.write_bytes(bytes(b))
    for kind in ("hnsw", "flat"):  # (flat reads the tail too, with the graph's vectors)
        with pytest.raises(RuntimeError, match="dense_tail.npy: its CRC-32 is"):
            ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind, hnsw_m=8)).load(set())
