"""New-user trial 22 (branch fix22b), over a real server (1 shard process, no generator) stopped
and started again on the same port: the Python client, which kept calling while it was down,
reached the restarted server only ~10 s later (gRPC's default reconnect back-off); now within
about a second of the server listening."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ConnectAttempts, ServerProcess

pytestmark = pytest.mark.integration
DOWN_S = 8.0  # the stand-in listener's time on the port: gRPC's defaults space attempts 1, 1.6, 2.6, 4.1 s apart


def test_a_server_restarted_on_the_same_port_is_reached_within_seconds(tmp_path):
    srv = ServerProcess(tmp_path / "data", None, None, "--generator", "none", "--shards", "1").start()
    polling = threading.Event()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest([Doc("bees", "Honey bee foragers tell their nestmates where food is by dancing.", title="Bees")])
            assert c.health() == "SERVING"

            def poll() -> None:  # a caller that keeps calling while the server is down (each call fails fast)
                while polling.is_set():
                    try:
                        c.health(timeout=1)
                    except grpc.RpcError:
                        pass
                    time.sleep(0.2)

            srv.stop()
            polling.set()
            threading.Thread(target=poll, daemon=True).start()
            with ConnectAttempts(srv.port) as down:  # the port refuses gRPC: each attempt noted
                time.sleep(DOWN_S)
            assert len(down.gaps()) >= 4 and max(down.gaps()) < 2.0, down.gaps()  # (before: 1, 1.6, 2.6, 4.1 s...)
            srv.start()  # the same port and data; the client keeps calling meanwhile
            t0 = time.monotonic()
            c.wait_ready(timeout=60)  # the first call after the restart
            waited = time.monotonic() - t0
            polling.clear()
            assert waited < 3.0, f"the client reached the restarted server {waited:.1f} s after it was ready"
            assert c.retrieve("bees dancing", top_k=1).hits[0].doc_id == "bees"
    finally:
        polling.clear()
        srv.stop()
