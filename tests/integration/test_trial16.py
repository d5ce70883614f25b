"""What the new-user trial of issue 16 found at a real server's doors (generator off).

A hybrid request whose dense window held nothing (an empty store, or a filter that matches no
chunk) with RRF fusion, or grouped by document, failed with INTERNAL ("IndexError: list index
out of range"; HTTP 500) -- and so did every other request batched with it: one client's filter
that matched nothing failed other clients' valid queries. A request whose deadline passed was
counted CANCELLED in ``oprag_requests_total``. Stats reported a failed write's sequence number.
"""

from __future__ import annotations

import asyncio
import re
import resource
import threading
import time

import grpc
import numpy as np
import pytest
import requests

from oprag.v1 import oprag_pb2, oprag_pb2_grpc
from oprag_client.client import AsyncOpRAGClient, Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port, wait_until
from test_trial15 import _shard_pid  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = pytest.mark.integration

NOTHING = {"nomatch": "x"}  # a filter no chunk matches


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    http = free_port()
    srv = ServerProcess(tmp_path_factory.mktemp("trial16"), free_port(), free_port(), "--generator", "none",
                        "--http-port", str(http))
    srv.http_port = http
    srv.start()
    yield srv
    srv.stop()


def _empty_window_requests(c: OpRAGClient) -> dict:
    return {
        "rrf": c.retrieve("lighthouse keeper", fusion="rrf"),
        "rrf, filter": c.retrieve("lighthouse keeper", fusion="rrf", filters=NOTHING),
        "grouped": c.retrieve("lighthouse keeper", group_by_document=True),
        "grouped, filter": c.retrieve("lighthouse keeper", group_by_document=True, filters=NOTHING),
        "grouped rrf, filter": c.retrieve("lighthouse keeper", group_by_document=True, fusion="rrf", filters=NOTHING),
    }


def test_an_empty_window_is_an_empty_answer_not_internal(server, client):
    for name, r in _empty_window_requests(client).items():  # the store is empty
        assert not r.hits and not r.documents, name
    vecs = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)
    client.ingest([Doc(f"d{i}", f"the lighthouse keeper number {i}", vector=vecs[i]) for i in range(3)])
    for name, r in _empty_window_requests(client).items():
        if "filter" in name:
            assert not r.hits and not r.documents, name
        else:
            assert {h.doc_id for h in r.hits} == {"d0", "d1", "d2"}, name
    got = requests.post(f"http://127.0.0.1:{server.http_port}/v1/retrieve", timeout=60,
                        json={"query": "lighthouse", "filters": NOTHING, "fusion": {"method": "rrf"}})
    assert got.status_code == 200 and got.json()["hits"] == [], got.text


def test_a_request_with_an_empty_window_fails_no_request_batched_with_it(server, client):
    client.ingest([Doc("k", "the keeper of the lighthouse", vector=np.ones(384, np.float32))])

    async def go():
        async with AsyncOpRAGClient(server.target) as c:
            async def one(**kw):
                try:
                    return len((await c.retrieve("lighthouse keeper", fusion="rrf", **kw)).hits)
                except grpc.RpcError as e:
                    return e.code().name

            for _ in range(3):  # (batched together: --max-batch 8, --max-wait-ms 4)
                got = await asyncio.gather(*[one() for _ in range(5)], one(filters=NOTHING), *[one() for _ in range(5)])
                assert got[5] == 0 and all(n == 4 for n in got[:5] + got[6:]), got

    asyncio.run(go())


def _requests(server, method: str, code: str) -> float:
    body = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    m = re.search(rf'^oprag_requests_total{{code="{code}",method="{method}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_request_past_its_deadline_is_counted_deadline_exceeded_not_cancelled(server):
    """A request whose deadline passed was counted ``code="CANCELLED"``, though its client was
    told DEADLINE_EXCEEDED; CANCELLED stays for a client that cancels."""
    stub = oprag_pb2_grpc.OpRAGStub(grpc.insecure_channel(server.target))
    hold = threading.Event()

    def stream():  # one message, then nothing until the test lets go (no final message)
        yield oprag_pb2.IngestRequest(documents=[oprag_pb2.Document(id="late", text="never final")])
        hold.wait(30)

    before = {c: _requests(server, "Ingest", c) for c in ("DEADLINE_EXCEEDED", "CANCELLED")}
    with pytest.raises(grpc.RpcError) as e:
        stub.Ingest(stream(), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: _requests(server, "Ingest", "DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1)
    hold.set()
    hold.clear()
    call = stub.Ingest.future(stream())
    time.sleep(0.5)
    call.cancel()
    hold.set()
    assert wait_until(lambda: _requests(server, "Ingest", "CANCELLED") == before["CANCELLED"] + 1)
    assert _requests(server, "Ingest", "DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1


def test_stats_seq_is_the_last_applied_write_not_a_failed_ones_number(server, client):
    """A write that fails at the commit (here a shard's full disk: RLIMIT_FSIZE, as in
    test_trial15) takes a sequence number. Stats reported it as the service's ``seq``: a
    read-your-writes request with ``min_seq`` of it waited until its deadline (nothing applies
    a failed write), and a restart issued the number again (Stats went backwards)."""
    vec = np.ones(384, np.float32)
    acked = client.ingest([Doc("s1", "a write that is acknowledged", vector=vec)]).seq
    pid = _shard_pid(server)
    wal = server.data_dir / "shard-0" / "wal.log"
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (wal.stat().st_size + 1024, hard))  # the disk fills
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.ingest([Doc("s2", "a write that fails " + "padding " * 2000, vector=vec)])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
    seq = client.stats().seq
    assert seq == acked
    r = client.retrieve("acknowledged", min_seq=seq, timeout=5)  # (before: DEADLINE_EXCEEDED)
    assert "s1" in {h.doc_id for h in r.hits}
