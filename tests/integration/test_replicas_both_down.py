"""trial27: both replicas of a shard killed one after the other with no write between them. The
second one holds every acknowledged write, so the shard comes back from it (and the first one
catches up); before, a replica was marked ``STALE`` as soon as it went down, both were, and the
shard never came back, not even after a restart of the server."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

from test_replicas_server import _replicas  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = pytest.mark.integration


def _all_back(c: OpRAGClient, want: int) -> bool:
    try:
        r = c.retrieve("lobster kites", mode="lexical", top_k=50, timeout=5)
        return not r.retrieval.partial and c.stats(timeout=5).documents == want and len(r.hits) == want
    except Exception:  # noqa: BLE001 - down while the shard restarts
        return False


def test_a_shard_whose_replicas_both_died_comes_back(tmp_path):
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--shards", "1",
                        "--replicas", "2", log_path=tmp_path / "server.log").start()
    try:
        data = srv.data_dir.resolve()
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest([Doc(f"d{i}", f"Lobster {i} and kites on the shore.") for i in range(10)])
            pids = _replicas(srv.proc.pid, data)
            stop = threading.Event()

            def reader():  # reads in flight when each replica dies: each is found gone by a failed read
                while not stop.is_set():
                    try:
                        c.retrieve("lobster", top_k=3, timeout=5)
                    except Exception:  # noqa: BLE001 - partial or unavailable while both are down
                        pass

            threads = [threading.Thread(target=reader) for _ in range(2)]
            for t in threads:
                t.start()
            try:
                time.sleep(0.3)
                os.kill(pids[(0, 0)], signal.SIGKILL)
                time.sleep(0.05)  # (before the catch-up of replica 0 has taken replica 1's snapshot)
                os.kill(pids[(0, 1)], signal.SIGKILL)
                time.sleep(1.0)
            finally:
                stop.set()
                for t in threads:
                    t.join(30)
            deadline = time.time() + 90
            while not _all_back(c, 10):
                assert time.time() < deadline, "the shard did not come back"
                time.sleep(0.5)
            c.ingest([Doc("d10", "One more lobster.")])
            assert _all_back(c, 11)
        srv.stop()
        srv.start()
        with OpRAGClient(srv.target, timeout=60) as c:
            deadline = time.time() + 60
            while not _all_back(c, 11):
                assert time.time() < deadline, "not every document served after the restart"
                time.sleep(0.5)
    finally:
        srv.stop()
