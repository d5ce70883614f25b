"""``Stats``' ``seeds_pending`` (index/low_seeds_state.py, shards/state.py; trial45c): while a thread makes new
dense-minimum seeds for a graph grown 2x, the shard reports that graph's size; once the thread is done the shard
takes them between requests (its idle step), without waiting for a query, and reports 0. The seeds so taken are
those the next query would have taken: the same dense minima afterwards. A job for a graph since replaced is dropped.
The thread is held on an event here, so that each state is seen for certain."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import dense_low, low_seeds_state
from oprag_server.index.dense_low import LowSeeds
from oprag_server.shards.state import ShardState
from test_dense_low import DIM, _mins, _shard, _unit, cone

CFG = DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ann_tail=0, ann_check=200)


@pytest.fixture
def gate(monkeypatch):
    """Seeds made by a thread from 500 vectors; the thread's k-means waits for the returned event."""
    monkeypatch.setattr(LowSeeds, "REFRESH_MIN", 500)
    ev, probes = threading.Event(), dense_low._probes

    def held(train, p):
        if threading.current_thread().name == "oprag-seeds":
            assert ev.wait(60)
        return probes(train, p)
    monkeypatch.setattr(dense_low, "_probes", held)
    return ev


def _grown(seed, query=True):
    """A shard whose seeds were built at 800 vectors (in a query), then grown to 1,700 (2x) and, with ``query``,
    queried: the thread for the new seeds has started."""
    rng = np.random.default_rng(seed)
    vecs, a = cone(rng, 1700)
    qv = np.concatenate([_unit(a + 0.3 * rng.normal(size=(30, DIM))), _unit(rng.normal(size=(30, DIM)))])
    sh = ShardState(0, DIM, None, dense=CFG)
    _shard(vecs[:800], sh=sh)
    _mins(sh, qv[:2])
    _shard(vecs[800:], start=800, sh=sh)
    if query:
        _mins(sh, qv[:2])  # (sees the graph grown 2x: starts the thread)
    return sh, qv


def test_pending_while_the_thread_runs_then_taken_between_requests(gate):
    sh, qv = _grown(1)
    low = sh.search._low  # noqa: SLF001
    assert low_seeds_state.pending(low) == 1700 and sh.stats().seeds_pending == 1700
    assert 0 < sh.idle_wait() <= sh.MERGE_POLL_S  # (the loop looks again soon: nothing to do yet)
    sh.idle_step()
    assert sh.stats().seeds_pending == 1700
    gate.set()
    low._next.thread.join(30)  # noqa: SLF001
    assert sh.idle_wait() == 0.0
    sh.idle_step()  # (no query: the shard's idle step takes them)
    assert sh.stats().seeds_pending == 0 and low._built_at == 1700  # noqa: SLF001 (taken; its build logged)
    assert not sh.store.postings.merging  # (the idle step did nothing else)
    assert sh.idle_wait() is None or sh.idle_wait() > 0.0
    # the same minima as a twin shard whose next query takes them
    twin, _ = _grown(1)
    twin.search._low._next.thread.join(30)  # noqa: SLF001
    assert _mins(sh, qv) == _mins(twin, qv)
    assert twin.stats().seeds_pending == 0


def test_a_doubled_graph_is_pending_and_started_with_no_query(gate):
    """trial46 #1: the graph had doubled but no query had come, and ``seeds_pending`` read 0 while the next replies
    would still change. It reads the graph's size as soon as the shard holds it, and the idle step starts the
    thread once writes have been quiet for ``IDLE_QUIET_S`` (not between the batches of a bulk ingest); the seeds
    then equal those of a twin whose query started it."""
    sh, qv = _grown(3, query=False)
    low, ann = sh.search._low, sh.store.dense.ann  # noqa: SLF001
    assert low._next is None and sh.stats().seeds_pending == 1700  # noqa: SLF001
    assert sh.IDLE_QUIET_S - 1.0 < sh.idle_wait() <= sh.IDLE_QUIET_S  # (writes just came: a bulk ingest goes on first)
    sh.idle_step()
    assert low._next is None  # noqa: SLF001
    sh.IDLE_QUIET_S = 0.0  # (as if writes had been quiet that long)
    assert sh.idle_wait() == 0.0
    sh.idle_step()  # (starts the thread)
    assert low._next is not None and sh.stats().seeds_pending == 1700  # noqa: SLF001
    assert 0 < sh.idle_wait() <= sh.MERGE_POLL_S
    gate.set()
    low._next.thread.join(30)  # noqa: SLF001
    sh.idle_step()
    assert sh.stats().seeds_pending == 0 and low._built_at == 1700  # noqa: SLF001
    assert sh.idle_wait() is None or sh.idle_wait() > 0.0
    twin, _ = _grown(3)
    twin.search._low._next.thread.join(30)  # noqa: SLF001
    assert _mins(sh, qv) == _mins(twin, qv) and not low_seeds_state.due(low, ann)


def test_a_job_for_a_replaced_graph_is_dropped(gate):
    sh, _ = _grown(2)
    low = sh.search._low  # noqa: SLF001
    ann = sh.store.dense.ann
    gate.set()
    low._next.thread.join(30)  # noqa: SLF001
    was = low._index  # noqa: SLF001
    low._index = object()  # (as if the graph had been rebuilt since: a compaction's new index)
    assert low_seeds_state.adopt_done(low, ann) and low_seeds_state.pending(low) == 0
    low._index = was  # noqa: SLF001
    assert not low_seeds_state.adopt_done(low, ann)  # (nothing left)


def test_the_stats_reply_carries_it():
    from oprag_server.service.convert import stats_response

    shard = {"shard": 0, "documents": 1, "chunks": 1, "memory_records": 0, "applied_seq": 1, "bytes": {},
             "seeds_pending": 1700}
    r = stats_response({"documents": 1, "chunks": 1, "memory_records": 0, "seq": 1, "embedder": "e", "generator": "none",
                        "shards": [shard, {**shard, "shard": 1, "seeds_pending": 0}]})
    assert [s.seeds_pending for s in r.shards] == [1700, 0]


@pytest.mark.parametrize("dense", [DenseConfig(kind="flat"), DenseConfig(kind="ivf", train_min=4096),
                                   DenseConfig(kind="hnsw", ann_check=0)])
def test_no_seeds_no_pending_on_any_index(dense):
    """A flat shard, an IVF not trained yet (no FAISS index: the CI of 15abafa found ``Stats`` failing there, so
    the shard's start failed) and an HNSW shard whose seeds were never built report 0 and have nothing to do."""
    sh = ShardState(0, DIM, None, dense=dense)
    for n in (0, 300):
        if n:
            _shard(_unit(np.random.default_rng(4).normal(size=(n, DIM))), sh=sh)
        assert sh.stats().seeds_pending == 0
        assert not low_seeds_state.due(sh.search._low, sh.store.dense.ann)  # noqa: SLF001
        assert not sh.install_finished()
