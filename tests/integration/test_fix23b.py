"""Session 23 leftovers of trial22 (branch fix23b), over real servers and shard processes:

* SIGTERM while a (non-replicated) shard process was being restarted logged ``ERROR oprag: final
  snapshot failed`` with a ``ShardError: shard 0 is not running`` traceback, though the next start
  recovers everything from the write-ahead logs: now one WARNING naming the shard, and the next
  start serves every document;
* ``--ivf-train-min 1`` started, and FAISS wrote ``WARNING clustering 1 points to 1 centroids``
  into the service log at every retraining: now refused at start (FAISS wants 39 points a list);
  at 39 the IVF trains and retrains without a FAISS line;
* a start was silent for 4-7 s between a shard's pid line and its first step, and for ~4 s of
  frontend warm-up; a snapshot download from ``--storage-uri`` was silent: now each is logged
  with seconds (and the download with its source and bytes);
* labelled histograms appeared in ``/metrics`` only at their first observation: now with zero
  counts from the start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

from test_repl22_shutdown import _wait_line

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _pid(srv: ServerProcess, shard: int) -> int:
    return int([m[1] for ln in list(srv.lines) if (m := re.search(rf"shard {shard}: process pid (\d+)", ln))][-1])


def test_sigterm_while_a_shard_restarts_logs_one_warning_and_the_next_start_recovers(tmp_path):
    args = ("--generator", "none", "--snapshot-interval-s", "3600")
    srv = ServerProcess(tmp_path / "data", free_port(), free_port(), *args).start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest([Doc(f"d{i}", f"Lighthouse {i} guards the rocky cape with a rotating lamp.") for i in range(20)])
        os.kill(_pid(srv, 0), signal.SIGKILL)
        assert _wait_line(srv, "shard 0 is down; restarting it"), "".join(srv.lines[-30:])
        assert srv.stop(timeout=120) == 0  # SIGTERM during the restart (a new process takes seconds to import)
    finally:
        srv.stop()
    lines = list(srv.lines)
    text = "".join(lines)
    assert not any("shard 0 is back" in ln for ln in lines), "the restart ended before the stop: " + text
    assert "final snapshot failed" not in text and "Traceback" not in text and "ShardError" not in text, text
    warned = [ln for ln in lines if "final snapshot" in ln]
    assert len(warned) == 1 and re.search(
        r" WARNING oprag: final snapshot: shard 0 not snapshotted \(not running: down or restarting\); the "
        r"write-ahead log of shard 0 will be replayed on the next start$", warned[0].rstrip("\n")), text
    again = ServerProcess(tmp_path / "data", free_port(), free_port(), *args).start()
    try:
        with OpRAGClient(again.target, timeout=120) as c:
            assert c.stats().documents == 20
            assert len(c.retrieve("rocky cape lamp", top_k=20, mode="lexical").hits) == 20
        assert any(re.search(r"recovered [1-9]\d* write-ahead log records", ln) for ln in again.lines)
    finally:
        again.stop()


def test_an_ivf_train_min_below_39_stops_the_start_with_the_reason(tmp_path):
    cmd = [sys.executable, "-m", "oprag_server", "--port", str(free_port()), "--metrics-port", str(free_port()),
           "--data-dir", str(tmp_path / "data"), "--generator", "none", "--dense-index", "ivf", "--ivf-train-min", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # (the base started and served)
        pytest.fail(f"the server started with --ivf-train-min 1: {exc.stderr}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "oprag: --ivf-train-min must be at least 39, got 1: FAISS's k-means wants 39 training vectors per IVF list "
        "(a shard searches exactly until then)")
    assert not (tmp_path / "data").exists()  # refused before anything was written


IVF = ("--generator", "none", "--shards", "1", "--dense-index", "ivf", "--ivf-train-min", "39",
       "--snapshot-interval-s", "3600")


def _docs(a: int, b: int) -> list[Doc]:
    return [Doc(f"w{i}", f"Windmill {i} grinds grain for the village bakery beside the canal.") for i in range(a, b)]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """One shard with an IVF (``--ivf-train-min 39``) on ``--storage-uri``: 40 documents (trained),
    280 more (retrained at 8x); stopped (its snapshot uploaded). Then a start on an empty data
    directory, which downloads it: ``srv.first`` is the first server's output, ``srv.startup``
    the second's up to READY, ``srv.first_scrape`` its /metrics before any request."""
    base = tmp_path_factory.mktemp("fix23b")
    storage = f"file://{base / 'storage'}"
    first = ServerProcess(base / "a", free_port(), free_port(), *IVF, "--storage-uri", storage).start()
    try:
        with OpRAGClient(first.target, timeout=300) as c:
            c.ingest(_docs(0, 40))
            c.ingest(_docs(40, 320))
    finally:
        assert first.stop(timeout=120) == 0
    srv = ServerProcess(base / "b", free_port(), free_port(), *IVF, "--storage-uri", storage).start()
    try:
        srv.first, srv.storage = list(first.lines), base / "storage"
        srv.startup = list(srv.lines)
        srv.first_scrape = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30).text
        with OpRAGClient(srv.target, timeout=120) as c:
            srv.grpc = c
            yield srv
    finally:
        srv.stop()


def test_an_ivf_at_the_floor_trains_and_retrains_without_a_faiss_warning(stored):
    text = "".join(stored.first) + "".join(stored.lines)
    assert "WARNING clustering" not in text and "please provide at least" not in text, text
    hits = stored.grpc.retrieve("windmill grinds grain", top_k=5, mode="dense").hits
    assert len(hits) == 5 and stored.grpc.stats().documents == 320


def _at(lines: list[str], pattern: str) -> tuple[int, re.Match]:
    found = [(i, m) for i, ln in enumerate(lines) if (m := re.search(pattern, ln.rstrip("\n")))]
    assert len(found) == 1, (pattern, "".join(lines))
    return found[0]


def test_start_up_progress_is_logged_with_seconds_and_the_download_with_source_and_bytes(stored):
    lines, num = stored.startup, r"(\d+\.\d)"
    ready = next(i for i, ln in enumerate(lines) if ln.startswith("OPRAG READY"))
    pid, _ = _at(lines, r"INFO oprag: shard 0: process pid \d+$")
    a, m = _at(lines, rf"shard 0: process started in {num} s \(Python, numpy, FAISS, numba and the shard's modules "
                      r"imported\); loading its data$")
    src = f"file://{stored.storage}/shard-0/snap/"
    b, m = _at(lines, rf"shard 0: downloading snapshot (snap-\S+) from {re.escape(src)}(snap-\S+)/: (\d+) objects$")
    assert m[1] == m[2] and int(m[3]) >= 2
    snap = stored.storage / "shard-0" / "snap" / m[1]
    size = sum(p.stat().st_size for p in snap.rglob("*") if p.is_file())
    c, m = _at(lines, rf"shard 0: downloaded snapshot {re.escape(m[1])} from {re.escape(src + m[1])}/: (\d+) bytes in "
                      rf"{num} s$")
    assert int(m[1]) == size > 0
    d, _ = _at(lines, r"shard 0: loading snapshot snap-\S+: 320 chunks$")
    e, m = _at(lines, rf"shard 0: search kernels ready in {num} s \(compiled, or loaded from numba's cache\); ready "
                      rf"{num} s after the process started$")
    assert float(m[2]) >= float(m[1])
    assert pid < a < b < c < d < e < ready, "".join(lines)
    f, _ = _at(lines, r"INFO oprag: embedder \S+: warming up beside the shards' start \(imports torch and "
                      r"transformers, reads the weights\)$")
    g, _ = _at(lines, rf"INFO oprag: embedder \S+: ready in {num} s$")
    h, _ = _at(lines, rf"INFO oprag: every shard is ready after {num} s \(snapshots loaded, write-ahead logs replayed\)$")
    k, _ = _at(lines, rf"INFO oprag: frontend merge kernels ready in {num} s \(compiled, or loaded from numba's cache\)$")
    assert f < g < k < ready and e < h < k, "".join(lines)


def _counts(text: str, name: str) -> dict[str, float]:
    return {labels: float(v) for labels, v in re.findall(rf"^{name}_count\{{(.*?)\}} (\S+)$", text, re.M)}


def test_labelled_histograms_are_exported_with_zero_counts_before_any_request(stored):
    from oprag_server.service.metrics import STAGES

    text = stored.first_scrape
    assert _counts(text, "oprag_stage_seconds") == {f'stage="{s}"': 0.0 for s in (*STAGES, "shard_recovery")}
    assert _counts(text, "oprag_batch_size") == {f'stage="{s}"': 0.0 for s in ("prep", "generate", "embed_ingest")}
    rpcs = [m.name for m in oprag_pb2.DESCRIPTOR.services_by_name["OpRAG"].methods]
    assert _counts(text, "oprag_request_seconds") == {f'method="{m}"': 0.0 for m in rpcs}
    # every bucket of a series is there too, at 0 (rate() over a bucket sees its first observation)
    buckets = re.findall(r'^oprag_request_seconds_bucket\{le="([^"]+)",method="Retrieve"\} (\S+)$', text, re.M)
    assert len(buckets) == 17 and {float(v) for _, v in buckets} == {0.0} and buckets[-1][0] == "+Inf"
    assert "oprag_event_loop_lag_seconds_count" not in text  # no engine generator: no lag probes
