"""Compact BM25 postings: the immutable CSR segment, the delta, deletes as a live mask, merges
and snapshot files -- against rank_bm25 0.2.2 ``BM25Okapi`` (every expected score comes from
``get_scores``; nothing is hard-coded)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from oprag_server.index import bm25 as B
from oprag_server.index.bm25.segment import Segment

TOL = 1e-9
K1, BB, EPS = 1.5, 0.75, 0.25


def check(shards, live, query):
    """Scores of every live chunk (``live``: {slot: (tokens, shard)}) equal rank_bm25's on the
    live corpus, through score and score_all, with statistics summed over shards."""
    stats = B.CorpusStats.merge_full(sh.full_stats() for sh in shards)
    slots = sorted(live)
    corpus = [live[s][0] for s in slots]
    idf = stats.query_idf(query, EPS)
    got_all = {}
    for sh in shards:
        s, v = sh.score_all(query, idf, stats.avgdl, K1, BB)
        assert np.all(np.diff(s) > 0)
        got_all.update(zip(s.tolist(), v.tolist()))
    assert set(got_all) <= set(live)
    if not corpus or not any(corpus):
        assert got_all == {}
        return None
    ref = BM25Okapi(corpus, k1=K1, b=BB, epsilon=EPS).get_scores(query)
    for k, sh in enumerate(shards):
        mine = [i for i, s in enumerate(slots) if live[s][1] == k]
        if mine:
            got = sh.score(np.asarray([slots[i] for i in mine], np.int64), query, idf, stats.avgdl, K1, BB)
            np.testing.assert_allclose(got, ref[mine], rtol=0, atol=TOL)
    for i, s in enumerate(slots):
        assert abs(got_all.get(s, 0.0) - ref[i]) <= TOL
        if s not in got_all:
            assert ref[i] == 0.0
    return ref


CORPUS = [
    "the cat sat on the mat".split(),
    "the dog sat on the log".split(),
    "cats and dogs are pets pets pets".split(),
    "a mat for the cat and a log for the dog".split(),
    [],
    "bm25 ranks documents by term frequency".split(),
]


def test_merge_keeps_scores_and_drops_dead_postings():
    ix = B.PostingsIndex()
    live = {}
    for s, doc in enumerate(CORPUS):
        ix.add(s, doc)
        live[s] = (doc, 0)
    ref = check([ix], live, "the cat pets".split())
    assert (ref > 0).sum() >= 3
    ix.merge()
    assert ix.segment.n_postings == sum(len(set(d)) for d in CORPUS)
    assert check([ix], live, "the cat pets".split()) == pytest.approx(ref, abs=0)
    ix.remove(0)  # delete then merge: a live mask first, the postings go at the merge
    del live[0]
    check([ix], live, "the cat mat".split())
    assert ix.segment.n_postings == sum(len(set(d)) for d in CORPUS)
    assert ix.df("mat") == 1 and ix.df("cat") == 1
    ix.merge()
    assert ix.segment.n_postings == sum(len(set(d)) for d in CORPUS[1:])
    assert "sat" in ix.segment.vocab and ix.df("sat") == 1
    check([ix], live, "the cat mat sat".split())
    ix.remove(1)  # "sat" and "log"... the last chunk with "sat" goes: the term leaves at the merge
    del live[1]
    ix.merge()
    assert "sat" not in ix.segment.vocab and ix.df("sat") == 0
    check([ix], live, "sat log the".split())


def test_replace_and_slot_reuse_across_merges():
    ix = B.PostingsIndex()
    ix.add(5, ["a", "b", "a"])
    ix.add(2, ["b"])
    ix.merge()
    ix.remove(5)
    ix.add(5, ["c", "c"])  # the same slot again, now in the delta (below and above segment slots)
    ix.add(1, ["a"])
    live = {5: (["c", "c"], 0), 2: (["b"], 0), 1: (["a"], 0)}
    check([ix], live, ["a", "b", "c"])
    ix.merge()
    check([ix], live, ["a", "b", "c"])
    assert ix.segment.doc_slots.tolist() == [1, 2, 5]
    assert ix.full_stats() == (3, 4, {"a": 1, "b": 1, "c": 1})
    with pytest.raises(ValueError):
        ix.add(5, ["x"])


def test_empty_chunks_unicode_and_large_tf():
    ix = B.PostingsIndex()
    docs = {0: [], 1: ["東", "東京", "京", "straße", "\ud800"], 2: ["x"] * 70000, 3: ["é", "x"]}
    for s, d in docs.items():
        ix.add(s, d)
    live = {s: (d, 0) for s, d in docs.items()}
    ix.merge()
    assert ix.segment.tf.dtype == np.uint32  # a tf above 65,535
    check([ix], live, ["東京", "x", "é", "\ud800", "none"])
    ix.remove(0)  # a removed chunk without terms
    del live[0]
    ix.add(0, [])
    live[0] = ([], 0)
    ix.merge()
    assert ix.segment.doc_slots.tolist() == [0, 1, 2, 3]
    check([ix], live, ["x", "京"])


def test_maybe_merge_thresholds(monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    ix = B.PostingsIndex()
    ix.add(0, ["a", "b"])
    assert not ix.maybe_merge()
    ix.add(1, ["c", "d"])
    assert ix.maybe_merge() and ix.merges == 1 and ix.segment.n_postings == 4
    for s in range(2, 10):
        ix.add(s, ["a"])
    assert ix.maybe_merge()
    for s in range(10):
        ix.remove(s)
    assert ix.maybe_merge() and ix.segment.n_postings == 0 and len(ix) == 0


def test_delta_merges_at_a_quarter_of_the_segment(monkeypatch):
    """The delta merges once it holds 1/MERGE_DIV (4) of the segment's postings, not before (at
    the old 1/8 the first check below would merge); scores stay rank_bm25's."""
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    assert B.PostingsIndex.MERGE_DIV == 4
    ix, live = B.PostingsIndex(), {}
    for s in range(20):
        live[s] = ([f"w{s}", "common"], 0)
    ix.add_batch(list(live), [t for t, _ in live.values()])
    ix.merge()
    assert ix.segment.n_postings == 40
    for s in range(20, 24):  # 8 postings: under 40 // 4, over 40 // 8
        live[s] = ([f"w{s}", "common"], 0)
        ix.add(s, live[s][0])
    assert not ix.maybe_merge() and ix.merges == 1
    live[24] = (["w24", "common"], 0)
    ix.add(24, live[24][0])
    assert ix.maybe_merge() and ix.merges == 2 and ix.segment.n_postings == 50
    check([ix], live, ["common", "w3", "w24"])


def test_delta_nbytes_kept_as_the_sum_of_its_entries():
    """Delta.nbytes keeps the per-chunk entries' bytes as they change (adds, removes, a slot
    re-added after its removal): equal to summing them anew."""
    from oprag_server.index.bm25.delta import Delta

    d, rng = Delta(), np.random.default_rng(3)

    def summed() -> int:
        return (sum(k.nbytes + t.nbytes for k, t in d.runs) + d.df_arr.nbytes
                + sum(a.nbytes + 100 for a in d.docs.values()))

    live: set[int] = set()
    for step in range(40):
        new = [s for s in rng.choice(60, 5, replace=False).tolist() if s not in live]
        d.add_batch(new, [[f"t{x}" for x in rng.integers(0, 9, rng.integers(0, 6))] for _ in new])
        live.update(new)
        for s in rng.choice(sorted(live), min(2, len(live)), replace=False).tolist():
            d.remove(s)
            live.discard(s)
        assert d.nbytes() == summed(), step


def test_nbytes_components():
    ix = B.PostingsIndex()
    for s in range(100):
        ix.add(s, [f"t{s % 7}", f"u{s}", "common"])
    ix.merge()
    got = ix.nbytes()
    assert set(got) == {"postings", "terms"}
    assert got["postings"] >= 300 * 10 and got["terms"] > 0


def _mapped(a: np.ndarray) -> bool:
    """Backed by a memory map (the segment keeps a plain ndarray view of the np.memmap)."""
    return isinstance(a, np.memmap) or isinstance(a.base, np.memmap)


def test_snapshot_round_trip_mmap(tmp_path):
    ix = B.PostingsIndex()
    docs = {3: ["a", "b", "a"], 7: ["b", "ü"], 9: [], 12: ["c"]}
    for s, d in docs.items():
        ix.add(s, d)
    ix.merge()
    ix.remove(7)
    ix.add(20, ["a", "ü"])  # in the delta: save merges first
    files = ix.save(tmp_path)
    assert all(p.exists() for p in files)
    back = B.PostingsIndex.load(tmp_path, mmap=True)
    assert _mapped(back.segment.slots) and not back.segment.slots.flags.writeable
    # slots renumbered 0..n-1 in slot order: 3 -> 0, 9 -> 1, 12 -> 2, 20 -> 3
    live = {0: (["a", "b", "a"], 0), 1: ([], 0), 2: (["c"], 0), 3: (["a", "ü"], 0)}
    assert back.full_stats() == ix.full_stats()
    check([back], live, ["a", "ü", "c"])
    back.remove(0)  # writes after a memory-mapped load
    back.add(4, ["c", "c"])
    del live[0]
    live[4] = (["c", "c"], 0)
    check([back], live, ["a", "c"])
    back.merge()
    check([back], live, ["a", "c", "b"])
    (tmp_path / "doc_len.npy").unlink()
    with pytest.raises(OSError):
        B.PostingsIndex.load(tmp_path)


def test_segment_check_rejects_inconsistent_arrays():
    seg = Segment.empty()
    seg.check()
    bad = Segment(["a"], np.array([0, 2]), np.zeros(1, np.int32), np.zeros(1, np.uint16),
                  np.zeros(1, np.int32), np.array([0, 1]), np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        bad.check()


VOCAB = ["a", "b", "c", "d", "é", "東"]
doc_st = st.lists(st.sampled_from(VOCAB), min_size=0, max_size=6)
op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 11), doc_st, st.integers(0, 1)),
    st.tuples(st.just("remove"), st.integers(0, 11)),
    st.tuples(st.just("merge"), st.integers(0, 1)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=40),
       query=st.lists(st.sampled_from(VOCAB + ["zz"]), min_size=0, max_size=4))
def test_property_random_updates_with_merges(ops, query):
    """Random adds, removes (replace = remove + add, slot reuse) and merges on 2 shards; the
    statistics fed incrementally equal the full ones and every score equals rank_bm25's."""
    shards = [B.PostingsIndex(), B.PostingsIndex()]
    synced = B.CorpusStats()
    live: dict[int, tuple[list[str], int]] = {}
    for op in ops:
        if op[0] == "add":
            _, slot, doc, k = op
            if slot in live:
                shards[live[slot][1]].remove(slot)  # replace
            shards[k].add(slot, doc)
            live[slot] = (doc, k)
        elif op[0] == "remove":
            if op[1] in live:
                shards[live.pop(op[1])[1]].remove(op[1])
        else:
            shards[op[1]].merge()
        for sh in shards:
            synced.apply_delta(*sh.drain_delta())
    assert synced == B.CorpusStats.merge_full(sh.full_stats() for sh in shards)
    check(shards, live, query)


# ---------------------------------------------------------------------------------
# Through a shard: snapshot with mapped postings, older snapshots, analyzer changes
# ---------------------------------------------------------------------------------
def _shard(data_dir, n=300, stem=False):
    import hashlib
    import pyarrow as pa
    from oprag_server import records
    from oprag_server.shards.state import ShardState

    st = ShardState(0, 4, data_dir, stem=stem)
    st.load(set())
    texts = [f"chunk {i} about topics {i % 7} and Straße {i % 3} 東京" for i in range(n)]
    vecs = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    batch = records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(n)], doc_ids=[f"d{i}" for i in range(n)], titles=["T"] * n, texts=texts,
        metadata=[{}] * n, ordinals=[0] * n, generations=[1] * n,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts], vectors=vecs)
    st.store.upsert(pa.Table.from_batches([batch]), 1)
    st.store.delete([f"d{i}" for i in range(0, n, 5)], 2)
    return st


def _lexical(st, terms, stats=None):
    # (one CorpusStats for both sides: average_idf's pairwise sum depends on the df dict's order)
    stats = stats or B.CorpusStats.merge_full([st.store.postings.full_stats()])
    s, v = st.store.postings.score_all(terms, stats.query_idf(terms, EPS), stats.avgdl)
    return dict(zip(st.store.ids(s), v.tolist()))


@pytest.mark.parametrize("old_format", [False, True])
def test_shard_snapshot_maps_postings_or_reanalyses(tmp_path, old_format):
    import json
    import shutil
    from oprag_server.shards.state import ShardState

    st = _shard(tmp_path)
    terms = ["topics", "3", "strasse", "東京", "chunk"]
    stats = B.CorpusStats.merge_full([st.store.postings.full_stats()])
    before = _lexical(st, terms, stats)
    assert len(before) == 240
    st.snapshot()
    snap = next((tmp_path / "shard-0").glob("snap-*"))
    assert (snap / "postings" / "slots.npy").exists()
    if old_format:  # a format-1 snapshot: no postings files
        shutil.rmtree(snap / "postings")
        meta = json.loads((snap / "meta.json").read_text())
        meta["format_version"] = 1
        for k in ("analyzer", "crc32", "postings_crc"):  # (none of them in that format)
            meta.pop(k)
        (snap / "meta.json").write_text(json.dumps(meta))
    again = ShardState(0, 4, tmp_path)
    again.load(set())
    assert _mapped(again.store.postings.segment.slots) is not old_format
    assert _lexical(again, terms, stats) == before
    assert again.store.postings.full_stats() == st.store.postings.full_stats()
    again.store.delete(["d1"], 3)  # writes after the load keep the statistics right
    assert "d1#0" not in _lexical(again, terms)


def test_shard_snapshot_with_other_analyzer_reanalyses(tmp_path):
    pytest.importorskip("snowballstemmer")
    from oprag_server.shards.state import ShardState

    _shard(tmp_path).snapshot()
    stemmed = ShardState(0, 4, tmp_path, stem=True)
    stemmed.load(set())
    assert not _mapped(stemmed.store.postings.segment.slots)
    assert "topic" in stemmed.store.postings.full_stats()[2]


def test_shard_stats_report_bytes_by_component():
    from oprag_server.service import convert
    from oprag_server.shards.protocol import StatsRequest

    st = _shard(None, n=400)
    b = st.stats(StatsRequest()).nbytes
    assert set(b) == {"postings", "terms", "vectors", "ann", "chunks"}
    assert b["vectors"] >= 320 * 4 * 4 * 2 and b["ann"] == 0  # flat: our copy and FAISS's
    assert b["chunks"] > 320 * 50 and b["terms"] > 0 and b["postings"] > 0
    st.store.postings.merge()
    merged = st.stats(StatsRequest()).nbytes
    assert merged["postings"] < b["postings"]  # delta estimate (100 B/posting) -> arrays (10 B)
    st.store.delete([f"d{i}" for i in range(400)], 3)
    assert st.stats(StatsRequest()).nbytes["chunks"] == 0
    st.store.postings.merge()
    assert st.stats(StatsRequest()).nbytes["postings"] < merged["postings"]  # dead postings dropped
    resp = convert.stats_response({"documents": 0, "chunks": 0, "memory_records": 0, "seq": 3, "embedder": "e",
                                   "generator": "none", "shards": [{"shard": 0, "documents": 0, "chunks": 0,
                                                                    "memory_records": 0, "applied_seq": 3,
                                                                    "bytes": merged}]})
    assert resp.shards[0].postings_bytes == merged["postings"] and resp.shards[0].chunks_bytes == merged["chunks"]


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_dense_bytes_by_index_kind(kind):
    from oprag_server.config import DenseConfig
    from oprag_server.index.dense import DenseIndex

    n, d = 500, 8
    idx = DenseIndex(d, DenseConfig(kind=kind, hnsw_m=16, train_min=100))
    v = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    idx.add(np.arange(n, dtype=np.int64), v / np.linalg.norm(v, axis=1, keepdims=True))
    b = idx.nbytes()
    assert b["vectors"] >= n * d * 4  # the one exact copy (HNSW: the graph's own storage, issue 13)
    per = 4 * 33 + 12 if kind == "hnsw" else d + 8  # HNSW: the graph only; IVF: its lists' 8-bit codes and ids
    assert b["ann"] >= n * per and b["ann"] < n * per * 2 + 4 * d * 1024
    if kind == "ivf":  # a quarter of the float32 copy's bytes (session 37: IVFFlat lists held every vector twice)
        assert b["ann"] - idx.ann.ann_slot.nbytes < n * (4 * d + 8)


def test_delta_terms_nbytes_counts_new_terms_incrementally():
    """``Delta.terms_nbytes`` (Stats after every commit) adds only the terms added since the
    last call and equals a full recount."""
    import sys

    from oprag_server.index.bm25.delta import Delta

    d = Delta()

    def full() -> int:
        return sys.getsizeof(d.vocab) + sys.getsizeof(d.terms) + sum(map(sys.getsizeof, d.terms))

    d.add_batch([0, 1], [["alpha", "beta"], ["beta", "gamma"]])
    assert d.terms_nbytes() == full()
    d.add_batch([2], [["delta" * 40, "alpha", "épsilon"]])
    assert d.terms_nbytes() == full() and d._terms_bytes[0] == 5
    d.remove(2)
    assert d.terms_nbytes() == full()


def test_shard_stats_count_the_dense_minimum_int8_graph():
    """An HNSW shard's ``ann`` bytes include the dense-minimum search's int8 copy of the graph
    (``LowSeeds``: one byte per coordinate per vector), once a query has built it."""
    from oprag_server.config import DenseConfig
    from oprag_server.shards.protocol import StatsRequest
    from oprag_server.shards.state import ShardState

    n, d = 600, 16
    st = ShardState(0, d, None, dense=DenseConfig(kind="hnsw", hnsw_m=16))
    v = np.random.default_rng(3).standard_normal((n, d)).astype(np.float32)
    st.store.dense.add(np.arange(n, dtype=np.int64), v / np.linalg.norm(v, axis=1, keepdims=True))
    before = st.stats(StatsRequest()).nbytes["ann"]
    q = v[:2] / np.linalg.norm(v[:2], axis=1, keepdims=True)
    st.search._ann_lows(q, [0, 1], 64, 0)  # builds the seeds and the int8 copy
    after = st.stats(StatsRequest()).nbytes["ann"]
    assert after - before >= n * d  # the int8 rows alone
