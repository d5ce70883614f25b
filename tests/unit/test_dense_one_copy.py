"""HNSW keeps one copy of the vectors (issue 13): exact scores, canonical scores and snapshots
read the graph's own storage through a zero-copy view, with the same results as a flat index;
a snapshot keeps the vectors once (in ``dense.faiss``) and loads them back, also into a shard
of another index kind."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import DenseConfig
from oprag_server.index.dense import DenseIndex
from oprag_server.shards.protocol import QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

D = 32


def _vecs(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((8, D))[rng.integers(0, 8, n)] + 0.5 * rng.standard_normal((n, D))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def test_hnsw_reads_its_graph_storage_and_matches_flat():
    V = _vecs(500)
    slots = np.arange(500, dtype=np.int64) * 2 + 1
    h, f = DenseIndex(D, DenseConfig(kind="hnsw", hnsw_m=8)), DenseIndex(D)
    for part in np.array_split(np.arange(500), 4):
        h.add(slots[part], V[part])
        f.add(slots[part], V[part])
    dead = slots[::7]
    h.remove(dead)
    f.remove(dead)
    assert h.nbytes()["vectors"] < 500 * D * 4 + 500 * 8 * 4  # the graph's storage, no second copy
    assert h._vecs.size == 0
    storage = h._ann.storage()
    assert storage.shape == (500, D) and np.shares_memory(storage, h._ann.storage())
    q = _vecs(3, seed=1)
    order = np.argsort(f.slots)
    horder = np.argsort(h.slots)
    assert np.array_equal(h.slots[horder], f.slots[order])
    # every vector, and every canonical score, is the same as the flat index's
    assert np.array_equal(h.vectors[horder], f.vectors[order])
    probe = f.slots[order][::5]
    assert np.array_equal(h.vectors_of(probe), f.vectors_of(probe))
    assert np.array_equal(h.exact_slots(q[0], probe), f.exact_slots(q[0], probe))
    assert np.array_equal(h.exact_rows(q[0], h.rows(probe)), f.exact_slots(q[0], probe))
    assert np.allclose(h.score_all(q)[:, horder], f.score_all(q)[:, order], atol=1e-5)
    with pytest.raises(KeyError):
        h.vectors_of(dead[:1])
    got, _ = h.search(q, 10)
    assert not set(np.concatenate(got).tolist()) & set(dead.tolist())


def _shard(kind: str, data_dir, n: int = 400) -> ShardState:
    st = ShardState(0, D, data_dir, dense=DenseConfig(kind=kind, hnsw_m=8, train_min=100))
    st.load(set())
    V = _vecs(n, seed=3)
    texts = [f"chunk {i} topic {i % 5}" for i in range(n)]
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(n)], doc_ids=[f"d{i}" for i in range(n)], titles=[""] * n,
        texts=texts, metadata=[{}] * n, ordinals=[0] * n, generations=[1] * n,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts], vectors=V)]), 1)
    return st


def _dense(st: ShardState, q: np.ndarray):
    rep = st.search.search(SearchRequest(QueryBatch(q, [["topic"]] * len(q), [np.ones(1)] * len(q), 5.0, 1.5, 0.75,
                                                    None), "dense", 10))
    return [dict(zip(c.chunk_ids, c.dense.tolist())) for c in rep.candidates]


@pytest.mark.parametrize("reader", ["hnsw", "flat", "ivf"])
def test_hnsw_snapshot_keeps_the_vectors_once(reader, tmp_path):
    st = _shard("hnsw", tmp_path)
    st.store.delete(["d5", "d9"], 2)
    st.snapshot()
    snap = next((tmp_path / "shard-0").glob("snap-*"))
    table = records.from_ipc((snap / "chunks.arrow").read_bytes())
    assert "vector" not in table.column_names and table.num_rows == 398  # only in dense.faiss
    again = ShardState(0, D, tmp_path, dense=DenseConfig(kind=reader, hnsw_m=8, train_min=100))
    again.load(set())
    want = st.store.dense.vectors_of(np.arange(400)[np.isin(np.arange(400), [5, 9], invert=True)])
    # slots were renumbered 0..397 in the old slot order
    assert np.array_equal(again.store.dense.vectors_of(np.arange(398)), want)
    q = _vecs(4, seed=5)
    flat = _shard("flat", None)
    flat.store.delete(["d5", "d9"], 2)
    for got, ref in zip(_dense(again, q), _dense(flat, q)):
        common = set(got) & set(ref)
        assert len(common) >= 8 and all(got[c] == ref[c] for c in common)  # canonical, bit-identical
