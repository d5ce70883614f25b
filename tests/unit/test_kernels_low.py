"""The dense minimum's bottom-layer search on an int8 copy (index/kernels_low.py, dense_low.Int8Graph).

* The walk is FAISS's ``search_level_0`` walk: on vectors whose int8 copy is exact (integer codes
  times a power of two, one coordinate at 127) and a query of small dyadic values, every score is
  exact in both, so the lowest score found must equal FAISS's from the same entries, beam and graph.
* The refinement window is sound: over random and clustered unit vectors (two different ways to
  build them), the lowest canonical score among the candidates ``LowSeeds.candidates`` returns
  equals the lowest canonical score over all the seeds and everything the walk kept (computed in
  float64 directly, no int8 involved); no window at all
  (trusting the int8 order) loses it.
* The int8 copy followed row block by row block equals one quantisation of every row.
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import kernels_low, kernels_scan
from oprag_server.index.ann import AnnIndex
from oprag_server.index.dense import fixed_order_dot
from oprag_server.index.dense_low import Int8Graph, LowSeeds, _level0

DIM = 32


@pytest.fixture(autouse=True)
def _seeds_in_the_query(monkeypatch):
    """The seeds built where they are first needed, whatever the graph's size (these tests check what they find;
    tests/unit/test_seeds_refresh.py checks the thread that makes them from LowSeeds.REFRESH_MIN vectors)."""
    monkeypatch.setattr(LowSeeds, "REFRESH_MIN", 1 << 62)


def _ann(vecs, m=8):
    ann = AnnIndex(DIM, DenseConfig(kind="hnsw", hnsw_m=m, ef_construction=40))
    slots = np.arange(len(vecs), dtype=np.int64)
    ann.add(slots, vecs, (slots, vecs))
    return ann


def _faiss_lowest(ann, q, entries, ef):
    """FAISS's ``search_level_0`` (search_type 1, k = 1) for ``-q`` from ``entries``: the lowest
    ``q . v`` it finds (what dense_low did before the int8 walk)."""
    nq = np.ascontiguousarray(-q[None], np.float32)
    st = ann.storage()
    ent = np.ascontiguousarray(entries[None], np.int32)
    dist = np.ascontiguousarray((st[entries] @ q)[None], np.float32)  # -(-q . v)
    out_d, out_i = np.empty((1, 1), np.float32), np.full((1, 1), -1, np.int64)
    ann._index.search_level_0(1, faiss.swig_ptr(nq), 1, faiss.swig_ptr(ent), faiss.swig_ptr(dist),
                              faiss.swig_ptr(out_d), faiss.swig_ptr(out_i), entries.size, 1, ann._hnsw_params(ef))
    return float(st[out_i[0, 0]] @ q)


@pytest.mark.parametrize("seed", [0, 1])
def test_walk_is_faiss_search_level_0(seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, size=(4000, DIM))
    codes[np.arange(4000), rng.integers(DIM, size=4000)] = 127  # scale exactly 2^-7
    vecs = (codes * 2.0 ** -7).astype(np.float32)
    ann = _ann(vecs)
    g = Int8Graph()
    g.follow(ann.storage(), rebuild=True)
    assert np.array_equal(g.codes[:4000], codes) and (g.scale[:4000] == np.float32(2.0 ** -7)).all()
    nbr, off, width = _level0(ann._index)
    for ef in (8, 16, 32):
        same = 0
        for _ in range(30):
            q = (rng.integers(-300, 301, size=DIM) * 2.0 ** -8).astype(np.float32)
            ent = np.argsort(vecs @ q, kind="stable")[rng.integers(200, 1000, size=4)].astype(np.int64)
            oi, od = np.empty(ef, np.int64), np.empty(ef, np.float32)
            k = kernels_low.low_search(nbr, off, width, g.codes, g.scale, ann.ann_slot, q, ent, ef, g.stamp,
                                       g.next_mark(), oi, od)
            assert k == ef and np.array_equal(od[:k], (vecs[oi[:k]] @ q).astype(np.float32))  # exact here
            same += float(od[:k].min()) == _faiss_lowest(ann, q, ent, ef)
        assert same == 30, (ef, same)


def _clustered(rng, n):
    c = rng.normal(size=(24, DIM))
    v = c[rng.integers(24, size=n)] + 0.5 * rng.normal(size=(n, DIM))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _random(rng, n):
    v = rng.standard_t(3, size=(n, DIM))  # heavy tails: rows with a large coordinate (coarse int8)
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("make", [_clustered, _random])
def test_candidates_hold_the_lowest_canonical_score_kept(make, monkeypatch):
    rng = np.random.default_rng(7)
    vecs = make(rng, 5000)
    ann = _ann(vecs)
    low = LowSeeds()
    kept = []
    walk = kernels_low.low_search

    def spy(*a):  # record what the walk kept
        k = walk(*a)
        kept.append(a[11][:k].copy())
        return k

    monkeypatch.setattr(kernels_low, "low_search", spy)
    qs = (vecs[rng.integers(5000, size=150)] + 0.3 * rng.normal(size=(150, DIM))).astype(np.float32)
    qs /= np.linalg.norm(qs, axis=1, keepdims=True)
    cands = low.candidates(ann, qs)
    assert len(kept) == 150
    st = ann.storage()
    narrow = 0
    for q, c, pool in zip(qs, cands, kept):
        every = np.union1d(low._ids, pool)
        full = fixed_order_dot(st[every], q)
        assert float(fixed_order_dot(st[c], q).min()) == float(full.min())
        # trusting the int8 order (no window) would lose the minimum sometimes: the test can tell
        s8 = kernels_scan.scan(low._g.codes, low._g.scale, q, np.empty(low._g.n, np.float32))[every]
        tight = every[s8 == s8.min()]
        narrow += float(fixed_order_dot(st[tight], q).min()) != float(full.min())
    assert narrow > 0, narrow


def test_int8_copy_followed_in_blocks_equals_one_quantisation():
    rng = np.random.default_rng(3)
    vecs = _random(rng, 3000)
    g = Int8Graph()
    for a in (0, 1000, 1001, 2500, 3000):
        g.follow(vecs[:a], rebuild=False)
    whole_c, whole_s = np.empty((3000, DIM), np.int8), np.empty(3000, np.float32)
    e, c = kernels_scan.quantize(vecs, whole_c, whole_s)
    assert g.n == 3000 and np.array_equal(g.codes[:3000], whole_c) and np.array_equal(g.scale[:3000], whole_s)
    assert (g.e, g.c) == (e, c)
    g.follow(vecs[:2000], rebuild=True)  # a new graph: requantised from scratch
    assert g.n == 2000 and g.codes.shape[0] == 2000 and np.array_equal(g.codes, whole_c[:2000])



def test_visited_marks_wrap_without_changing_results():
    """The byte-wide visited marks are cleared every 255 walks: 600 walks (different queries and
    entries) sharing the marks keep the same vectors as each walk on fresh marks (a stale mark
    would hide vectors from a later walk)."""
    rng = np.random.default_rng(5)
    vecs = _clustered(rng, 3000)
    ann = _ann(vecs)
    g = Int8Graph()
    g.follow(ann.storage(), rebuild=True)
    nbr, off, width = _level0(ann._index)

    def walk(q, ent, stamp, mark):
        oi, od = np.empty(32, np.int64), np.empty(32, np.float32)
        k = kernels_low.low_search(nbr, off, width, g.codes, g.scale, ann.ann_slot, q, ent, 32, stamp, mark, oi, od)
        return sorted(oi[:k].tolist())

    for i in range(600):
        q, ent = vecs[rng.integers(3000)].copy(), rng.integers(3000, size=4).astype(np.int64)
        assert walk(q, ent, g.stamp, g.next_mark()) == walk(q, ent, np.zeros(3000, np.uint8), 1), i
    assert 1 <= g.mark <= 255
    g.stamp[:] = np.arange(3000) % 256  # every mark in use: the next wrap must clear them all
    while g.mark != 255:
        g.next_mark()
    assert g.next_mark() == 1 and not g.stamp.any()


@pytest.mark.parametrize("dim", [1, 33, 384])
def test_prefetching_canonical_rows_equals_the_canonical_scores(dim):
    """``kernels_low.canonical_rows`` (the next row prefetched) gives ``fixed_order_dot``'s values
    bit for bit, rows in any order and repeated."""
    rng = np.random.default_rng(dim)
    v = rng.normal(size=(500, dim)).astype(np.float32)
    q = rng.normal(size=dim).astype(np.float32)
    rows = np.concatenate([rng.permutation(500), [7, 7, 499, 0]]).astype(np.int64)
    got = kernels_low.canonical_rows(v, rows, q)
    assert np.array_equal(got, fixed_order_dot(v[rows], q))
    assert kernels_low.canonical_rows(v, np.zeros(0, np.int64), q).size == 0
