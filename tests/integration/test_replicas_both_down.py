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

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)


def _all_back(c: OpRAGClient, want: int | None) -> bool:
    """Every shard serves (no partial reply, health SERVING) and, unless None, ``want`` documents."""
    try:
        r = c.retrieve("lobster kites", mode="lexical", top_k=100, timeout=5)
        n = c.stats(timeout=5).documents
        return (not r.retrieval.partial and c.health() == "SERVING" and (want is None or n == want)
                and len(r.hits) == n)
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

            acked, tried = [], []

            def writer():  # writes too: one acknowledged without replica 0 marks it (it is behind)
                n = 0
                while not stop.is_set() and n < 60:  # (every document fits one top_k of 100)
                    n += 1
                    tried.append(f"w{n}")
                    try:
                        c.ingest([Doc(f"w{n}", f"Lobster kites write {n}.")], timeout=5)
                        acked.append(f"w{n}")
                    except Exception:  # noqa: BLE001 - unavailable while both are down
                        pass
                    time.sleep(0.03)

            threads = [threading.Thread(target=reader) for _ in range(2)] + [threading.Thread(target=writer)]
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
            while not _all_back(c, None):
                assert time.time() < deadline, "the shard did not come back"
                time.sleep(0.5)
            have = c.stats().documents
            assert 10 + len(acked) <= have <= 10 + len(tried)
            ids = {h.doc_id for h in c.retrieve("lobster kites", mode="lexical", top_k=100).hits}
            assert set(acked) <= ids  # every acknowledged write is served
            c.ingest([Doc("d10", "One more lobster.")])
            assert _all_back(c, have + 1)
            want = have + 1
        srv.stop()
        srv.start()
        with OpRAGClient(srv.target, timeout=60) as c:
            deadline = time.time() + 60
            while not _all_back(c, want):
                assert time.time() < deadline, "not every document served after the restart"
                time.sleep(0.5)
    finally:
        srv.stop()
