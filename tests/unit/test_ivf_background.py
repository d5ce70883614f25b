"""An IVF retraining in the background (index/ivf_build.py, issue 13): while the build's thread trains and fills the
new lists, the shard keeps searching the old ones and takes writes (adds and removes, moving rows of the copy the
thread reads); once installed, the new lists hold exactly the live vectors, each encoded from its own vector; a
deleted chunk is never returned before, during or after; the shard installs a finished build between requests and
logs it; a build that fails falls back to the synchronous retraining; a snapshot taken mid-build restarts into a
working shard. Real FAISS, real threads; the threshold of a background build is lowered so that small shards use it.
Vectors from two generators (isotropic Gaussian, clustered)."""

from __future__ import annotations

import hashlib
import time

import faiss
import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.config import DenseConfig
from oprag_server.index import ann as ann_mod
from oprag_server.index import ivf_build
from oprag_server.index.dense import DenseIndex
from oprag_server.shards.state import ShardState

D = 32


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _vectors(how: str, n: int, seed: int, d: int = D) -> np.ndarray:
    """float32[n, d] unit vectors: isotropic Gaussian, or 40 clusters."""
    rng = np.random.default_rng(seed)
    if how == "gauss":
        return _unit(rng.standard_normal((n, d)))
    centres = _unit(rng.standard_normal((40, d)))
    return _unit(centres[rng.integers(40, size=n)] + 0.3 * rng.standard_normal((n, d)))


@pytest.fixture(autouse=True)
def _small_builds(monkeypatch):
    monkeypatch.setattr(ann_mod, "BACKGROUND_MIN", 1000)
    monkeypatch.setattr(ivf_build, "FILL_BLOCK", 256)  # many locked reads: removes interleave with the fill
    real = ivf_build.new_ivf

    def slow(*args):  # a k-means of a few ms would end before the test's first write: 0.2 s more, as a large one
        time.sleep(0.2)
        return real(*args)

    monkeypatch.setattr(ivf_build, "new_ivf", slow)


def _until_built(dense: DenseIndex, timeout: float = 60.0) -> None:
    """Wait until a background retraining / compaction's thread has ended."""
    t = time.monotonic()
    while dense.ann_building is False:
        assert time.monotonic() - t < timeout, "the background build never finished"
        time.sleep(0.005)


def _check_holds_exactly_the_live(dense: DenseIndex) -> None:
    """Every live slot has one id in the new lists, its code decodes close to its own vector (as close as in a
    reference structure trained on the same vectors), and nothing else is in them."""
    ann = dense.ann
    idx = ann._index
    live, vecs = dense.slots, dense.vectors
    ids = {int(s): i for i, s in enumerate(ann.ann_slot) if s >= 0}
    assert sorted(ids) == sorted(live.tolist()) and int(idx.ntotal) == live.size == ann.live
    idx.set_direct_map_type(faiss.DirectMap.Hashtable)
    got = np.stack([idx.reconstruct(ids[int(s)]) for s in live])
    ref = ivf_build.new_ivf(D, live.size, vecs)
    ref.add_with_ids(vecs, np.arange(live.size, dtype=np.int64))
    ref.set_direct_map_type(faiss.DirectMap.Hashtable)
    ref_err = np.abs(np.stack([ref.reconstruct(i) for i in range(live.size)]) - vecs).max(axis=1)
    err = np.abs(got - vecs).max(axis=1)
    assert np.median(err) <= 2 * np.median(ref_err) + 1e-3, (np.median(err), np.median(ref_err))
    # a code taken from another chunk's vector would sit nearer that chunk than its own
    near = np.argmax(got @ vecs.T, axis=1)
    assert np.mean(near == np.arange(live.size)) > 0.99


@pytest.mark.parametrize("how", ["gauss", "clustered"])
def test_writes_during_the_build_are_all_in_the_installed_lists(how):
    x = _vectors(how, 9000, 1)
    dense = DenseIndex(D, DenseConfig(kind="ivf", train_min=500))
    dense.add(np.arange(600), x[:600])
    assert dense.ann.trained_at == 600 and dense.ann_building is None  # (small: trained in the write)
    dense.add(np.arange(600, 5000), x[600:5000])  # crosses 8 x 600: a background build
    assert dense.ann_building is not None and dense.ann.trained_at == 600
    rng, nxt, removed = np.random.default_rng(2), 5000, []
    while dense.ann_building is False and nxt + 15 <= 9000:
        gone = rng.choice(dense.slots, 20, replace=False)
        dense.remove(gone)
        removed += gone.tolist()
        dense.add(np.arange(nxt, nxt + 15), x[nxt:nxt + 15])
        nxt += 15
        hits, _ = dense.search(x[nxt - 15:nxt], 1, nprobe=1 << 20)  # the old lists see the new chunks
        assert [int(h[0]) for h in hits] == list(range(nxt - 15, nxt))
    assert nxt > 5000  # writes came during the build (the last one may have installed it)
    _until_built(dense)
    dense.install_ann()
    assert dense.ann_building is None and dense.ann.trained_at == 5000 and dense.ann.nlist == ivf_build.ivf_lists(5000)
    _check_holds_exactly_the_live(dense)
    hits, _ = dense.search(x[removed], 10, nprobe=1 << 20)
    assert not set(np.concatenate(hits).tolist()) & set(removed)
    assert [how_ for *_, how_ in dense.ann.trainings] == [None, dense.ann.trainings[1][3]]
    assert "in the background" in dense.ann.trainings[1][3]


def test_a_write_far_past_the_trigger_waits_for_the_build():
    x = _vectors("gauss", 12000, 3)
    dense = DenseIndex(D, DenseConfig(kind="ivf", train_min=500))
    dense.add(np.arange(600), x[:600])
    dense.add(np.arange(600, 5000), x[600:5000])
    assert dense.ann_building is not None
    dense.add(np.arange(5000, 10000), x[5000:10000])  # 10,000 >= 2 x 5,000: installed in this write
    assert dense.ann_building is None and dense.ann.trained_at == 5000
    _check_holds_exactly_the_live(dense)


def test_a_failed_build_retrains_in_the_write(monkeypatch):
    x = _vectors("clustered", 6000, 4)
    dense = DenseIndex(D, DenseConfig(kind="ivf", train_min=500))
    dense.add(np.arange(600), x[:600])

    def broken(slots):
        raise MemoryError("no room for the block")

    dense.ann.source = (broken, dense.ann.source[1])
    dense.add(np.arange(600, 5000), x[600:5000])
    _until_built(dense)
    dense.add(np.arange(5000, 5010), x[5000:5010])  # the next write installs: the failure retrains here
    assert dense.ann_building is None and dense.ann.trained_at == 5010
    assert "failed (MemoryError('no room for the block'))" in dense.ann.trainings[-1][3]
    _check_holds_exactly_the_live(dense)


def _table(x: np.ndarray, lo: int) -> pa.Table:
    n = x.shape[0]
    ids = [f"d{lo + i}" for i in range(n)]
    texts = [f"chunk {lo + i} topic {(lo + i) % 7}" for i in range(n)]
    return pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in ids], doc_ids=ids, titles=[""] * n, texts=texts, metadata=[{}] * n,
        ordinals=[0] * n, generations=[1] * n, content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=x)])


def test_the_shard_installs_a_finished_build_between_requests_and_says_so(capsys, tmp_path):
    x = _vectors("clustered", 6000, 5)
    sh = ShardState(0, D, tmp_path, dense=DenseConfig(kind="ivf", train_min=500))
    sh.load(set())
    sh.store.upsert(_table(x[:600], 0), 1)
    sh.store.upsert(_table(x[600:5000], 600), 2)
    dense = sh.store.dense
    assert dense.ann_building is not None
    capsys.readouterr()
    sh.say_trainings()
    sh.say_trainings()  # (said once)
    assert capsys.readouterr().err.count("IVF retraining started in the background on 5000 vectors") == 1
    sh.txns.prepared = {"t": object()}  # a prepared transaction's apply comes first: no install meanwhile
    _until_built(dense)
    assert sh.idle_wait() != 0.0
    sh.txns.prepared = {}
    assert sh.idle_wait() == 0.0
    capsys.readouterr()
    sh.idle_step()
    assert dense.ann_building is None and dense.ann.trained_at == 5000
    err = capsys.readouterr().err
    assert f"IVF trained: {dense.ann.nlist} lists on 5000 vectors in " in err and "in the background" in err, err
    _check_holds_exactly_the_live(dense)


def _held_builds(monkeypatch):
    """Background builds wait for the returned event before they start."""
    import threading

    go = threading.Event()
    real = ivf_build.IvfBuild._run

    def held(self):
        go.wait(30)
        real(self)

    monkeypatch.setattr(ivf_build.IvfBuild, "_run", held)
    return go


def _triggered(tmp_path, seed: int) -> ShardState:
    """A shard trained at 600 vectors, then grown to 5,000 by one write: a background retraining under way."""
    x = _vectors("gauss", 5000, seed)
    sh = ShardState(0, D, tmp_path, dense=DenseConfig(kind="ivf", train_min=500))
    sh.load(set())
    sh.store.upsert(_table(x[:600], 0), 1)
    sh.store.upsert(_table(x[600:5000], 600), 2)
    return sh


def test_a_snapshot_taken_during_a_build_waits_for_it_and_saves_its_lists(tmp_path, monkeypatch):
    """trial58b #2: a snapshot (a SIGINT stop's too) taken while a retraining runs saved the old lists, and the first
    write after the restart retrained on the vectors live then. Now the job waits for the build (reads go on: its steps
    return None), installs it and saves the new lists, which the restart loads as they were."""
    go = _held_builds(monkeypatch)
    sh = _triggered(tmp_path, 6)
    dense = sh.store.dense
    assert dense.ann_building is False
    sh.store.delete([f"d{i}" for i in range(100, 400)], 3)  # removes between the trigger and the snapshot
    job = sh.snapshot_begin()
    assert all(job.step() is None for _ in range(3)) and job.blocker() is dense.ann.build_thread
    assert dense.ann_building is False and not list((tmp_path / "shard-0").glob("snap-*"))
    go.set()
    assert job.wait().written
    assert dense.ann_building is None and dense.ann.trained_at == 5000
    q = dense.ann._index.quantizer
    centroids = q.reconstruct_n(0, q.ntotal)
    sh.shutdown(type("R", (), {"snapshot": False})())
    sh.txns.wal.close()
    back = ShardState(0, D, tmp_path, dense=DenseConfig(kind="ivf", train_min=500))
    back.load(set())
    again = back.store.dense
    assert len(again) == 4700 and again.ann.trained_at == 5000 and again.ann_building is None
    q2 = again.ann._index.quantizer
    assert np.array_equal(q2.reconstruct_n(0, q2.ntotal), centroids)
    slots = np.sort(again.slots)
    hits, _ = again.search(again.vectors_of(slots[:50]), 1, nprobe=1 << 20)
    assert [int(h[0]) for h in hits] == slots[:50].tolist()
    _check_holds_exactly_the_live(again)


def test_a_snapshot_with_a_prepared_transaction_does_not_wait_for_a_build(tmp_path, monkeypatch):
    """Nothing is installed while a prepared transaction waits for its apply: such a snapshot saves the lists that
    serve, as before (the apply is held behind it)."""
    go = _held_builds(monkeypatch)
    sh = _triggered(tmp_path, 8)
    sh.txns.prepared = {"t": object()}
    try:
        assert sh.snapshot().written and sh.store.dense.ann_building is False and sh.store.dense.ann.trained_at == 600
    finally:
        sh.txns.prepared = {}
        go.set()
    _until_built(sh.store.dense)


@pytest.mark.parametrize("how", ["gauss", "clustered"])
def test_the_centroids_do_not_depend_on_when_the_thread_reads(how, monkeypatch):
    """The same writes (a trigger, then removes of a third of the chunks) give the same new lists whether the removes
    land before the build's thread has read anything or after it finished (trial58 #1: a replay after kill -9, whose
    removes land faster than the first run's, trained other centroids when the thread read the sample itself)."""
    go = _held_builds(monkeypatch)
    x = _vectors(how, 5000, 7)
    gone = np.random.default_rng(3).choice(5000, 1700, replace=False)

    def run(removes_first: bool):
        go.clear()
        dense = DenseIndex(D, DenseConfig(kind="ivf", train_min=500))
        dense.add(np.arange(600), x[:600])
        dense.add(np.arange(600, 5000), x[600:5000])  # crosses 8 x 600: a background build, held
        assert dense.ann_building is False
        if removes_first:
            dense.remove(gone)
            go.set()
            _until_built(dense)
        else:
            go.set()
            _until_built(dense)
            dense.remove(gone)
        dense.install_ann()
        q = dense.ann._index.quantizer
        return q.reconstruct_n(0, q.ntotal), dense.search(x[:200], 10, nprobe=4)

    (c1, (h1, s1)), (c2, (h2, s2)) = run(True), run(False)
    assert np.array_equal(c1, c2)
    assert all(np.array_equal(a, b) for a, b in zip(h1, h2)) and all(np.array_equal(a, b) for a, b in zip(s1, s2))


def test_an_untrained_ivf_restarted_with_a_lower_train_min_is_trained_at_start(tmp_path, capsys):
    """trial58 #2: 2,000 chunks under ``--ivf-train-min`` 4096 (searched exactly), restarted with 500: trained while
    loading ("at start, before serving"), not at the next write, and every chunk still found."""
    x = _vectors("clustered", 2000, 9)
    sh = ShardState(0, D, tmp_path, dense=DenseConfig(kind="ivf", train_min=4096))
    sh.load(set())
    sh.store.upsert(_table(x, 0), 1)
    assert not sh.store.dense.ann.ready
    sh.snapshot()
    sh.shutdown(type("R", (), {"snapshot": False})())
    sh.txns.wal.close()
    capsys.readouterr()
    back = ShardState(0, D, tmp_path, dense=DenseConfig(kind="ivf", train_min=500))
    back.load(set())
    dense = back.store.dense
    assert dense.ann.ready and dense.ann.trained_at == 2000 and dense.ann.nlist == ivf_build.ivf_lists(2000)
    assert "at start, before serving" in capsys.readouterr().err
    _check_holds_exactly_the_live(dense)
