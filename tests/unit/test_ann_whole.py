"""HNSW / IVF shards that their list check's sample holds whole (at most ``--ann-check`` chunks):
the check covers every place of a dense list and the dense minimum is read exactly from the
sample, so a certified hybrid reply is exact mode's (``full_hybrid``) bit for bit, fused scores
included, as with a flat index (trial39 #1: an HNSW at its default knobs on ~1,850-chunk shards
certified top-50s whose fused scores, and so order, differed from exact mode's: its ``-q`` walk
had missed the dense minimum; IVF at ``nprobe`` 1 likewise).

Real shards in process (FAISS HNSW / IVF), two corpus families from test_lexical_list and queries
built three ways (a random vector and a random word; near a cluster with the family's common
text; text only with a vector near no chunk)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from oprag_server.config import BM25Config, RetrievalConfig
from oprag_server.index.analyzer import Analyzer
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.inprocess import in_process_pool

from test_lexical_list import DIM, _build, _key, _unit, background_tie, boilerplate_tie


def _queries(rng, centre, docs, text):
    words = sorted({w for _, t, _ in docs for w in t.split()})
    out = []
    for i in range(24):
        how = i % 3
        if how == 0:
            out.append((_unit(rng.normal(size=DIM)), str(rng.choice(words))))
        elif how == 1:
            out.append((_unit(centre + 0.2 * rng.normal(size=DIM)), text))
        else:
            out.append((_unit(-centre + 0.5 * rng.normal(size=DIM)), " ".join(rng.choice(words, size=2))))
    return out


@pytest.mark.parametrize("kind,knob", [("hnsw", {}), ("hnsw", {"ef_search": 16}), ("ivf", {"nprobe": 1})])
@pytest.mark.parametrize("family", ["background", "boilerplate"])
def test_a_shard_the_sample_holds_whole_answers_as_exact_mode(kind, knob, family, monkeypatch):
    rng = np.random.default_rng(11 if family == "background" else 12)
    docs, centre = background_tie(rng) if family == "background" else boilerplate_tie(rng)
    text = "synthetic vector" if family == "background" else "terms of service"
    from oprag_server.config import DenseConfig
    import test_lexical_list

    monkeypatch.setattr(test_lexical_list, "DenseConfig",
                        lambda **kw: DenseConfig(**{**kw, "ann_check": DenseConfig.ann_check}))  # (the default check)
    shards, stats = _build(docs, 2, kind)
    r = Retriever(in_process_pool(shards, copy=True), stats, Analyzer(), BM25Config(), RetrievalConfig())
    certified = 0
    for i, (qv, t) in enumerate(_queries(rng, centre, docs, text)):
        for k in (10, 50):
            specs = [RetrieveSpec(mode="hybrid", top_k=k, **knob), RetrieveSpec(mode="full_hybrid", top_k=k)]
            hits, _, infos = asyncio.run(r.retrieve(np.stack([qv, qv]), [t, t], specs))
            assert (infos[0].ef_search, infos[0].nprobe) == (0, 0)  # (no index searched: the README's sign of it)
            if infos[0].certified:
                certified += 1
                assert _key(hits[0]) == _key(hits[1]), (kind, knob, family, i, k)
    assert certified >= 24, certified


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_the_dense_top_and_minimum_are_exact_through_deletes_and_new_chunks(kind):
    """Ranked from the sample (no index search): the top-n and the dense minimum equal a flat
    shard's over the same live chunks, bit for bit, after deletes (the draw's removed chunks are
    skipped) and after chunks written since the draw (sampled as they come, every one here)."""
    from oprag_server.config import DenseConfig
    from oprag_server.index.dense import fixed_order_dot
    from oprag_server.shards.state import ShardState

    rng = np.random.default_rng(5)
    docs, centre = background_tie(rng, n=900)
    built = {k: ShardState(0, DIM, None, dense=DenseConfig(kind=k, hnsw_m=8, train_min=100)) for k in (kind, "flat")}
    for sh in built.values():
        _fill(sh, docs[:600])
    qv = _unit(np.concatenate([centre + 0.3 * rng.normal(size=(6, DIM)), rng.normal(size=(6, DIM))]))
    for step in ("drawn", "deleted", "added"):
        if step == "deleted":
            for sh in built.values():
                sh.store.delete([d for d, *_ in docs[:600:50]], 2)  # (12: less than 1/16, no new draw)
        if step == "added":
            for sh in built.values():
                _fill(sh, docs[600:620], seq=3)
        got = built[kind].search._dense_tops(qv, list(range(len(qv))), 40)
        ck = built[kind].search._check
        assert ck.whole() and ck.members().size == len(built[kind].store.dense)  # (every live chunk)
        want = built["flat"].search._dense_tops(qv, list(range(len(qv))), 40)
        for i in range(len(qv)):
            assert list(built[kind].store.ids(got[i][0])) == list(built["flat"].store.ids(want[i][0])), (step, i)
            np.testing.assert_array_equal(got[i][1], want[i][1])
        lows = built[kind].search._ann_lows(qv, list(range(len(qv))), 0, 0)
        V = built["flat"].store.dense.vectors
        assert lows == [float(fixed_order_dot(V, x).min()) for x in qv], step


def _fill(sh, rows, seq=1):
    import hashlib

    import pyarrow as pa

    from oprag_server import records

    batch = records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d, *_ in rows], doc_ids=[r[0] for r in rows], titles=["" for _ in rows],
        texts=[r[1] for r in rows], metadata=[{} for _ in rows], ordinals=[0] * len(rows),
        generations=[seq] * len(rows), content_hashes=[hashlib.sha256(r[0].encode()).hexdigest() for r in rows],
        vectors=np.stack([r[2] for r in rows]))
    sh.store.upsert(pa.Table.from_batches([batch]), seq)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_a_shard_deletes_bring_down_to_the_sample_size_is_drawn_whole_again(kind):
    """trial39b: a shard drawn at 516 chunks with a 500-chunk sample (1 in 1.03), then brought to 500 by deletes
    (under 1/16: no new draw), kept its partial sample and answered from its index, approximately, although it now
    held no more than ``--ann-check`` chunks. It is drawn again whole and ranked exactly."""
    from oprag_server.config import DenseConfig
    from oprag_server.index.dense import fixed_order_dot
    from oprag_server.shards.state import ShardState

    rng = np.random.default_rng(8)
    docs, centre = background_tie(rng, n=504)
    built = {k: ShardState(0, DIM, None, dense=DenseConfig(kind=k, hnsw_m=8, train_min=100, ann_check=500))
             for k in (kind, "flat")}
    for sh in built.values():
        _fill(sh, docs)  # 516 chunks
    qv = _unit(rng.normal(size=(6, DIM)))
    built[kind].search._dense_tops(qv, list(range(6)), 20)
    assert not built[kind].search._check.whole()
    for sh in built.values():
        sh.store.delete([d for d, *_ in docs[:16]], 2)  # 500 chunks: less than 1/16 fewer
    got = built[kind].search._dense_tops(qv, list(range(6)), 20)
    assert built[kind].search._check.whole()
    want = built["flat"].search._dense_tops(qv, list(range(6)), 20)
    for i in range(6):
        assert list(built[kind].store.ids(got[i][0])) == list(built["flat"].store.ids(want[i][0]))
    V = built["flat"].store.dense.vectors
    assert built[kind].search._ann_lows(qv, list(range(6)), 0, 0) == [float(fixed_order_dot(V, x).min()) for x in qv]


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_the_compiled_whole_top_is_the_numpy_one(kind):
    """A whole sample ranks each query in one compiled call (``SampleCheck._top_fast``: the flat kernel over the
    sample's int8 scores, canonical scores read from the index's own rows); it must give the numpy path's top-n, scores
    and tie order, and its exact minimum. Queries three ways (near a cluster, random, opposite the cluster), duplicated
    vectors (ties broken by chunk id), n from 1 to more than the shard; HNSW with every vector in the graph (with
    vectors waiting outside it or dead ids the compiled path declines: checked too)."""
    from oprag_server.config import DenseConfig
    from oprag_server.index.dense import fixed_order_dot
    from oprag_server.index.fusion import _Take, refine_top
    from oprag_server.shards import ann_check
    from oprag_server.shards.state import ShardState

    rng = np.random.default_rng(21)
    docs, centre = background_tie(rng, n=700)
    docs = docs + [(f"dup{i}", docs[i][1], docs[i][2]) for i in range(0, 60, 3)]  # (equal vectors: ties)
    sh = ShardState(0, DIM, None, dense=DenseConfig(kind=kind, hnsw_m=8, train_min=100))
    _fill(sh, docs)
    dense = sh.store.dense
    dense.insert_pending()
    qv = _unit(np.concatenate([centre + 0.3 * rng.normal(size=(5, DIM)), rng.normal(size=(5, DIM)),
                               -centre + 0.4 * rng.normal(size=(5, DIM))]))
    ck = ann_check.check_of(sh.search)
    assert ck.tops(sh.search, qv, [0], 10) is not None and ck.whole()
    ids, (sl, i8, live) = sh.store._slot_ids, ck._part(sh.search, True)
    sl = sl[live]
    V = dense.vectors
    for i, q in enumerate(qv):
        for n in (1, 10, 64, len(dense) + 5):
            fast = ck._top_fast(dense, ids, q, n)
            assert fast is not None, (kind, i, n)
            pos, ex = refine_top(ck._scores(q)[live].astype(np.float64), float(i8.error(q)),
                                 lambda p: dense.exact_slots(q, sl[p]), _Take(ids, sl), n)
            assert list(sh.store.ids(fast[0])) == list(sh.store.ids(sl[pos])), (kind, i, n)
            np.testing.assert_array_equal(fast[1], ex)
        assert ck._lows[q.tobytes()] == float(fixed_order_dot(V, q).min())
    assert ck.lows(sh.search, qv, list(range(len(qv)))) == [float(fixed_order_dot(V, q).min()) for q in qv]
    sh.store.delete([d for d, *_ in docs[:40:3]], 2)  # (HNSW: dead ids in the graph's storage, read past)
    assert ck._part(sh.search, True) is not None
    sl = ck._rows.slots[ck._live]
    live_v = dense.vectors
    for i, q in enumerate(qv):
        fast = ck._top_fast(dense, ids, q, 10)
        assert fast is not None, (kind, i)
        pos, ex = refine_top(ck._scores(q)[ck._live].astype(np.float64), float(i8.error(q)),
                             lambda p: dense.exact_slots(q, sl[p]), _Take(ids, sl), 10)
        assert list(sh.store.ids(fast[0])) == list(sh.store.ids(sl[pos])) and fast[1].tobytes() == ex.tobytes()
        assert ck._lows[q.tobytes()] == float(fixed_order_dot(live_v, q).min())
    if kind == "hnsw":  # (vectors deferred outside the graph: no view of every row; the numpy path answers)
        _fill(sh, [(f"late{i}", "late text", _unit(rng.normal(size=DIM))) for i in range(5)], seq=3)
        assert dense.pending and ck._part(sh.search, True) is not None and ck._top_fast(dense, ids, qv[0], 10) is None
    got = ck.tops(sh.search, qv, list(range(len(qv))), 10)
    live_v = dense.vectors
    for i, q in enumerate(qv):
        assert got[i][1][0] == float(fixed_order_dot(live_v, q).max())
