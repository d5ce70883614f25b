"""trial24 #5 over a real server (one shard, no generator): a ``QueryStream`` the client cancels
after its first event must leave no task of the stream's event pump pending. Before, the pump's
``Queue.get()`` task was left behind when the RPC was cancelled while the pump waited, and
asyncio logged ``ERROR asyncio: Task was destroyed but it is pending!`` when it was collected
(~15 % of such cancels)."""

from __future__ import annotations

import time

import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration

DOCS = [Doc(f"cells-{i}", f"Cells {i} divide by mitosis; the spindle pulls chromosome copies apart.") for i in range(8)]


def test_cancelled_query_streams_leave_no_pending_task_behind(tmp_path):
    srv = ServerProcess(tmp_path / "data", free_port(), free_port(), "--generator", "none", "--shards", "1").start()
    try:
        c = OpRAGClient(srv.target, timeout=60)
        c.ingest(DOCS)
        for i in range(120):
            it = c.query_stream(f"cells {i}", top_k=3)
            assert next(iter(it)).WhichOneof("event") == "sources"
            it.cancel()
        for i in range(20):  # more work: the frontend's garbage collector runs and finds what was left
            list(c.query_stream(f"mitosis {i}", top_k=3))
        time.sleep(1.0)
        assert c.stats().documents == len(DOCS)
    finally:
        srv.stop()
    text = "".join(srv.lines)
    assert "Task was destroyed" not in text, text[-4000:]
