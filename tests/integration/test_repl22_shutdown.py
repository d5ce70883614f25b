"""trial22: ``--replicas 2``, a replica process SIGKILLed, a write acknowledged by its sibling alone,
then SIGTERM while the supervisor is reviving the dead replica. The shutdown stopped the sibling,
the revival went on to it, marked it ``STALE`` too, and the next start was refused ("no replica
came up with current data"). Now the stopped sibling stays unmarked and the restart serves every
acknowledged document. Real server, real shard processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

from test_replicas_server import _replicas

pytestmark = pytest.mark.integration


# ~50-100 s of replica restarts on 2 cores: in `make test-all`; the logic is in the default suite
# (tests/unit/test_replicas.py::test_a_shutdown_during_a_revival_marks_no_up_to_date_replica_stale)


def _wait_line(srv: ServerProcess, text: str, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(text in line for line in list(srv.lines)):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_sigterm_while_a_replica_is_revived_keeps_the_up_to_date_replica_serving(tmp_path):
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--replicas", "2").start()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest([Doc(f"d{i}", f"Tide tables for harbour {i} list high water times.") for i in range(20)])
            pids = _replicas(srv.proc.pid, srv.data_dir.resolve())
            os.kill(pids[(0, 0)], signal.SIGKILL)
            time.sleep(0.3)
            c.ingest([Doc("afterkill", "Written while replica 0 was down: emus at the harbour.")])
        assert _wait_line(srv, "a replica is down; reviving it"), "".join(srv.lines[-30:])
        assert srv.stop(timeout=60) == 0  # SIGTERM during the revival
    finally:
        srv.stop()
    data = srv.data_dir.resolve()
    assert not (data / "replica-1" / "shard-0" / "STALE").exists(), "".join(srv.lines[-30:])
    again = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--replicas", "2").start()
    try:
        with OpRAGClient(again.target, timeout=60) as c:
            assert c.stats().documents == 21
            assert [h.doc_id for h in c.retrieve("emus harbour", top_k=1).hits] == ["afterkill"]
    finally:
        again.stop()
