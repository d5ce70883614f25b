"""The HNSW dense minimum's seeds kept in the snapshot (index/low_seeds_state.py, trial45 #1): a
shard whose seeds were built at one size and extended by later adds (and deletes) answers the
same dense minima after a snapshot and a restart as before it, where seeds built anew over the
whole graph gave other minima for some queries. Also: a snapshot without the file (an older one)
builds them as before, and a file that does not fit the graph is not used."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import low_seeds_state
from oprag_server.index.dense_low import LowSeeds
from oprag_server.shards.state import ShardState
from test_dense_low import DIM, _batch, _mins, _shard, _unit, cone

CFG = DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=32, ann_tail=0, ann_check=300)  # (a sample far smaller
# than the shard: the seeds' walk gives the minimum)


@pytest.fixture(autouse=True)
def _seeds_in_the_query(monkeypatch):
    monkeypatch.setattr(LowSeeds, "REFRESH_MIN", 1 << 62)  # built where first needed (no thread timing)


def _history(tmp_path, seed):
    """A shard whose seeds were built at 3,000 vectors, then extended by 2,900 more and 400 deletes."""
    rng = np.random.default_rng(seed)
    vecs, a = cone(rng, 5900)
    qv = np.concatenate([_unit(a + 0.3 * rng.normal(size=(60, DIM))), _unit(rng.normal(size=(60, DIM)))])
    sh = ShardState(0, DIM, tmp_path, dense=CFG)
    sh.load(set())
    _shard(vecs[:3000], sh=sh)
    _mins(sh, qv[:2])  # the seeds: built here, at 3,000 vectors
    _shard(vecs[3000:], start=3000, sh=sh)  # (< 2x: the same probes, extended)
    sh.store.delete([f"d{i:05d}" for i in range(0, 4000, 10)], 9000)
    return sh, qv


def test_a_restart_keeps_the_dense_minima(tmp_path):
    differ = 0
    for seed in range(3):
        d = tmp_path / str(seed)
        sh, qv = _history(d, seed)
        sh.snapshot()  # (seeds extended up to 3,000 vectors only: the live shard and the restored one extend them alike)
        before = _mins(sh, qv)
        assert list((d / "shard-0").glob(f"snap-*/{low_seeds_state.NAME}"))
        again = ShardState(0, DIM, d, dense=CFG)
        again.load(set())
        again.search.warm()
        assert again.search._low.built[-1][2] == "from the snapshot"  # noqa: SLF001
        assert _mins(again, qv) == before
        # seeds built anew over the whole graph: other minima for some queries (what the file is for)
        fresh = ShardState(0, DIM, d, dense=CFG)
        fresh.load(set())
        fresh.store.dense.ann.saved_seeds = None  # (what an older snapshot leaves)
        fresh.search.warm()
        assert fresh.search._low.built[-1][2] == "at start"  # noqa: SLF001
        differ += _mins(fresh, qv) != before
    assert differ > 0


def test_a_snapshot_without_seeds_or_with_unfit_ones_builds_them(tmp_path):
    sh, qv = _history(tmp_path, 3)
    sh.snapshot()
    snap = next((tmp_path / "shard-0").glob("snap-*"))
    saved = low_seeds_state.decode(snap / low_seeds_state.NAME)
    assert saved is not None and low_seeds_state.valid(saved, sh.store.dense.ann)
    probes, thresh, ids, built_at, seen = saved
    again = ShardState(0, DIM, tmp_path, dense=CFG)
    again.load(set())
    ann = again.store.dense.ann
    for bad in [(probes, thresh, ids, built_at, seen + 10 ** 6), (probes, thresh, np.append(ids, seen), built_at, seen),
                (probes[:, :-1], thresh, ids, built_at, seen), (probes, thresh[:-1], ids, built_at, seen)]:
        assert not low_seeds_state.valid(bad, ann)
    ann.saved_seeds = (ann._index, (probes, thresh, ids, built_at, seen + 10 ** 6))  # noqa: SLF001
    again.search.warm()
    assert again.search._low.built[-1][2] == "at start"  # noqa: SLF001
    good = (snap / low_seeds_state.NAME).read_bytes()
    (snap / low_seeds_state.NAME).write_bytes(good[:len(good) // 2])  # damaged: built anew, with a WARNING
    said: list = []
    damaged = ShardState(0, DIM, tmp_path, dense=CFG)
    damaged.say = lambda line, level="INFO": said.append((level, line))
    damaged.load(set())
    assert damaged.store.dense.ann.saved_seeds is None
    assert [line for level, line in said if level == "WARNING"] == [
        f"{snap / low_seeds_state.NAME} cannot be read: the dense minimum's seeds are built anew (HYBRID's fused "
        "scores may move slightly from those before the restart)"]
    (snap / low_seeds_state.NAME).unlink()  # an older snapshot: no file (and no warning)
    said.clear()
    third = ShardState(0, DIM, tmp_path, dense=CFG)
    third.say = lambda line, level="INFO": said.append((level, line))
    third.load(set())
    assert third.store.dense.ann.saved_seeds is None and not [x for x in said if x[0] == "WARNING"]
    # seeds kept for another graph (a compaction made a new one since the load) are not used
    fourth = ShardState(0, DIM, tmp_path, dense=CFG)
    fourth.load(set())
    fourth.store.dense.ann.saved_seeds = (object(), saved)
    fourth.search.warm()
    assert fourth.search._low.built[-1][2] == "at start"  # noqa: SLF001
    third.search.warm()
    assert third.search._low.built[-1][2] == "at start"  # noqa: SLF001
    assert _mins(third, qv) == _mins(again, qv)  # (both built anew over the same graph)


def _commit(sh, txn: str, seq: int, vecs: np.ndarray, start: int, committed: set) -> None:
    """Ingest ``vecs`` (documents d<start>...) through the shard's transaction path: staged, prepared (the log
    record), committed, applied, as a frontend's commit does."""
    from oprag_server import records
    from oprag_server.shards.protocol import ApplyRequest, PrepareRequest, StageRequest

    batch = _batch(vecs, start)
    sh.txns.stage(StageRequest(txn, records.to_ipc(batch)))
    sh.txns.prepare(PrepareRequest(txn, seq, "upsert", []))
    committed.add(txn)
    sh.txns.apply(ApplyRequest(txn))


def test_seeds_from_the_snapshot_then_the_log_replayed_on_top(tmp_path):
    """Seeds built at 3,000 vectors and extended to 4,500 are kept in a snapshot; 1,400 more vectors come after it
    through the log only. A start restores the seeds, replays the log on top (its vectors tested against the same
    probes as the live shard tested them) and answers the same dense minima as the live shard; seeds built anew at
    the snapshot's size answer other minima for some queries (so the comparison can tell)."""
    differ = 0
    for seed in range(3):
        d = tmp_path / str(seed)
        rng = np.random.default_rng(100 + seed)
        vecs, a = cone(rng, 5900)
        qv = np.concatenate([_unit(a + 0.3 * rng.normal(size=(60, DIM))), _unit(rng.normal(size=(60, DIM)))])
        committed: set = set()
        sh = ShardState(0, DIM, d, dense=CFG)
        sh.load(committed)
        _commit(sh, "t1", 1, vecs[:3000], 0, committed)
        _mins(sh, qv[:2])  # the seeds: built here, at 3,000 vectors
        _commit(sh, "t2", 2, vecs[3000:4500], 3000, committed)
        sh.snapshot()
        _commit(sh, "t3", 3, vecs[4500:], 4500, committed)  # (in the log only)
        before = _mins(sh, qv)
        again = ShardState(0, DIM, d, dense=CFG)
        assert again.load(committed) >= 1  # (log records replayed)
        again.search.warm()
        assert again.search._low.built[-1][2] == "from the snapshot"  # noqa: SLF001
        assert len(again.store.dense) == 5900 and _mins(again, qv) == before
        fresh = ShardState(0, DIM, d, dense=CFG)
        fresh.load(committed)
        fresh.store.dense.ann.saved_seeds = None  # (no seeds kept: built anew over the snapshot's graph)
        fresh.search.warm()
        differ += _mins(fresh, qv) != before
    assert differ > 0
