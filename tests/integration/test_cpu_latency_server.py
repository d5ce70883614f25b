"""``oprag serve --cpu-latency-us 0`` on a real server (2 shard processes): while it serves, the
machine's effective CPU latency target read from ``/dev/cpu_dma_latency`` is 0 and
``oprag_cpu_latency_qos_us`` exports it; Retrieve answers as usual; after SIGTERM the request is
gone (the target is what it was before). Skipped where this process may not write the device
(not root, no CPU latency QoS)."""

from __future__ import annotations

import os
import re
import urllib.request

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess
from oprag_server import cpu_latency
from oprag_server.cpu_latency import DEVICE

pytestmark = pytest.mark.integration


def _target() -> int:
    return cpu_latency.read_target()


def _gauge(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^oprag_cpu_latency_qos_us (\S+)$", text, re.M).group(1))


@pytest.mark.skipif(not os.access(DEVICE, os.W_OK), reason=f"{DEVICE} not writable here")
def test_request_held_while_serving_and_released_at_stop(tmp_path):
    before = _target()
    if before == 0:
        pytest.skip("another process already holds a 0 us request")
    rng = np.random.default_rng(3)
    V = rng.standard_normal((12, 384)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "2", "--cpu-latency-us", "0")
    srv.start()
    try:
        assert _target() == 0
        assert _gauge(srv.metrics_port) == 0
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest([Doc(f"d{i}", f"note number {i}", vector=V[i]) for i in range(12)])
            assert c.retrieve("note", mode="hybrid", top_k=3, query_vector=V[7].tolist()).hits[0].chunk_id == "d7#0"
    finally:
        assert srv.stop() == 0
    assert _target() == before


def test_without_the_flag_the_gauge_says_none_held(tmp_path):
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "1")
    srv.start()
    try:
        assert _gauge(srv.metrics_port) == -1
    finally:
        srv.stop()


@pytest.mark.skipif(not os.access(DEVICE, os.W_OK), reason=f"{DEVICE} not writable here")
def test_bench_machine_info_records_the_effective_target():
    """The benchmarks' ``machine_info`` says under which idle policy a figure was measured. (Here, not
    in tests/unit: the device is machine-wide, and this file's tests run one after another on one
    xdist worker, so no other test holds a request meanwhile.)"""
    from bench._common import idle_policy

    before = idle_policy().get("cpu_latency_target_us")
    if before == 0:
        pytest.skip("another process already holds a 0 us request")
    req = cpu_latency.hold(0)
    try:
        assert idle_policy()["cpu_latency_target_us"] == 0
    finally:
        req.close()
    assert idle_policy()["cpu_latency_target_us"] == before
