"""A snapshot writes a small BM25 delta beside the segment instead of merging first
(:mod:`oprag_server.index.bm25.delta_files`): what a load rebuilds scores as rank_bm25 0.2.2's
``BM25Okapi`` does on the live corpus, before and after later writes, removals and merges; a
delta that is not small, or follows a removal, is merged as before; a damaged file is never
served (the shard re-analyses its texts)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from oprag_server.index import bm25 as B
from oprag_server.index.bm25 import delta_files
from oprag_server.shards.protocol import QueryBatch, SearchRequest
from oprag_server.shards.state import ShardState

from test_bm25_segments import check
from test_snapshot_beside import D, _batch
from test_snapshot_postings_mapped import _replies


def _zipf_docs(rng, n):
    """Words of a 400-term vocabulary drawn by a Zipf law, 0-40 tokens a chunk (empty ones too)."""
    return [[f"w{min(int(rng.zipf(1.3)), 400)}" for _ in range(int(rng.integers(0, 40)))] for _ in range(n)]


def _odd_docs(rng, n):
    """Few distinct terms repeated many times (tf up to ~60), non-ASCII terms, empty chunks."""
    vocab = ["ä", "naïve", "日本", "x", "y" * 30, "z", "🙂"]
    return [[vocab[int(i)] for i in rng.integers(0, len(vocab), int(rng.integers(0, 3)) * int(rng.integers(1, 30)))]
            for _ in range(n)]


@pytest.mark.parametrize("make", [_zipf_docs, _odd_docs])
def test_a_kept_delta_loads_back_and_scores_as_rank_bm25(tmp_path, make):
    rng = np.random.default_rng(7)
    ix, live = B.PostingsIndex(), {}
    first = make(rng, 1200)
    ix.add_batch(list(range(0, 2400, 2)), first)  # (holes in the slots: the load numbers them 0..n-1)
    live.update({s: (t, 0) for s, t in zip(range(0, 2400, 2), first)})
    ix.merge()
    for lo in (2500, 2540, 2560):  # three batches: three runs in the delta
        more = make(rng, 20)
        ix.add_batch(list(range(lo, lo + 20)), more)
        live.update({s: (t, 0) for s, t in zip(range(lo, lo + 20), more)})
    assert delta_files.keeps(ix) and ix._delta.n > 0
    merges = ix.merges
    files = ix.save(tmp_path / "p", merge=False)
    assert ix.merges == merges and (tmp_path / "p" / delta_files.NAME) in files
    back = B.PostingsIndex.load(tmp_path / "p")
    assert back._delta.n == ix._delta.n and len(back._delta.runs) == len(ix._delta.runs)
    renum = {s: (live[s][0], 0) for s in sorted(live)}
    renum = {i: v for i, v in enumerate(renum.values())}
    assert back.full_stats() == ix.full_stats()
    queries = [["w1", "w2", "w40", "w1"], ["w399", "nothing"], ["x", "naïve", "日本", "🙂"], ["y" * 30]]
    for q in queries:
        check([ix], live, q)
        check([back], renum, q)
    # later writes: new chunks, removals in the segment and in the delta, then a merge
    nxt = len(renum)
    more = make(rng, 30)
    back.add_batch(list(range(nxt, nxt + 30)), more)
    renum.update({s: (t, 0) for s, t in zip(range(nxt, nxt + 30), more)})
    for s in (3, 1199, 1205, nxt + 1):  # a segment chunk, the delta's first chunks, a new one
        back.remove(s)
        del renum[s]
    for q in queries:
        check([back], renum, q)
    back.merge()
    assert back._delta.n == 0
    for q in queries:
        check([back], renum, q)


def test_a_delta_that_is_not_small_or_follows_a_removal_is_merged_first(tmp_path, monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 64)
    rng = np.random.default_rng(3)

    def fresh():
        ix = B.PostingsIndex()
        ix.add_batch(list(range(1000)), _zipf_docs(rng, 1000))
        ix.merge()
        return ix

    def refused(ix):
        assert not delta_files.keeps(ix)
        with pytest.raises(ValueError, match="merge it first"):
            ix.save(tmp_path / "x", merge=False)
        files = ix.save(tmp_path / "y")  # (merge=True: one segment, no delta file)
        assert not (tmp_path / "y" / delta_files.NAME).exists() and ix._delta.n == 0
        assert all(os.path.exists(f) for f in files)

    ix = fresh()
    ix.add_batch([1000], [["w1", "w2"]])
    ix.remove(5)  # a segment chunk removed: its postings are dead in the segment
    refused(ix)
    ix = fresh()
    ix.add_batch([1000, 1001], [["w1"], ["w2"]])
    ix.remove(1001)  # a delta chunk removed
    refused(ix)
    ix = fresh()
    ix.add_batch(list(range(1000, 1400)), _zipf_docs(rng, 400))  # over a quarter of the segment's postings (not
    refused(ix)                                                    # merged at the write: the gate held it back)
    ix = B.PostingsIndex()
    ix.add_batch([0, 1], [["a"], ["b"]])  # no segment yet
    refused(ix)
    ix = fresh()
    ix.remove(500)
    ix.merge()
    ix.add_batch([500], [["w1"]])  # a slot below a segment chunk's (the load's order would differ)
    refused(ix)


def _answers(st: ShardState) -> list:
    """Hybrid and lexical candidates of a few queries by chunk id with their scores (slots left out: a restart
    after removals numbers the chunks anew)."""
    q = np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    terms = [["lighthouse", "topic", "chunk"], ["17", "topic"], ["3010", "lighthouse"]]
    qb = QueryBatch(q, terms, [np.ones(len(t)) for t in terms], 5.0, 1.5, 0.75)
    out = []
    for mode in ("hybrid", "lexical"):
        r = st.search.search(SearchRequest(qb, mode=mode, n=32, m=32))
        out += [(c.chunk_ids, c.dense.tolist(), c.lexical.tolist()) for c in [*r.candidates, *(r.lexical or [])]]
    return out


def _snap(tmp_path):
    d = tmp_path / "shard-0"
    return d / (d / "CURRENT").read_text().strip()


def test_a_shard_snapshot_after_a_small_write_keeps_the_segment_files_and_restarts_the_same(tmp_path):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 3000)]), 1)
    st.snapshot()
    first = _snap(tmp_path)
    assert not (first / "postings" / delta_files.NAME).exists()
    slots_ino = os.stat(first / "postings" / "slots.npy").st_ino
    merges = st.store.postings.merges
    st.store.upsert(pa.Table.from_batches([_batch(3000, 3040)]), 2)
    before = _replies(st)
    st.snapshot()
    snap = _snap(tmp_path)
    assert st.store.postings.merges == merges  # no merge for the snapshot
    assert (snap / "postings" / delta_files.NAME).exists()
    assert os.stat(snap / "postings" / "slots.npy").st_ino == slots_ino  # the segment's files linked
    assert _replies(st) == before
    st.txns.wal.close()
    again = ShardState(0, D, tmp_path)
    again.load(set())
    assert again.store.postings._delta.n == st.store.postings._delta.n > 0
    assert _replies(again) == before
    # a removal next: that snapshot merges, and the restart serves the same
    again.store.delete(["d5", "d3010"], 3)
    before = _answers(again)
    again.snapshot()
    assert not (_snap(tmp_path) / "postings" / delta_files.NAME).exists() and again.store.postings._delta.n == 0
    again.txns.wal.close()
    third = ShardState(0, D, tmp_path)
    third.load(set())
    assert _answers(third) == before
    third.txns.wal.close()


@pytest.mark.parametrize("damage", ["slot", "term", "truncated", "tf"])
def test_a_damaged_delta_file_is_not_served_the_texts_are_analysed_again(tmp_path, damage):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(pa.Table.from_batches([_batch(0, 2000)]), 1)
    st.snapshot()
    st.store.upsert(pa.Table.from_batches([_batch(2000, 2030)]), 2)
    before = _replies(st)
    st.snapshot()
    st.txns.wal.close()
    p = _snap(tmp_path) / "postings" / delta_files.NAME
    with np.load(p) as z:
        arrays = {k: np.array(z[k]) for k in z.files}
    if damage == "slot":
        arrays["key0"][-1] += 1  # a posting of a chunk the file does not list
    elif damage == "term":
        arrays["key0"][-1] += np.int64(5000) << 32  # a term id past the terms
    elif damage == "tf":
        arrays["tf0"][0] += 1  # a plausible value: only the CRC-32 tells
    if damage == "truncated":
        p.write_bytes(p.read_bytes()[:200])
    else:
        with open(p, "wb") as f:
            np.savez(f, **arrays)
    with pytest.raises((ValueError, OSError, EOFError, KeyError)):
        B.PostingsIndex.load(p.parent)
    again = ShardState(0, D, tmp_path)
    said: list[str] = []
    again.say = said.append
    again.load(set())
    assert any("delta.npz" in x and "analysed again" in x for x in said), said
    assert len(again.store.postings) == 2030
    assert _replies(again) == before
    again.txns.wal.close()
