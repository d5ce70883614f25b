"""Approximate dense indexes (HNSW, IVF) behind the same shard interface as the flat one:
candidates found with high recall on clustered vectors, deleted chunks never returned, the knobs
used reported, canonical scores unchanged, the structure saved in snapshots and loaded (not
rebuilt) on start."""

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


def _clustered(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((16, D))
    v = centres[rng.integers(0, 16, n)] + 0.6 * rng.standard_normal((n, D))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _recall(idx: DenseIndex, flat: DenseIndex, q: np.ndarray, k: int, **kw) -> float:
    got, _ = idx.search(q, k, **kw)
    want, _ = flat.search(q, k)
    return float(np.mean([len(set(g.tolist()) & set(w.tolist())) / k for g, w in zip(got, want)]))


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_recall_knobs_and_deletes(kind):
    V = _clustered(3000)
    slots = np.arange(3000, dtype=np.int64) * 3 + 7  # sparse slots, not row numbers
    cfg = DenseConfig(kind=kind, hnsw_m=16, ef_construction=80, ef_search=64, nprobe=8, train_min=1000)
    idx, flat = DenseIndex(D, cfg), DenseIndex(D)
    for part in np.array_split(np.arange(3000), 3):  # IVF: untrained, trained at 1,000, then adds
        idx.add(slots[part], V[part])
        flat.add(slots[part], V[part])
    q = _clustered(50, seed=1)
    assert _recall(idx, flat, q, 10) >= 0.9
    knob = "ef_search" if kind == "hnsw" else "nprobe"
    idx.search(q, 10, **{knob: 100})
    assert idx.last_knobs == {knob: 100 if kind == "hnsw" else min(100, idx._ann._index.nlist)}
    gone = flat.search(q[:5], 20)[0]
    dead = np.unique(np.concatenate(gone))
    idx.remove(dead)
    flat.remove(dead)
    got, _ = idx.search(q, 20)
    assert not set(np.concatenate(got).tolist()) & set(dead.tolist())  # never returned
    assert all(g.size == 20 for g in got)  # still k live results
    assert _recall(idx, flat, q, 10) >= 0.85


def test_ivf_searches_exactly_until_trained():
    V = _clustered(100)
    idx = DenseIndex(D, DenseConfig(kind="ivf", train_min=500))
    idx.add(np.arange(100), V)
    flat = DenseIndex(D)
    flat.add(np.arange(100), V)
    q = _clustered(5, seed=2)
    assert [g.tolist() for g in idx.search(q, 7)[0]] == [g.tolist() for g in flat.search(q, 7)[0]]
    assert idx.last_knobs == {}


def test_hnsw_compacts_after_many_deletes():
    V = _clustered(400)
    idx = DenseIndex(D, DenseConfig(kind="hnsw"))
    idx.add(np.arange(400), V)
    idx.remove(np.arange(150))  # over a quarter dead: rebuilt from the live vectors
    assert idx._ann.dead == 0 and idx._ann.ann_slot.size == 250
    got, _ = idx.search(V[:10], 5)
    assert all((g >= 150).all() for g in got)


def _state(kind: str, data_dir, n: int = 600) -> ShardState:
    # (ann_check 0: a shard the check's sample holds whole is ranked from it, not by its index: ann_check.whole_tops)
    st = ShardState(0, D, data_dir, dense=DenseConfig(kind=kind, train_min=200, ann_check=0))
    st.load(set())
    V = _clustered(n, seed=3)
    texts = [f"chunk {i} about topic {i % 7}" for i in range(n)]
    batch = records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(n)], doc_ids=[f"d{i}" for i in range(n)], titles=[""] * n, texts=texts,
        metadata=[{}] * n, ordinals=[0] * n, generations=[1] * n,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts], vectors=V)
    st.store.upsert(pa.Table.from_batches([batch]), 1)
    return st


def _search(st: ShardState, q: np.ndarray):
    rep = st.search.search(SearchRequest(QueryBatch(q, [["topic"]] * len(q), [np.ones(1)] * len(q), 5.0, 1.5, 0.75,
                                                    None), "dense", 10))
    return rep, [(c.chunk_ids, c.dense.tolist()) for c in rep.candidates]


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_snapshot_keeps_the_structure_and_scores_stay_canonical(kind, tmp_path):
    st = _state(kind, tmp_path)
    st.store.delete(["d3", "d10"], 2)
    q = _clustered(8, seed=4)
    rep, before = _search(st, q)
    assert rep.dense_index == kind and rep.knobs
    flat = _state("flat", None)
    flat.store.delete(["d3", "d10"], 2)
    for (ids, dense), (fids, fdense) in zip(before, _search(flat, q)[1]):
        common = set(ids) & set(fids)  # found by both: bit-identical canonical scores
        assert len(common) >= 8
        assert {i: s for i, s in zip(ids, dense) if i in common} == {i: s for i, s in zip(fids, fdense) if i in common}
    st.snapshot()
    saved = (tmp_path / "shard-0").glob("snap-*/dense.faiss")
    assert next(saved).stat().st_size > 0
    again = ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind, train_min=200, ann_check=0))
    calls = []
    again.store.dense.compact_ann = lambda: calls.append(1)  # a rebuild would be a failure here
    again.load(set())
    assert not calls
    _, after = _search(again, q)
    assert after == before  # same candidates, same scores, after the slots were renumbered
    assert not any(c in ("d3#0", "d10#0") for ids, _ in after for c in ids)


def test_hnsw_default_build_parameters_are_used_and_beat_a_narrow_build():
    """The defaults (M 32, efConstruction 80, ef_search 512, config.DenseConfig) are what the FAISS
    graph is built with; on hard clustered vectors (32-wide, much noise) the default build finds
    >= 0.9 of the exact top-50 and efConstruction 16 at least 0.1 less (measured at 56: 0.84 vs
    0.69 with FAISS's random levels; with levels by ANN id, session 46: 0.977 vs 0.778)."""
    cfg = DenseConfig(kind="hnsw")
    assert (cfg.hnsw_m, cfg.ef_construction, cfg.ef_search) == (32, 80, 512)
    V, q = _clustered(20000, seed=5), _clustered(40, seed=6)
    flat = DenseIndex(D)
    flat.add(np.arange(20000), V)
    got = {}
    for efc in (80, 16):
        idx = DenseIndex(D, DenseConfig(kind="hnsw", ef_construction=efc) if efc != 80 else cfg)
        for part in np.array_split(np.arange(20000), 10):
            idx.add(part, V[part])
        assert idx._ann._index.hnsw.efConstruction == efc
        got[efc] = _recall(idx, flat, q, 50)
    assert got[80] >= 0.9 and got[16] < got[80] - 0.1


def test_a_graph_built_with_other_parameters_is_kept_and_said(tmp_path):
    """trial36: a restart with new --hnsw-m / --ef-construction kept the saved graph silently."""
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=20))
    st.load(set())
    V = _clustered(300, seed=9)
    texts = [f"chunk {i}" for i in range(300)]
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(300)], doc_ids=[f"d{i}" for i in range(300)], titles=[""] * 300,
        texts=texts, metadata=[{}] * 300, ordinals=[0] * 300, generations=[1] * 300,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts], vectors=V)]), 1)
    st.snapshot()
    for cfg, warned in ((DenseConfig(kind="hnsw"), True), (DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=20), False)):
        again, lines = ShardState(0, D, tmp_path, dense=cfg), []
        again.say = lines.append
        again.load(set())
        said = [x for x in lines if "--hnsw-m 8 --ef-construction 20, not 32 / 80" in x]
        assert bool(said) == warned, lines


def test_ivf_lists_hold_8bit_codes_and_the_float32_copy_ranks_them():
    """Session 37: the IVF's lists hold D-byte codes (not a second float32 copy), and what a
    search returns is ranked by the float32 copy: its scores are the float32 inner products of
    the returned slots, descending, and its top-10 equals the exact one at nprobe = every list."""
    import faiss

    V = _clustered(3000, seed=5)
    idx = DenseIndex(D, DenseConfig(kind="ivf", nprobe=4, train_min=1000))
    idx.add(np.arange(3000, dtype=np.int64), V)
    assert isinstance(idx.ann._index, faiss.IndexIVFScalarQuantizer) and idx.ann._index.code_size == D
    q = _clustered(20, seed=6)
    got, sc = idx.search(q, 10)
    for i in range(20):
        np.testing.assert_allclose(sc[i], V[got[i]] @ q[i], rtol=0, atol=1e-6)  # float32 products, not 8-bit ones
        assert np.all(np.diff(sc[i]) <= 0)
    every, _ = idx.search(q, 10, nprobe=idx.ann.nlist)
    flat = DenseIndex(D)
    flat.add(np.arange(3000, dtype=np.int64), V)
    want, _ = flat.search(q, 10)
    assert [g.tolist() for g in every] == [w.tolist() for w in want]


def test_an_ivfflat_snapshot_still_loads_and_searches(tmp_path):
    """A data dir saved before session 37 holds ``IndexIVFFlat`` lists: it loads as it is (no
    retraining) and gives the same hits as the lists built now."""
    import faiss

    st = _state("ivf", tmp_path)
    ann = st.store.dense.ann
    old = faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, ann._index.nlist, faiss.METRIC_INNER_PRODUCT)
    old.train(st.store.dense.vectors)  # the same vectors, in ANN-id order (one add of 600)
    old.add_with_ids(st.store.dense.vectors, np.arange(ann.ann_slot.size, dtype=np.int64))
    ann._index = old
    q = _clustered(8, seed=7)
    _, before = _search(st, q)
    st.snapshot()
    again = ShardState(0, D, tmp_path, dense=DenseConfig(kind="ivf", train_min=200))
    again.load(set())
    assert isinstance(again.store.dense.ann._index, faiss.IndexIVFFlat)
    assert again.store.dense.ann.nbytes() >= 600 * (4 * D + 8)
    assert _search(again, q)[1] == before


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_a_restart_after_deletes_gives_the_same_approximate_answers(kind, tmp_path):
    """trial37 #1: after deletes (a removal moves the last row into the hole) a restart reloads the
    rows in slot order; the dense-minimum sample and the list check's sample were strided by row
    position, so they changed, and with them IVF's answers at a low nprobe (9 of 90 hybrid
    queries). Both samples now go by slot order: the same chunks from the same live chunks."""
    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind, train_min=200, nprobe=1, ef_search=8,
                                                        ann_check=64))
    st.load(set())
    n, V = 3000, _clustered(3000, seed=8)
    texts = [f"chunk {i} about topic {i % 7}" for i in range(n)]
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(n)], doc_ids=[f"d{i}" for i in range(n)], titles=[""] * n, texts=texts,
        metadata=[{}] * n, ordinals=[0] * n, generations=[1] * n,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts], vectors=V)]), 1)
    st.store.delete([f"d{i}" for i in range(0, n, 3)], 2)  # a third, spread over the rows
    rng = np.random.default_rng(9)
    q = np.concatenate([_clustered(12, seed=10), _unit_rows(rng.standard_normal((12, D)))])

    def answers(state):
        out = []
        for mode in ("dense", "hybrid"):
            rep = state.search.search(SearchRequest(QueryBatch(q, [["topic"]] * len(q), [np.ones(1)] * len(q), 5.0,
                                                               1.5, 0.75, None), mode, 10, m=16 if mode == "hybrid" else 0))
            out.append(([(c.chunk_ids, c.dense.tolist()) for c in rep.candidates], rep.dense_min))
        return out

    before = answers(st)
    st.snapshot()
    again = ShardState(0, D, tmp_path, dense=DenseConfig(kind=kind, train_min=200, nprobe=1, ef_search=8,
                                                           ann_check=64))
    again.load(set())
    assert not np.array_equal(again.store.dense.slots, st.store.dense.slots)  # renumbered, and the rows in slot order
    assert answers(again) == before


def _unit_rows(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
