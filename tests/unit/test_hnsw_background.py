"""HNSW compaction in the background (index/hnsw_build.py, issue 13: "compacts in the background"): once a quarter of
the graph is dead the shard builds a new graph of the live vectors in a thread while the old one keeps serving and
taking writes (direct and deferred inserts, removes); after the install the new graph stores exactly the live
vectors, each under an id the dense index maps its slot to, no deleted chunk is ever returned, the rows read back the
same vectors; the shard installs a finished build between requests; a failed build compacts in the write; a
snapshot taken mid-build restarts into a working shard. Real FAISS and threads; the threshold is lowered so that
small graphs use the background path. Vectors from two generators (isotropic Gaussian, clustered)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import hnsw_build
from oprag_server.index.ann import AnnIndex
from oprag_server.index.dense import DenseIndex
from oprag_server.shards.state import ShardState
from tests.unit.test_ivf_background import _table, _until_built
from tests.unit.test_ivf_background import _vectors as vectors

D = 24


def _vectors(how: str, n: int, seed: int) -> np.ndarray:
    return vectors(how, n, seed, D)


@pytest.fixture(autouse=True)
def _small_builds(monkeypatch):
    monkeypatch.setattr(hnsw_build, "BACKGROUND_MIN", 500)
    monkeypatch.setattr(hnsw_build, "BLOCK", 128)  # many locked reads: writes interleave with the build
    monkeypatch.setattr(hnsw_build, "ROUND_MIN", 16)
    real = AnnIndex.locked_gather

    def slow(self, ids):  # a small graph would be built before the test's first write: 5 ms more a block
        time.sleep(0.005)
        return real(self, ids)

    monkeypatch.setattr(AnnIndex, "locked_gather", slow)


def _cfg(tail: int = 0, check: int = DenseConfig.ann_check) -> DenseConfig:
    return DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40, ann_tail=tail, ann_check=check)


def _check(dense: DenseIndex, x: np.ndarray) -> None:
    """The graph stores exactly the live vectors (by the dense index's own map), rows read them back, nothing else
    is live (the vectors deferred after an install inserted first)."""
    dense.insert_pending()
    ann = dense.ann
    live_ids = np.flatnonzero(ann.ann_slot >= 0)
    slots = ann.ann_slot[live_ids]
    assert sorted(slots.tolist()) == sorted(dense.slots.tolist()) and len(dense) == slots.size
    assert np.array_equal(ann.storage()[live_ids], x[slots])  # (float32 flat storage: bit for bit)
    assert np.array_equal(dense.vectors_of(slots), x[slots])
    assert np.array_equal(dense.vectors, x[dense.slots])
    assert ann.pending == 0 and ann.dead == int((ann.ann_slot < 0).sum())


@pytest.mark.parametrize("how", ["gauss", "clustered"])
@pytest.mark.parametrize("tail", [0, 64])
@pytest.mark.parametrize("rounds", [True, False])  # False: what came since the trigger is inserted at the install
def test_writes_during_a_compaction_are_all_in_the_new_graph(how, tail, rounds, monkeypatch):
    if not rounds:
        monkeypatch.setattr(hnsw_build, "ROUND_MIN", 1 << 40)
    x = _vectors(how, 8000, 1)
    dense = DenseIndex(D, _cfg(tail))
    dense.add(np.arange(3000), x[:3000], defer=tail > 0)
    dense.insert_pending()
    dense.remove(np.arange(0, 3000, 3))  # a third dead: compaction in the background
    assert dense.ann_building is not None and dense.ann.dead == 1000
    rng, nxt, removed = np.random.default_rng(2), 3000, list(range(0, 3000, 3))
    while dense.ann_building is False and nxt + 20 <= 8000:
        gone = rng.choice(dense.slots, 5, replace=False)
        dense.remove(gone)
        removed += gone.tolist()
        dense.add(np.arange(nxt, nxt + 20), x[nxt:nxt + 20], defer=tail > 0)
        dense.insert_pending(8)
        nxt += 20
        hits, _ = dense.search(x[nxt - 20:nxt], 1, ef_search=200)  # the old graph (or its tail) has the new ones
        assert np.mean([int(h[0]) == s for h, s in zip(hits, range(nxt - 20, nxt))]) >= 0.9
    assert nxt > 3000  # writes came during the build (the last one may have installed it)
    _until_built(dense)
    dense.install_ann()
    assert dense.ann_building is None
    _check(dense, x)
    assert dense.ann.dead <= len(removed) - 1000  # (only those removed since the trigger can be dead)
    hits, _ = dense.search(x[removed], 10, ef_search=200)
    assert not set(np.concatenate(hits).tolist()) & set(removed)
    live = dense.slots[:300]
    hits, _ = dense.search(x[live], 1, ef_search=200)
    assert np.mean([int(h[0]) == s for h, s in zip(hits, live)]) >= 0.95


def test_a_failed_compaction_compacts_in_the_write(monkeypatch):
    x = _vectors("clustered", 3000, 3)
    dense = DenseIndex(D, _cfg())
    dense.add(np.arange(3000), x)

    def broken(ids):
        raise MemoryError("no room for the graph")

    monkeypatch.setattr(dense.ann, "locked_gather", broken)
    dense.remove(np.arange(0, 3000, 3))
    _until_built(dense)
    assert dense.ann._build.error is not None  # noqa: SLF001
    dense.remove(np.arange(1, 30, 3))  # the next write installs: the failure compacts here, then removes 10
    assert dense.ann_building is None and dense.ann.dead == 10 and dense.ann.ann_slot.size == 2000
    (n, dropped, _, how), = dense.ann.compactions
    assert (n, dropped) == (2000, 1000) and "failed (MemoryError('no room for the graph'))" in how
    _check(dense, x)


def test_the_shard_installs_a_finished_compaction_between_requests_and_restarts_mid_build(tmp_path, capsys,
                                                                                         monkeypatch):
    from oprag_server.index.dense_low import LowSeeds
    from oprag_server.shards.protocol import QueryBatch, SearchRequest

    x = _vectors("gauss", 3000, 5)
    sh = ShardState(0, D, tmp_path, dense=_cfg(check=0))  # (no check: a shard under it takes its minimum from there)
    sh.load(set())
    sh.store.upsert(_table(x, 0), 1)
    sh.store.delete([f"d{i}" for i in range(0, 3000, 3)], 2)
    dense = sh.store.dense
    assert dense.ann_building is not None
    sh.snapshot()  # mid-build (or just after): the graph that serves is saved
    _until_built(dense)
    # not settled until it is installed: Stats counts the build's live vectors in ann_pending (trial53 #6)
    assert sh.stats().ann_pending == dense.ann.live == 2000
    assert sh.idle_wait() == 0.0
    capsys.readouterr()
    sh.idle_step()
    # (the deletes go one chunk at a time: the build started at the first quarter, the rest are dead in the new one)
    assert dense.ann_building is None and dense.ann.live == 2000 and dense.ann.dead < 300
    assert sh.stats().ann_pending == 0
    err = capsys.readouterr().err  # (trial40: a compaction left no trace in the log)
    assert "INFO shard 0: HNSW graph compacted: 2000 live vectors in a new graph, " in err and "in the background" in err
    # the new graph's dense-minimum seeds came built by the compaction's thread: the next query does not build them
    builds = []
    real = LowSeeds._build
    monkeypatch.setattr(LowSeeds, "_build", lambda self, ann: (builds.append(1), real(self, ann))[1])
    q = QueryBatch(x[1:2], [["topic"]], [np.ones(1)], 5.0, 1.5, 0.75)
    rep = sh.search.search(SearchRequest(q, mode="hybrid", n=10))
    assert builds == [] and sh.search._low._index is dense.ann._index, builds  # noqa: SLF001
    assert not set(rep.candidates[0].slots.tolist()) & set(range(0, 3000, 3))
    stored = x[[int(c[1:].split("#")[0]) for c in sh.store.fields.column(dense.slots, "chunk_id")]]
    assert np.array_equal(dense.vectors, stored)
    sh.txns.wal.close()
    back = ShardState(0, D, tmp_path, dense=_cfg())
    back.load(set())
    assert len(back.store.dense) == 2000
    ids = back.store.fields.column(back.store.dense.slots, "chunk_id")
    assert sorted(ids) == sorted(f"d{i}#0" for i in range(3000) if i % 3)


def test_a_shard_process_loop_answers_searches_during_a_compaction_and_installs_it_when_idle(tmp_path, monkeypatch):
    """The shard's own request loop (worker.run, over a real pipe): a delete past a quarter returns at once, searches
    sent right after are answered while the build runs (never returning a deleted chunk), and with no further request
    the loop installs the finished graph by itself (Stats' ann bytes: the old graph's and the one being built, then
    the new graph's alone, below the old one's)."""
    import multiprocessing as mp
    import signal
    import threading

    from oprag_server.shards import worker
    from oprag_server.shards.protocol import (ApplyRequest, Op, PrepareRequest, QueryBatch, SearchRequest,
                                              ShutdownRequest, StatsRequest)

    monkeypatch.setattr(hnsw_build, "BLOCK", 64)  # a slower build, so that searches meet it
    x = _vectors("clustered", 4000, 7)
    seed = ShardState(0, D, tmp_path, dense=_cfg())
    seed.load(set())
    seed.store.upsert(_table(x, 0), 1)
    seed.snapshot()
    seed.txns.wal.close()
    gone = [f"d{i}" for i in range(0, 4000, 3)]
    front, back = mp.get_context("spawn").Pipe(duplex=True)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out: dict = {}

    def client():
        try:
            assert front.recv()[1]  # READY
            front.send((0, Op.STATS, StatsRequest()))
            before = front.recv()[2].nbytes["ann"]  # the graph of 4,000
            t = time.perf_counter()
            front.send((1, Op.PREPARE, PrepareRequest("t1", 2, "delete", gone)))
            front.send((2, Op.APPLY, ApplyRequest("t1")))
            assert front.recv()[1] and front.recv()[1]
            out["delete_s"] = time.perf_counter() - t
            hits = []
            for i in range(40):
                q = QueryBatch(x[i:i + 1], [["topic"]], [np.ones(1)], 5.0, 1.5, 0.75)
                front.send((10 + i, Op.SEARCH, SearchRequest(q, mode="dense", n=10)))
                _, ok, rep = front.recv()
                assert ok, rep
                hits += rep.candidates[0].slots.tolist()
            out["hits"] = hits
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # no request but Stats: the loop's idle step installs it
                front.send((99, Op.STATS, StatsRequest()))
                _, ok, st = front.recv()
                out["ann"] = (before, st.nbytes["ann"])
                if st.nbytes["ann"] < 0.9 * before:  # the new graph alone (2,667 live, those removed since dead)
                    break
                time.sleep(0.2)
            front.send((100, Op.SHUTDOWN, ShutdownRequest(snapshot=False)))
            front.recv()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc
            front.close()

    t = threading.Thread(target=client)
    t.start()
    try:
        worker.run(0, back, D, str(tmp_path), False, set(), dense=_cfg())
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        t.join(60)
    assert "error" not in out, out.get("error")
    assert out["delete_s"] < 2.0, out
    assert not set(out["hits"]) & set(range(0, 4000, 3)), "a deleted chunk was returned"
    assert out["ann"][1] < 0.9 * out["ann"][0], out["ann"]


@pytest.mark.parametrize("how", ["gauss", "clustered"])
@pytest.mark.parametrize("background", [True, False])
def test_a_graph_loaded_past_a_quarter_dead_is_compacted_when_idle(tmp_path, capsys, monkeypatch, how, background):
    """trial50: a restart during a background compaction loaded the saved graph with its dead nodes (30-40%), and only
    that shard's next delete started a compaction again (adds did not). Now the shard starts it between requests once
    writes have been quiet (``IDLE_QUIET_S``, 0 here), in the background from ``BACKGROUND_MIN`` live vectors (else at
    once); the hits are the same before and after, and no deleted chunk is returned."""
    from oprag_server.shards.protocol import QueryBatch, SearchRequest

    if not background:
        monkeypatch.setattr(hnsw_build, "BACKGROUND_MIN", 1 << 30)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.0)
    x = _vectors(how, 3000, 7)
    sh = ShardState(0, D, tmp_path, dense=_cfg(check=0))
    sh.load(set())
    sh.store.upsert(_table(x, 0), 1)
    monkeypatch.setattr(AnnIndex, "needs_compaction", lambda self: False)  # (the restart cut it short: none ran)
    sh.store.delete([f"d{i}" for i in range(0, 3000, 3)], 2)
    sh.snapshot()
    sh.txns.wal.close()
    monkeypatch.undo()  # (needs_compaction back; the threshold and quiet time again)
    monkeypatch.setattr(hnsw_build, "BACKGROUND_MIN", 500 if background else 1 << 30)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.0)
    back = ShardState(0, D, tmp_path, dense=_cfg(check=0))
    back.load(set())
    dense = back.store.dense
    assert dense.ann.dead == 1000 and dense.compaction_due()
    q = QueryBatch(x[1:4], [["topic"]] * 3, [np.ones(1)] * 3, 5.0, 1.5, 0.75)

    def hits():
        rep = back.search.search(SearchRequest(q, mode="dense", n=10, fetch_k=10))
        return [back.store.fields.column(c.slots, "chunk_id") for c in rep.candidates]

    before = hits()
    assert not any(int(c[1:].split("#")[0]) % 3 == 0 for h in before for c in h)
    capsys.readouterr()
    for _ in range(400):  # the idle loop: wait as told, step (start it; then install it once built)
        wait = back.idle_wait()
        if wait is None:
            break
        time.sleep(min(max(wait, 0.01), 0.05))  # (the shard loop waits for a request meanwhile)
        back.idle_step()
    assert dense.ann.dead == 0 and dense.ann.live == 2000 and not dense.compaction_due()
    err = capsys.readouterr().err
    assert "HNSW graph compacted: 2000 live vectors in a new graph, 1000 deleted ones dropped" in err, err
    assert "a restart had cut its compaction short" in err and ("in the background" in err) == background
    assert hits() == before
    # trial50b #9: the compacted graph is `ann` bytes no snapshot holds (the frontend's snapshot loop saves them);
    # once saved, a restart loads the compacted graph and has nothing to compact
    unsaved = back.stats().ann_unsaved
    assert unsaved == back.stats().nbytes["ann"] > 0
    back.snapshot()
    assert back.stats().ann_unsaved == 0
    back.txns.wal.close()
    again = ShardState(0, D, tmp_path, dense=_cfg(check=0))
    again.load(set())
    assert again.store.dense.ann.dead == 0 and not again.store.dense.compaction_due()
    assert again.idle_wait() is None and again.stats().ann_unsaved == 0
    again.txns.wal.close()
