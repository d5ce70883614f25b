"""A large segment's BM25 wide rows built between requests (index/bm25/wide_warm.py, session 44): every wide row is
built, most frequent term first, one per step; the rows equal the ones a query's first use builds; the top-m, scores
and listed counts of the wide path are the same with the rows built ahead as without; a segment below MIN_SPAN builds
none ahead; a step skips while a query holds the scratch; a merge's new segment is due again; and a shard process's
background step builds them once no HNSW insert waits."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.bm25 import wide_warm
from test_topm_wide import _index, _stop_words, _zipf


def _queries(rng, ix, n_docs, n=30):
    out = []
    for q in range(n):
        terms = [f"t{j}" for j in rng.integers(0, 6 if q % 2 == 0 else 300, int(rng.integers(1, 9)))] + ["t0", "t1"]
        df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
        idf = np.log((n_docs - df + 0.5) / (df + 0.5))
        out.append((terms, np.where(idf < 0, 0.4, idf), float(rng.uniform(3, 25)), int(rng.integers(1, 60))))
    return out


@pytest.mark.parametrize("make,seed", [(_stop_words, 1), (_zipf, 4)])
def test_rows_built_ahead_are_the_rows_a_query_builds_and_change_no_result(make, seed, monkeypatch):
    rng = np.random.default_rng(seed)
    docs = make(rng, 2000)
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)  # small corpora: the pruned (wide) path
    monkeypatch.setattr(wide_warm, "MIN_SPAN", 0)
    cold = _index(np.random.default_rng(seed + 10), docs, len(docs) - 1, 40, 30)
    warm = _index(np.random.default_rng(seed + 10), docs, len(docs) - 1, 40, 30)
    assert wide_warm.due(warm)
    steps, order = 0, []
    w = wide_warm._wide(warm)[1]
    terms_of = np.flatnonzero(w.row_of >= 0)
    df = np.diff(np.asarray(w.seg.offsets, np.int64))[terms_of]
    while True:
        before = w.state.copy()
        more = wide_warm.step(warm)
        order += np.flatnonzero(before != w.state).tolist()
        steps += 1
        if not more:
            break
    assert steps == w.state.size and not wide_warm.due(warm) and not (w.state == 0).any()
    assert np.all(np.diff(df[order]) <= 0), "most frequent first"
    qs = _queries(rng, cold, len(docs))
    for terms, idf, avgdl, m in qs:
        a = lt.listed_top(cold, terms, idf, avgdl, 1.2, 0.75, m)
        b = lt.listed_top(warm, terms, idf, avgdl, 1.2, 0.75, m)
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist() and a[2] == b[2]
    wc = cold.__dict__["_topm_scratch"].wide
    built = wc.state == 1
    assert built.any()  # (the queries built rows on first use)
    assert np.array_equal(wc.rows[built], w.rows[built])


def test_small_segments_build_nothing_ahead_and_a_held_scratch_is_skipped(monkeypatch):
    rng = np.random.default_rng(7)
    ix = _index(rng, _stop_words(rng, 600), 599, 0, 0)
    assert not wide_warm.due(ix) and not wide_warm.step(ix)  # span 600 < MIN_SPAN
    assert "_topm_scratch" not in ix.__dict__
    monkeypatch.setattr(wide_warm, "MIN_SPAN", 0)
    sc, w = wide_warm._wide(ix)
    with sc.lock:  # a query on another thread holds the scratch: nothing built, work left
        assert wide_warm.step(ix) and not (w.state != 0).any()
    assert wide_warm.step(ix, rows=10**6) is False and (w.state != 0).all()
    ix.add(600, ["t0", "t1", "t2"])
    ix.merge()  # a new segment: its rows are due
    assert wide_warm.due(ix)


def test_a_shards_background_step_builds_the_rows_once_no_insert_waits(monkeypatch):
    from oprag_server.shards.state import ShardState

    monkeypatch.setattr(wide_warm, "MIN_SPAN", 0)
    sh = ShardState(0, 8, None)
    rng = np.random.default_rng(3)
    for s, toks in enumerate(_stop_words(rng, 800)):
        sh.store.postings.add(s, toks)
    sh.store.postings.merge()
    assert sh.background_due()
    n = 0
    while sh.background_step():
        n += 1
    w = sh.store.postings.__dict__["_topm_scratch"].wide
    assert not sh.background_due() and (w.state != 0).all() and n + 1 == w.state.size
    p = sh.store.postings
    monkeypatch.setattr(type(p), "MERGE_MIN", 100)  # (65,536 postings: a corpus too large for a unit test)
    for s, toks in enumerate(_stop_words(rng, 400), start=800):  # a delta an idle merge will fold
        p.add(s, toks)
    assert p.idle_merge_due()
    p.merge()  # a new segment whose rows are unbuilt ...
    for s, toks in enumerate(_stop_words(rng, 400), start=1200):
        p.add(s, toks)
    assert wide_warm.due(p) and p.idle_merge_due()
    assert not sh.background_due() and not sh.background_step()  # ... left while the next merge is due
