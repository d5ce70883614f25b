"""Session 23 leftovers of trial22 (branch fix23b), the parts without a server:

* the shutdown's snapshot (:func:`oprag_server.supervision.final_snapshot`): a shard that is not
  running (dead, or being restarted) is one WARNING naming it, without a traceback; every other
  failure keeps its ERROR and traceback;
* ``--ivf-train-min`` below 39 is refused, and an IVF made in code with a lower ``train_min`` waits
  for 39 vectors: FAISS printed ``WARNING clustering 1 points to 1 centroids`` at every training;
* start-up lines of a shard (seconds since its process started) and of a storage download;
* the engine dispatcher's event-loop lag histograms exist (count 0) before its first request.
"""

from __future__ import annotations

import asyncio
import logging
import types

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.shards.transport import ShardError, StorageUnavailable


class _Pool:
    """``down_shards()`` answers ``down`` before the snapshot and ``after`` once it ran."""

    def __init__(self, down=(), after=None) -> None:
        self.down, self.after, self.ran = list(down), after, False

    def down_shards(self):
        return list(self.after) if self.ran and self.after is not None else list(self.down)


def _snap(pool: _Pool, calls: list, fail: BaseException | None = None):
    async def snapshot(skip=()):
        calls.append(tuple(skip))
        pool.ran = True
        if fail is not None:
            raise fail
    return snapshot


def _final(pool, snapshot, caplog) -> list[logging.LogRecord]:
    from oprag_server.supervision import final_snapshot

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="oprag"):
        asyncio.run(final_snapshot(pool, snapshot))
    return [r for r in caplog.records if r.name == "oprag"]


def test_a_shard_down_at_the_stop_is_skipped_with_one_warning_and_no_traceback(caplog):
    pool, calls = _Pool(down=[0]), []
    recs = _final(pool, _snap(pool, calls), caplog)
    assert calls == [(0,)]  # the others are snapshotted
    assert [(r.levelname, r.getMessage()) for r in recs] == [
        ("WARNING", "final snapshot: shard 0 not snapshotted (not running: down or restarting); the write-ahead log of "
                    "shard 0 will be replayed on the next start")]
    assert recs[0].exc_info is None


def test_a_shard_that_dies_during_the_final_snapshot_is_a_warning_too(caplog):
    pool, calls = _Pool(down=[], after=[1]), []
    recs = _final(pool, _snap(pool, calls, ShardError("shard 1 is not running")), caplog)
    assert calls == [()]
    assert [r.levelname for r in recs] == ["WARNING"] and "shard 1 not snapshotted" in recs[0].getMessage()
    assert recs[0].exc_info is None


@pytest.mark.parametrize("down, fail", [
    ([], ShardError("shard 0: OSError: [Errno 28] No space left on device")),  # a running shard failed
    ([1], ShardError("shard 0: OSError: [Errno 28] No space left on device")),  # ... beside one that is down
    ([], RuntimeError("something else")),
])
def test_other_final_snapshot_failures_stay_errors_with_their_traceback(caplog, down, fail):
    pool, calls = _Pool(down=down), []
    recs = _final(pool, _snap(pool, calls, fail), caplog)
    assert [(r.levelname, r.getMessage()) for r in recs] == [("ERROR", "final snapshot failed")]
    assert recs[0].exc_info is not None and recs[0].exc_info[1] is fail


def test_a_full_final_snapshot_logs_nothing_and_skips_nothing(caplog):
    pool, calls = _Pool(), []
    assert _final(pool, _snap(pool, calls), caplog) == [] and calls == [()]


def test_runtime_snapshot_keeps_the_commit_log_when_a_shard_was_skipped():
    """``Runtime.snapshot(skip=...)``: the skipped shard's write-ahead log needs the commit log to
    be replayed (which of its transactions committed), so it is not reset."""
    from oprag_server import app

    class Gate:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    resets, asked = [], []

    async def pool_snapshot(skip=()):
        asked.append(tuple(skip))

    rt = types.SimpleNamespace(_dirty=True, pool=types.SimpleNamespace(snapshot=pool_snapshot),
                               commits=types.SimpleNamespace(gate=Gate(), reset_log=lambda: resets.append(1)))
    asyncio.run(app.Runtime.snapshot(rt, skip=(1,)))
    assert asked == [(1,)] and resets == []
    asyncio.run(app.Runtime.snapshot(rt))
    assert asked == [(1,), ()] and resets == [1]


def test_the_pool_snapshot_skips_the_shards_named():
    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards.protocol import Op

    asked = []

    class Client:
        def __init__(self, i):
            self.shard_id = i

        def call(self, op, req):
            asked.append((self.shard_id, op))
            f = asyncio.get_running_loop().create_future()
            f.set_result(None)
            return f

    pool = ShardPool(3, 4, None)
    pool.clients = [Client(i) for i in range(3)]
    asyncio.run(pool.snapshot(skip=(1,)))
    assert asked == [(0, Op.SNAPSHOT), (2, Op.SNAPSHOT)]


# ---------------------------------------------------------------- IVF training floor
def test_serve_refuses_an_ivf_train_min_below_39_naming_the_flag_and_why():
    from oprag_server.cli import build_parser, config_from_args

    with pytest.raises(ValueError) as exc:
        config_from_args(build_parser().parse_args(["--dense-index", "ivf", "--ivf-train-min", "38"]))
    assert str(exc.value) == ("--ivf-train-min must be at least 39, got 38: FAISS's k-means wants 39 training vectors "
                              "per IVF list (a shard searches exactly until then)")
    assert config_from_args(build_parser().parse_args(["--dense-index", "ivf", "--ivf-train-min", "39"])).dense.train_min == 39



@pytest.mark.parametrize("argv, said", [
    (["--nprobe", "5", "--ann-check", "7"], "not used with --dense-index flat: --nprobe (applies to ivf); --ann-check "
                                            "(applies to hnsw / ivf)"),
    (["--dense-index", "ivf", "--nprobe", "5", "--ef-search", "9"], "not used with --dense-index ivf: --ef-search "
                                                                    "(applies to hnsw)"),
    (["--dense-index", "hnsw", "--ef-search", "9", "--ann-check", "5"], None),
    (["--dense-index", "hnsw", "--hybrid-ef-search", "1000"], "--hybrid-ef-search 1000 is not below --ef-search 512: "
                                                              "hybrid requests search with --ef-search (512)"),
    (["--dense-index", "hnsw", "--hybrid-ef-search", "1000", "--ef-search", "2000"], None),
    (["--dense-index", "flat", "--hybrid-ef-search", "100"], "not used with --dense-index flat: --hybrid-ef-search "
                                                             "(applies to hnsw)"),
    ([], None)])
def test_serve_warns_of_index_options_the_chosen_index_does_not_use(caplog, argv, said):
    """trial37 #7: ``--nprobe`` with ``flat`` was accepted silently (started anyway: switching index kinds keeps a script)."""
    from oprag_server.cli import build_parser, config_from_args

    with caplog.at_level("WARNING", logger="oprag"):
        config_from_args(build_parser().parse_args(argv))
    got = [r.getMessage() for r in caplog.records if r.name == "oprag"]
    assert got == ([said] if said else []), got


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_an_ivf_never_trains_on_fewer_than_39_points_per_list(capfd):
    """An :class:`AnnIndex` with ``train_min`` 1 (made in code; the CLI refuses it) stays exact
    below 39 vectors, then trains without FAISS's warning on stderr (fd 2, which the shard shares
    with the service log), also at every 8x retraining and at every size up to 2,000."""
    from oprag_server.index.ann import IVF_TRAIN_FLOOR, AnnIndex

    d = 16
    idx = AnnIndex(d, DenseConfig(kind="ivf", train_min=1))
    vecs = _unit(2000, d, 7)
    held = 0
    for n in (1, 5, 38, 39, 40, 100, 312, 320, 500, 2000):
        new = np.arange(held, n, dtype=np.int64)
        idx.add(new, vecs[held:n], (np.arange(n, dtype=np.int64), vecs[:n]))
        held = n
        assert idx.ready == (n >= IVF_TRAIN_FLOOR), n
        if idx.ready:
            nlist = idx._index.nlist
            assert idx.trained_at >= IVF_TRAIN_FLOOR * nlist, (n, nlist, idx.trained_at)
    err = capfd.readouterr().err
    assert "WARNING clustering" not in err and "please provide at least" not in err, err
    assert idx.trained_at == 312  # trained at 39, again at 8 x 39 = 312, not yet at 8 x 312


# ---------------------------------------------------------------- start-up lines
def test_shard_start_lines_say_the_seconds_since_the_process_started():
    from oprag_server.shards.worker import process_age, started_line, warm_line

    age = process_age()
    assert age is not None and 0.0 <= age < 24 * 3600  # this test process's own age
    assert started_line(5.25) == ("process started in 5.2 s (Python, numpy, FAISS, numba and the shard's modules "
                                  "imported); loading its data")
    assert started_line(None).startswith("process started (Python")
    assert warm_line(3.31, 14.06) == ("search kernels ready in 3.3 s (compiled, or loaded from numba's cache); ready "
                                      "14.1 s after the process started")
    assert warm_line(0.04, None) == "search kernels ready in 0.0 s (compiled, or loaded from numba's cache)"


def test_a_snapshot_download_from_storage_is_logged_with_source_bytes_and_seconds(tmp_path):
    """``ShardStorage.open_log`` on an empty local directory fetches the current snapshot: two
    lines for the service log (the storage path, never the URI's query string)."""
    import json

    from oprag_server.shards.storage import ShardStorage

    root = tmp_path / "store" / "shard-0"
    (root / "snap" / "snap-7").mkdir(parents=True)
    (root / "snap" / "snap-7" / "meta.json").write_text("{}")
    (root / "snap" / "snap-7" / "chunks.arrow").write_bytes(b"x" * 1000)
    (root / "CURRENT").write_text(json.dumps({"snapshot": "snap-7", "wal_from": 0}))
    said: list[str] = []
    local = tmp_path / "local"
    local.mkdir()
    st = ShardStorage(f"file://{tmp_path / 'store'}", 0)
    st.open_log(local, say=said.append).close()
    src = f"file://{tmp_path / 'store'}/shard-0/snap/snap-7/"
    assert said[0] == f"downloading snapshot snap-7 from {src}: 2 objects"
    assert said[1].startswith(f"downloaded snapshot snap-7 from {src}: 1002 bytes in ") and said[1].endswith(" s")
    assert (local / "snap-7" / "chunks.arrow").stat().st_size == 1000 and st.downloaded


# ---------------------------------------------------------------- metrics
@pytest.mark.parametrize("io_thread, loops", [(False, {"frontend"}), (True, {"frontend", "engine"})])
def test_the_engine_dispatcher_exports_its_event_loop_lag_histograms_before_any_request(io_thread, loops):
    from oprag_server.engine.dispatch import EngineDispatch
    from oprag_server.service.metrics import Metrics

    m = Metrics()
    assert not [s for f in m.registry.collect() if f.name == "oprag_event_loop_lag_seconds" for s in f.samples]

    async def main():
        d = EngineDispatch(types.SimpleNamespace(max_inflight=1), m, lambda job, text: None, io_thread=io_thread)
        if d._io is not None:
            await d._io.stop()

    asyncio.run(main())
    counts = {s.labels["loop"]: s.value for f in m.registry.collect() if f.name == "oprag_event_loop_lag_seconds"
              for s in f.samples if s.name.endswith("_count")}
    assert counts == {loop: 0.0 for loop in loops}


def test_labelled_histograms_are_exported_with_zero_counts_from_the_start():
    from oprag_server.service.metrics import STAGES, Metrics

    m = Metrics()
    m.init_requests(["Retrieve", "HTTP /v1/retrieve"], ["OK"])
    counts: dict[str, dict] = {}
    for f in m.registry.collect():
        for s in f.samples:
            if s.name.endswith("_count") and s.labels:
                counts.setdefault(f.name, {})[tuple(sorted(s.labels.items()))] = s.value
    assert counts["oprag_stage_seconds"] == {(("stage", s),): 0.0 for s in (*STAGES, "shard_recovery")}
    assert counts["oprag_batch_size"] == {(("stage", s),): 0.0 for s in ("prep", "generate", "embed_ingest")}
    assert counts["oprag_request_seconds"] == {(("method", "Retrieve"),): 0.0, (("method", "HTTP /v1/retrieve"),): 0.0}


@pytest.mark.parametrize("value", ["0", "-5", "38"])
def test_every_ivf_train_min_below_39_gets_the_floor_message(value):
    """trial37 #6: 0 and -5 got the dataclass's "train_min must be >= 1" (a bound itself refused)."""
    from oprag_server.cli import build_parser, config_from_args

    with pytest.raises(ValueError, match=f"--ivf-train-min must be at least 39, got {value}: FAISS"):
        config_from_args(build_parser().parse_args(["--ivf-train-min", value]))


def test_ivf_lists_are_2_sqrt_n_up_to_1024_and_never_more_than_the_sqrt_rule_past_it():
    """Session 38: 2 sqrt(n) lists (faster and closer at a fixed nprobe), but no k-means larger than the old rule's
    (the power of two nearest sqrt(n)) once that reaches 1,024 lists: the write that crosses a training size waits for it."""
    from oprag_server.index.ivf_lists import IVF_FINE_LISTS, IVF_TRAIN_FLOOR, ivf_lists

    def sqrt_rule(n):
        return min(int(min(65536, max(16, 2 ** round(np.log2(np.sqrt(n)))))), max(1, n // IVF_TRAIN_FLOOR))

    assert [ivf_lists(n) for n in (39, 4096, 32768, 262144, 500000, 2_000_000, 4_000_000)] == [1, 105, 256, 1024, 1024, 1024, 2048]
    for n in np.unique(np.geomspace(39, 10 ** 10, 400).astype(np.int64)):
        got, old = ivf_lists(int(n)), sqrt_rule(int(n))
        assert old <= got <= max(old, min(2 * old, IVF_FINE_LISTS), min(16, n // IVF_TRAIN_FLOOR)), (n, got, old)
        assert got <= n // IVF_TRAIN_FLOOR and (got & (got - 1) == 0 or got == n // IVF_TRAIN_FLOOR), (n, got)


@pytest.mark.parametrize("argv, said", [
    (["--dense-index", "hnsw", "--ef-search", "70000"], "--ef-search must be in [1, 65536], got 70000"),
    (["--dense-index", "ivf", "--nprobe", "65537"], "--nprobe must be in [1, 65536], got 65537"),
    (["--nprobe", "0"], "--nprobe must be in [1, 65536], got 0"),
    (["--dense-index", "IVF"], "--dense-index must be one of flat, hnsw, ivf, got 'IVF'")])
def test_serve_bounds_its_default_knobs_as_a_request_is_bounded_and_names_every_flag(argv, said):
    """trial38 #2: `serve --ef-search 70000` started although a request's 65537 is refused; #4: `--dense-index IVF`
    was the one message that did not name its flag."""
    from oprag_server.cli import build_parser, config_from_args
    from oprag_server.service.convert import MAX_KNOB

    assert MAX_KNOB == 65536  # the request's bound, which the serve options now share
    with pytest.raises(ValueError) as exc:
        config_from_args(build_parser().parse_args(argv))
    assert str(exc.value) == said
    assert config_from_args(build_parser().parse_args(["--dense-index", "hnsw", "--ef-search", "65536"])).dense.ef_search == 65536


def test_a_final_snapshot_the_storage_refused_is_one_error_line_without_a_traceback(caplog):
    """trial57 #14: SIGTERM to a fenced server logged its final snapshot's StorageUnavailable with a traceback, after
    the fencing itself had been logged."""
    pool, calls = _Pool(down=[0]), []
    fail = StorageUnavailable("this server lost the --storage-uri owner lease")
    recs = _final(pool, _snap(pool, calls, fail), caplog)
    assert [(r.levelname, r.getMessage()) for r in recs] == [
        ("ERROR", "final snapshot failed: this server lost the --storage-uri owner lease (the logs on the storage hold "
                  "every acknowledged write)")]
    assert recs[0].exc_info is None
