"""The sample check of an HNSW dense list and the wider search it asks for (shards/ann_check.py).

A sparse graph (M 4, efConstruction 16) over clustered vectors, searched with a narrow beam for
queries far from every cluster, misses most of the exact top-10 (recall ~0.2): the walks go astray
as they do for keyword and nonword queries on the 1M bench corpus. What must hold: the check never
calls an exact list incomplete, a list it calls incomplete really misses a chunk of the exact top,
the widened lists recover most of the exact top, the beam used is reported, and a query near the
corpus is not widened. Two ways of making the queries: random directions, and sums of far-apart
chunks (between clusters).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import DenseConfig
from oprag_server.index.dense import fixed_order_dot
from oprag_server.shards import ann_check
from oprag_server.shards.protocol import QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

from tests.unit.test_dense_low import DIM, _mins, _shard, _unit, clustered

N = 10


@pytest.fixture(scope="module")
def sparse():
    rng = np.random.default_rng(0)
    vecs = clustered(rng, 20000)
    sh = ShardState(0, DIM, None, dense=DenseConfig(kind="hnsw", hnsw_m=4, ef_construction=16, ann_tail=0))
    _shard(vecs, sh=sh)
    return sh, vecs


def _queries(how, vecs, rng, n=60):
    if how == "random":
        return _unit(rng.normal(size=(n, DIM)))
    a, b = vecs[rng.integers(len(vecs), size=n)], vecs[rng.integers(len(vecs), size=n)]
    return _unit(a + b)


def _exact_top(sh, x, k):
    d = sh.store.dense
    return d.slots[np.argsort(-fixed_order_dot(d.vectors, x), kind="stable")[:k]]


def _recall(sh, qv, out):
    return float(np.mean([len(set(_exact_top(sh, qv[i], N).tolist()) & set(s[:N].tolist())) / N
                          for i, (s, _) in out.items()]))


def _recall_without_and_with_check(sh, qv, ef):
    """Recall@N of the dense lists without and with the check; the checked lists still hold
    canonical scores, descending, no duplicates."""
    which = list(range(len(qv)))
    plain = sh.search._dense_tops(qv, which, N, ef, 0, check=False)
    checked = sh.search._dense_tops(qv, which, N, ef, 0, check=True)
    for i, (s, sc) in checked.items():
        assert np.array_equal(sc, np.sort(sc)[::-1]) and len(set(s.tolist())) == s.size
        assert np.array_equal(sc, sh.store.dense.exact_slots(qv[i], s))
    return _recall(sh, qv, plain), _recall(sh, qv, checked)


@pytest.mark.parametrize("how", ["random", "between"])
def test_widened_lists_recover_the_exact_top(sparse, how):
    sh, vecs = sparse
    qv = _queries(how, vecs, np.random.default_rng(1 if how == "random" else 2))
    r0, r1 = _recall_without_and_with_check(sh, qv, N)
    assert r0 < 0.7, r0  # the walks really go astray here (else this test shows nothing)
    assert r1 >= 0.85 and r1 >= r0 + 0.2, (r0, r1)


def test_check_is_sound(sparse):
    """An exact list is never flagged; a flagged list misses a chunk of the exact top-TOP."""
    sh, vecs = sparse
    check = ann_check.SampleCheck()
    qv = _queries("random", vecs, np.random.default_rng(3), 40)
    plain = sh.search._dense_tops(qv, list(range(len(qv))), N, N, 0, check=False)
    flagged = 0
    for i, (s, sc) in plain.items():
        ex = _exact_top(sh, qv[i], s.size)
        assert not check.misses(sh.search, qv[i], ex, sh.store.dense.exact_slots(qv[i], ex))
        if check.misses(sh.search, qv[i], s, sc):
            flagged += 1
            top = set(_exact_top(sh, qv[i], min(s.size, ann_check.TOP)).tolist())
            assert not top <= set(s.tolist())
    assert flagged >= len(qv) // 4, flagged  # astray walks are caught, not only some


def _knobs(sh, qv, ef=N):
    req = SearchRequest(QueryBatch(qv, [["w"]] * len(qv), [np.ones(1)] * len(qv), 1.0, 1.5, 0.75),
                        "dense", N, ef, 0, 0, 4)
    return sh.search.search(req).knobs


def test_beam_used_is_reported(sparse):
    sh, vecs = sparse
    far = _queries("random", vecs, np.random.default_rng(4), 8)
    assert _knobs(sh, far)["ef_search"] >= (N + 16) * ann_check.FACTOR  # a widened beam, not the first (n + 16)


def test_near_queries_on_a_good_graph_are_not_widened():
    rng = np.random.default_rng(5)
    vecs = clustered(rng, 5000)
    sh = _shard(vecs, ann_tail=0)  # M 16, efConstruction 40
    near = _unit(vecs[rng.integers(5000, size=30)] + 0.05 * rng.normal(size=(30, DIM)))
    ef = sh.store.dense.params.ef_search  # the default beam
    for i in range(0, 30, 5):
        assert _knobs(sh, near[i:i + 5], 0)["ef_search"] == ef  # not widened


def test_sample_size_is_the_servers_knob(sparse):
    """``--ann-check`` 0 turns the check off (the walks' own lists come back); a sample larger
    than the int8 scan's whole-shard cap (32,768 rows) still checks."""
    sh, vecs = sparse
    qv = _queries("random", vecs, np.random.default_rng(6), 20)
    which = list(range(len(qv)))
    plain = sh.search._dense_tops(qv, which, N, N, 0, check=False)
    off = _shard(vecs, sh=ShardState(0, DIM, None, dense=DenseConfig(kind="hnsw", hnsw_m=4, ef_construction=16,
                                                                     ann_tail=0, ann_check=0)))
    got, walks = off.search._dense_tops(qv, which, N, N, 0), off.search._dense_tops(qv, which, N, N, 0, check=False)
    assert all(np.array_equal(got[i][0], walks[i][0]) for i in which)
    assert off.search._check is None
    big = ann_check.SampleCheck(40000)
    assert any(big.misses(sh.search, qv[i], *plain[i]) for i in which)
    with pytest.raises(ValueError, match="ann_check must be >= 0"):
        DenseConfig(kind="hnsw", ann_check=-1)


@pytest.mark.parametrize("how", ["random", "between"])
def test_a_graph_no_beam_covers_gets_the_exact_top(how):
    """M 2 / efConstruction 4 (trial36: such a graph missed the exact #1 at ef_search 8192, 9x the
    shard): a list still proven short at the widest beam is the exact one. A shard below the
    sample size is checked against every chunk, so each list's top is then exact."""
    rng = np.random.default_rng(7)
    vecs = clustered(rng, 3000)
    sh = _shard(vecs, sh=ShardState(0, DIM, None, dense=DenseConfig(kind="hnsw", hnsw_m=2, ef_construction=4,
                                                                    ann_tail=0)))
    qv = _queries(how, vecs, rng, 40)
    which = list(range(len(qv)))
    assert _recall(sh, qv, sh.search._dense_tops(qv, which, N, 0, 0, check=False)) < 1.0  # the walks miss
    got = sh.search._dense_tops(qv, which, N, 0, 0)
    for i in which:
        assert np.array_equal(got[i][0][:N], _exact_top(sh, qv[i], N))


def test_a_batch_mates_knobs_do_not_change_a_querys_hits():
    """trial36: queries of one batch shared the largest ef_search of the batch (another client's
    knob changed the hits); on an approximate index only queries with equal knobs and windows
    share a search now, and a lexical search reports no beam."""
    import asyncio

    from oprag_server.config import BM25Config, RetrievalConfig
    from oprag_server.index.analyzer import Analyzer
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.operators.retrieve import Retriever, RetrieveSpec
    from oprag_server.shards.inprocess import in_process_pool

    rng = np.random.default_rng(8)
    vecs = clustered(rng, 4000)
    cfg = DenseConfig(kind="hnsw", hnsw_m=2, ef_construction=4, ann_tail=0, ann_check=0)  # walks that miss
    st = _shard(vecs, sh=ShardState(0, DIM, None, dense=cfg))
    r = Retriever(in_process_pool([st]), CorpusStats.merge_full([st.store.postings.full_stats()]), Analyzer(),
                  BM25Config(), RetrievalConfig())
    qv = _queries("random", vecs, rng, 6)
    plain, wide = RetrieveSpec(mode="dense", top_k=10), RetrieveSpec(mode="dense", top_k=10, ef_search=4000)

    def ids(q, specs):
        hits, _, infos = asyncio.run(r.retrieve(q, ["w"] * len(specs), specs))
        return [[h.chunk_id for h in hs] for hs in hits], [i.ef_search for i in infos]

    alone = [ids(qv[i:i + 1], [plain]) for i in range(6)]
    mixed, efs = ids(qv, [wide if i % 2 else plain for i in range(6)])
    for i in range(0, 6, 2):
        assert mixed[i] == alone[i][0][0] and efs[i] == alone[i][1][0]
    assert all(efs[i] == 4000 for i in range(1, 6, 2))
    _, lex = ids(qv[:1], [RetrieveSpec(mode="lexical", top_k=10)])
    assert lex == [0]


@pytest.fixture(scope="module")
def coarse_ivf():
    """An IVF over the clustered vectors visiting 1 of its lists per query by default: a query far
    from every cluster has its exact top-10 spread over lists whose centroids it does not rank
    first, as a keyword or nonword query at 1M chunks."""
    rng = np.random.default_rng(10)
    vecs = clustered(rng, 20000)
    sh = _shard(vecs, sh=ShardState(0, DIM, None, dense=DenseConfig(kind="ivf", nprobe=1, train_min=2000)))
    assert sh.store.dense.ann.nlist >= 64
    return sh, vecs


@pytest.mark.parametrize("how", ["random", "between"])
def test_ivf_lists_proven_short_visit_more_lists(coarse_ivf, how):
    sh, vecs = coarse_ivf
    qv = _queries(how, vecs, np.random.default_rng(11 if how == "random" else 12))
    r0, r1 = _recall_without_and_with_check(sh, qv, 0)
    assert r0 < 0.8, r0  # one list misses much of the exact top here (else this test shows nothing)
    assert r1 >= 0.95 and r1 >= r0 + 0.15, (r0, r1)


def test_ivf_check_is_sound_and_reports_the_lists_used(coarse_ivf):
    sh, vecs = coarse_ivf
    check = ann_check.SampleCheck()
    qv = _queries("random", vecs, np.random.default_rng(13), 30)
    for i, x in enumerate(qv):  # an exact list is never flagged
        ex = _exact_top(sh, x, 40)
        assert not check.misses(sh.search, x, ex, sh.store.dense.exact_slots(x, ex))
    req = SearchRequest(QueryBatch(qv[:6], [["w"]] * 6, [np.ones(1)] * 6, 1.0, 1.5, 0.75), "dense", N, 0, 0, 0, 4)
    used = sh.search.search(req).knobs["nprobe"]
    assert ann_check.FACTOR <= used <= sh.store.dense.ann.nlist  # more lists than the default 1, at most all


def test_an_untrained_ivf_is_exact_and_not_checked():
    rng = np.random.default_rng(14)
    vecs = clustered(rng, 500)
    sh = _shard(vecs, sh=ShardState(0, DIM, None, dense=DenseConfig(kind="ivf", nprobe=1, train_min=4096)))
    assert sh.store.dense.ann.nlist == 0
    qv = _queries("random", vecs, rng, 10)
    got = sh.search._dense_tops(qv, list(range(10)), N, 0, 0)
    for i in range(10):
        assert np.array_equal(got[i][0], _exact_top(sh, qv[i], N))
    assert sh.search._check is None or sh.search._check._j < 0  # the sample was never made


def test_an_ivf_training_is_logged_once_with_its_lists_and_vectors(capsys):
    """trial37 #8: a shard says when it trains (or retrains) its IVF, since the write waits for it."""
    from oprag_server.shards.protocol import Op
    from oprag_server.shards.state import op_table

    sh = _shard(clustered(np.random.default_rng(15), 400),
                sh=ShardState(0, DIM, None, dense=DenseConfig(kind="ivf", train_min=200)))
    assert op_table(sh)[Op.APPLY] == sh.apply  # every applied write reports its trainings
    capsys.readouterr()
    sh.say_trainings()
    err = capsys.readouterr().err
    assert f"INFO shard 0: IVF trained: {sh.store.dense.ann.nlist} lists on 400 vectors in " in err, err
    sh.say_trainings()
    assert "IVF trained" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
@pytest.mark.parametrize("sample", [16384, 2000])
def test_a_list_missing_a_chunk_written_after_the_draw_is_proven_short(kind, sample):
    """trial38 #1: an IVF trained on old content ranked new, different content badly, and the check's sample, drawn
    before the new chunks came and redrawn only after 1/16 growth, never held them: a list of new chunks missing the
    best of them had its cut above every old chunk, so nothing flagged it (dense Recall@10 0.63 for questions about
    the new content). The chunks written since are sampled as they come (at the level of the shard's size)."""
    rng = np.random.default_rng(16)
    dense = (DenseConfig(kind="ivf", nprobe=4, train_min=2000) if kind == "ivf"
             else DenseConfig(kind="hnsw", hnsw_m=4, ef_construction=16, ann_tail=0))
    sh = _shard(clustered(rng, 8000), sh=ShardState(0, DIM, None, dense=dense))
    check = ann_check.SampleCheck(sample)
    q0 = _queries("random", None, rng, 1)[0]
    top0 = _exact_top(sh, q0, 64)
    assert not check.misses(sh.search, q0, top0, sh.store.dense.exact_slots(q0, top0))  # drawn now: old chunks only
    a = _unit(rng.normal(size=DIM))  # 400 new chunks about one new direction: +5%, no redraw
    _shard(_unit(a + 0.15 * rng.normal(size=(400, DIM))), start=8000, sh=sh)
    hits = 0
    for j in range(20):
        q = _unit(a + 0.1 * rng.normal(size=DIM))
        ex = _exact_top(sh, q, 65)
        assert (ex >= 8000).all()  # the exact top-65 is new content: the cut sits above every old chunk
        short = np.concatenate([ex[:j % 10], ex[j % 10 + 1:]])  # one of the exact top-10 missed
        flagged = check.misses(sh.search, q, short, sh.store.dense.exact_slots(q, short))
        assert flagged == (sample > 8400 or ex[j % 10] in set(check.members().tolist())), j  # (~1 in 4 at 2000)
        hits += flagged
        assert not check.misses(sh.search, q, ex[:64], sh.store.dense.exact_slots(q, ex[:64]))  # sound
    assert hits >= (20 if sample > 8400 else 2), hits
    new = check.members()[check.members() >= 8000].size
    assert new == 400 if sample > 8400 else 60 < new < 140, new  # (8,400 chunks: level 34, a share 0.229)


def _expected(sh, sample):
    """The live slots a sample of ``sample`` should hold, from its definition: hash of the chunk id below the
    threshold of the shard's level."""
    st, dense = sh.store, sh.store.dense
    live = np.sort(dense.slots)
    t = ann_check.threshold(ann_check.level(len(dense), sample))
    return live if t is None else live[ann_check.chunk_hashes(st._slot_ids[live]) < t]


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_the_sample_is_a_function_of_the_live_chunks_whatever_the_writes_history(monkeypatch, kind):
    """Session 42: the sample a list is checked against was redrawn by a thread once the shard grew 1/16, so which
    draw checked a query (and so whether an approximate list was widened) depended on the thread's timing; a draw
    strided by slot also depended on when it was made. Now: after any writes the sample holds exactly the live
    chunks whose id hashes below the level's threshold, the same as a new check's on the same shard and as a check's
    on a shard that received only the live chunks; growing a step gathers no vector already sampled; deletes that
    bring the shard under the sample's size make it whole again."""
    rng = np.random.default_rng(42)
    dense = (DenseConfig(kind="ivf", nprobe=4, train_min=1000) if kind == "ivf"
             else DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ann_tail=0))
    vecs = clustered(rng, 7000)
    sh = _shard(vecs[:1500], sh=ShardState(0, DIM, None, dense=dense))
    check, q = ann_check.SampleCheck(1000), _queries("random", vecs, rng, 1)[0]
    gathered = []
    real_of = type(sh.store.dense).vectors_of
    monkeypatch.setattr(type(sh.store.dense), "vectors_of", lambda self, s: (gathered.append(len(s)), real_of(self, s))[1])

    def look():
        ex = _exact_top(sh, q, 64)
        assert not check.misses(sh.search, q, ex, sh.store.dense.exact_slots(q, ex))  # (sound)
        assert np.array_equal(np.sort(check.members()), _expected(sh, 1000))

    look()
    for a in range(1500, 7000, 500):  # growing 1,500 -> 7,000 in writes of 500: only the new chunks are gathered
        gathered.clear()
        _shard(vecs[a:a + 500], start=a, sh=sh)
        look()
        assert sum(gathered) <= 500, gathered
    assert 900 < check.members().size <= 1100 and not check.whole()
    sh.store.delete([f"d{i:05d}" for i in range(0, 7000, 3)], 9000)  # a third removed: shrunk several steps
    look()
    sh.store.delete([f"d{i:05d}" for i in range(7000) if i % 3 and i % 5], 9001)  # down to 934: every chunk
    look()
    assert check.whole() and check.members().size == len(sh.store.dense) == 933
    fresh = ann_check.SampleCheck(1000)  # a new check (a restart's) on the same shard: the same sample
    ex = _exact_top(sh, q, 64)
    fresh.misses(sh.search, q, ex, sh.store.dense.exact_slots(q, ex))
    assert np.array_equal(np.sort(fresh.members()), np.sort(check.members()))


def test_a_shard_holding_the_same_chunks_by_another_history_samples_the_same_ones():
    """Slots differ (a restart renumbers them; here a second shard gets only the live chunks, in another order):
    the sampled chunk ids are the same."""
    rng = np.random.default_rng(7)
    vecs = clustered(rng, 6000)
    cfg = DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ann_tail=0)
    a = _shard(vecs, sh=ShardState(0, DIM, None, dense=cfg))
    a.store.delete([f"d{i:05d}" for i in range(0, 6000, 4)], 9000)
    b = ShardState(0, DIM, None, dense=cfg)
    keep = [i for i in range(6000) if i % 4][::-1]
    for i in keep:  # one by one, newest first: other slots, other graph
        _shard(vecs[i:i + 1], start=i, sh=b)
    q = _queries("random", vecs, rng, 1)[0]
    ids = []
    for sh in (a, b):
        check = ann_check.SampleCheck(700)
        ex = _exact_top(sh, q, 64)
        check.misses(sh.search, q, ex, sh.store.dense.exact_slots(q, ex))
        ids.append(sorted(sh.store._slot_ids[check.members()].tolist()))
    assert ids[0] == ids[1] and 600 < len(ids[0]) < 800


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_a_shard_makes_its_check_sample_at_start_not_in_the_first_query(monkeypatch, tmp_path, kind):
    """Session 42: a restarted 500K-chunk shard's first checked query hashed every chunk id and gathered the sample's
    vectors (~0.1-0.2 s). ``Searcher.warm`` (a shard's start, after its load) makes it; the first query gathers
    nothing, and the sample is the one the run had (the same chunk ids)."""
    dense = (DenseConfig(kind="ivf", nprobe=4, train_min=1000, ann_check=700) if kind == "ivf"
             else DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ann_tail=0, ann_check=700))
    rng = np.random.default_rng(3)
    vecs = clustered(rng, 4000)
    sh = ShardState(0, DIM, tmp_path, dense=dense)
    sh.load(set())
    _shard(vecs, sh=sh)
    sh.store.delete([f"d{i:05d}" for i in range(0, 4000, 5)], 9000)
    q = _queries("random", vecs, rng, 1)[0]
    sh.search._dense_tops(q[None], [0], N, 0, 0)
    before = sorted(sh.store._slot_ids[sh.search._check.members()].tolist())
    sh.snapshot()
    again = ShardState(0, DIM, tmp_path, dense=dense)
    again.load(set())
    again.search.warm()
    check = again.search._check
    assert check is not None and sorted(again.store._slot_ids[check.members()].tolist()) == before
    taken = []
    real = ann_check.SampleCheck._take
    monkeypatch.setattr(ann_check.SampleCheck, "_take", lambda self, d, s: (taken.append(len(s)), real(self, d, s))[1])
    monkeypatch.setattr(ann_check, "chunk_hashes", lambda ids: pytest.fail("hashed in a query"))
    got = again.search._dense_tops(q[None], [0], N, 0, 0, check=True)
    assert again.search._check is check and taken == [] and got[0][0].size == N  # (nothing sampled in the query)


@pytest.mark.parametrize("how", ["random", "between"])
def test_re_ingesting_unchanged_chunks_keeps_the_ivf_dense_minimum(how):
    """trial42 #2: re-ingesting unchanged documents (new slots, the same chunks) changed hybrid's fused scores: the
    dense minimum's estimate was a sample strided by slot. The check's sample (by chunk id) now gives it: the same
    chunks, the same minimum (IVF: the -q search finds the same vectors in the same lists)."""
    rng = np.random.default_rng(11)
    vecs = clustered(rng, 5000)
    sh = _shard(vecs, sh=ShardState(0, DIM, None, dense=DenseConfig(kind="ivf", nprobe=2, train_min=1000,
                                                                     ann_check=1200)))
    qv = _queries(how, vecs, rng, 40)
    before = _mins(sh, qv)
    ids = [f"d{i:05d}" for i in range(1500)]  # the same documents again, as a replacement: new slots
    sh.store.delete(ids, 9000)
    sh.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in ids], doc_ids=ids, titles=[""] * 1500, texts=["w"] * 1500, metadata=[{}] * 1500,
        ordinals=[0] * 1500, generations=[2] * 1500, content_hashes=[hashlib.sha256(d.encode()).hexdigest() for d in ids],
        vectors=vecs[:1500])]), 9001)
    assert len(sh.store.dense) == 5000 and sh.store.next_slot == 6500
    after = _mins(sh, qv)
    assert after == before
    exact = [float(fixed_order_dot(sh.store.dense.vectors, x).min()) for x in qv]
    assert all(a >= e for a, e in zip(after, exact))  # (real chunks' scores: never below the exact minimum)


def test_without_seeds_the_hnsw_minimum_is_the_tail_s_and_the_sample_s(monkeypatch):
    """While a graph's seeds are being made by a thread (none cover it yet), the HNSW dense minimum is the lower of the
    exact minimum over the vectors waiting outside the graph and the check sample's lowest (session 42: it was the
    512-vector slot-strided estimate, which ignored the tail); never below the exact minimum."""
    from oprag_server.index.dense_low import LowSeeds

    rng = np.random.default_rng(12)
    vecs = clustered(rng, 3500)
    sh = _shard(vecs[:3000], sh=ShardState(0, DIM, None, dense=DenseConfig(kind="hnsw", hnsw_m=8, ann_check=500)))
    sh.store.dense.ann.insert_pending()
    _shard(vecs[3000:], start=3000, sh=sh)  # 500 in the tail
    assert sh.store.dense.ann.pending == 500
    monkeypatch.setattr(LowSeeds, "candidates", lambda self, ann, q, ef=0: [None] * len(q))
    qv = _queries("random", vecs, rng, 30)
    got = _mins(sh, qv)
    sample = sh.search._check.lows(sh.search, qv, list(range(30)), whole=False)
    tail = [float(fixed_order_dot(vecs[3000:], x).min()) for x in qv]
    exact = [float(fixed_order_dot(sh.store.dense.vectors, x).min()) for x in qv]
    assert got == [min(t, s) for t, s in zip(tail, sample)]
    assert all(g >= e for g, e in zip(got, exact)) and sum(g == e for g, e in zip(got, exact)) >= 3


@pytest.mark.parametrize("how", ["random", "between", "negated"])
def test_the_minimum_takes_the_samples_lowest_only_where_it_can_be_lower(how):
    """Session 44: an HNSW shard above the sample's size scores the sample canonically for its lowest only when the
    sample's lowest int8 score, less its error, is below the walk's lowest canonical score
    (:meth:`ann_check.SampleCheck.low_below`). The minimum is still ``min(walk's lowest, sample's lowest)``: equal to
    that reference for every query, never below the exact minimum, and the sample's lowest wins for some queries
    (outlier vectors the walk from the seeds misses), so the test sees both branches."""
    from oprag_server.index.kernels_low import canonical_rows
    from tests.unit.test_dense_low import cone

    rng = np.random.default_rng(44)
    vecs, axis = cone(rng, 6000)
    sh = _shard(vecs, sh=ShardState(0, DIM, None, dense=DenseConfig(kind="hnsw", hnsw_m=4, ef_construction=16,
                                                                       ann_tail=0, ann_check=1500)))
    qv = {"random": _unit(rng.normal(size=(40, DIM))), "negated": _unit(-axis[None] + 0.3 * rng.normal(size=(40, DIM))),
          "between": _queries("between", vecs, rng, 40)}[how]
    got = _mins(sh, qv)
    S, dense = sh.search, sh.store.dense
    check = S._check
    assert check is not None and not check.whole()
    live = check.members()
    sample_wins = 0
    for x, low in zip(qv, got):
        cands = S._low.candidates(dense.ann, x[None], dense.params.hybrid_ef_search)[0]  # (the hybrid beam: "w" occurs)
        walk = float(canonical_rows(dense.ann.storage(), cands, x).min()) if cands.size else np.inf
        samp = float(dense.exact_slots(x, live).min())
        assert low == min(walk, samp)
        assert low >= float(fixed_order_dot(dense.vectors, x).min())
        sample_wins += samp < walk
    assert how != "random" or sample_wins > 0, "no query where the sample's lowest is below the walk's"


def test_a_beam_that_would_cost_more_than_a_scan_is_not_walked(sparse, monkeypatch):
    """A list proven short whose next beam x EXACT_BELOW reaches the shard's live vectors gets the
    exact top-n from a scan at once (session 50, trial46: far-off HYBRID queries on 20K-vector
    shards walked beams of 2,048 and 8,192, 4-10x FULL_HYBRID's time). The beams walked stay below
    that; the lists that took the scan are the exact top-n; earlier beams still widen as before."""
    sh, vecs = sparse
    dense = sh.store.dense
    walked = []
    search = dense.search

    def spy(q, k, ef_search=0, nprobe=0):
        walked.append(int(ef_search))
        return search(q, k, ef_search, nprobe)

    monkeypatch.setattr(dense, "search", spy)
    qv = _queries("random", vecs, np.random.default_rng(11), 30)
    which = list(range(len(qv)))
    got = sh.search._dense_tops(qv, which, N, N, 0)
    widest = max(walked)
    assert widest * ann_check.EXACT_BELOW < len(dense), (widest, len(dense))  # no beam dearer than a scan
    assert widest >= (N + 16) * ann_check.FACTOR  # the cheaper wider beams were still walked
    exact = [i for i in which if np.array_equal(got[i][0], _exact_top(sh, qv[i], got[i][0].size))]
    assert len(exact) >= len(which) // 2, len(exact)  # astray walks end in the scan's exact lists
    for i in which:  # every list: canonical scores, descending, and its top-N the exact one's where it went exact
        s, sc = got[i]
        assert np.array_equal(sc, dense.exact_slots(qv[i], s)) and np.array_equal(sc, np.sort(sc)[::-1])
