"""trial24 finding 3 over one real server with small limits (2 ingest streams, slot wait 2 s, idle
limit 8 s): streams that open and then send nothing no longer block every other Ingest forever.

Before: the slot was an ``asyncio.Semaphore`` without a timeout and a stream had no idle limit; a
further stream waited silently (``oprag ingest --timeout`` then said it "is stored whole or not at
all ... give a larger --timeout", though the server never started it).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc
from oprag_client.testing import oprag_cli
from server_fixtures import http_server

pytestmark = pytest.mark.integration
STREAMS, SLOT_WAIT_S, IDLE_S = 2, 2.0, 8.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from http_server(tmp_path_factory, "fix24b", "--shards", "1", "--generator", "none",
                           "--max-ingest-streams", str(STREAMS), "--ingest-slot-wait-s", str(SLOT_WAIT_S),
                           "--ingest-idle-s", str(IDLE_S), timeout=120)


def _metric(server, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def _found(server, doc_id: str) -> bool:
    return any(h.doc_id == doc_id for h in server.grpc.retrieve(f"{doc_id} zebrafish", mode="lexical", top_k=5).hits)


def test_quiet_streams_refuse_others_for_a_bounded_time_then_are_aborted_and_free_their_slots(server, tmp_path):
    c = server.grpc
    release = threading.Event()
    aborted = _metric(server, "oprag_ingest_streams_aborted_total")
    refused = _metric(server, 'oprag_overload_rejections_total{queue="ingest"}')

    def quiet(i: int):  # a loader that sent one document and then hung (no final message)
        yield oprag_pb2.IngestRequest(documents=[Doc(f"quiet{i}", f"quiet{i} zebrafish stalled loader").to_pb()])
        release.wait(120)

    t0 = time.monotonic()
    futs = [c.stub.Ingest.future(quiet(i), timeout=120) for i in range(STREAMS)]
    try:
        time.sleep(0.5)  # (both hold their slots: taken when the call arrives)
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            c.ingest([Doc("extra", "extra zebrafish document")], timeout=60)
        took = time.monotonic() - t
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert f"{STREAMS} ingest streams are in progress (--max-ingest-streams {STREAMS})" in ei.value.details()
        assert "nothing of it was stored; retry later" in ei.value.details()
        assert SLOT_WAIT_S - 0.2 <= took < SLOT_WAIT_S + 3, took
        # the repro's CLI call: a deadline shorter than the slot wait is refused before it, as not started
        f = tmp_path / "one.jsonl"
        f.write_text('{"id": "cli-extra", "text": "cli-extra zebrafish written while streams stall"}\n')
        out = subprocess.run([*oprag_cli(), "ingest", "--server", server.target, "--json", "--no-progress",
                              "--timeout", "1.5", "--format", "jsonl", str(f)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and '"code": "RESOURCE_EXHAUSTED"' in out.stdout, (out.stdout, out.stderr)
        assert "was refused before the server started it" in out.stderr and "larger --timeout" not in out.stderr
        assert time.monotonic() - t0 < IDLE_S, "the quiet streams were aborted before the checks above ended"
        assert not any(fu.done() for fu in futs)
        # after the idle limit the quiet streams are aborted, and a new ingest gets a slot
        for fu in futs:
            exc = fu.exception(timeout=60)
            assert exc.code() == grpc.StatusCode.ABORTED and f"--ingest-idle-s {IDLE_S:g}" in exc.details(), exc
        assert IDLE_S - 0.5 <= time.monotonic() - t0 < IDLE_S + 10
    finally:
        release.set()
    assert c.ingest([Doc("after", "after zebrafish document")], timeout=60).documents_written == 1
    assert _found(server, "after")
    assert not any(_found(server, d) for d in ("quiet0", "quiet1", "extra", "cli-extra"))
    assert _metric(server, "oprag_ingest_streams_aborted_total") == aborted + STREAMS
    assert _metric(server, 'oprag_overload_rejections_total{queue="ingest"}') == refused + 2
    log = "".join(server.lines)
    assert log.count("Ingest stream refused") == 2 and log.count("Ingest stream aborted: no message") == STREAMS, log[-3000:]


def test_a_slow_but_steady_stream_is_not_cut(server):
    docs = [Doc(f"steady{i}", f"steady{i} zebrafish slow loader") for i in range(10)]

    def slow():  # one document a second, 10 s in all: longer than the idle limit, no gap near it
        for d in docs:
            yield oprag_pb2.IngestRequest(documents=[d.to_pb()])
            time.sleep(1.0)
        yield oprag_pb2.IngestRequest(final=True, sent_documents=len(docs))

    t = time.monotonic()
    res = server.grpc.stub.Ingest(slow(), timeout=120)
    assert time.monotonic() - t > IDLE_S
    assert res.documents_written == len(docs)
    assert all(_found(server, d.id) for d in (docs[0], docs[-1]))
