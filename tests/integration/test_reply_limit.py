"""A reply over the server's message limit (a real server, 2 shard processes): Retrieve, Query
and QueryStream answer INVALID_ARGUMENT with the reply's size and what to change (fewer hits),
counted under that code, instead of gRPC failing the send after the work (RESOURCE_EXHAUSTED,
counted OK); a smaller top_k on the same data still works, and nothing stored is lost."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = pytest.mark.integration


def test_a_reply_over_the_message_limit_is_invalid_argument(tmp_path):
    rng = np.random.default_rng(3)
    V = rng.standard_normal((6, 384)).astype(np.float32)
    big = "lobster " * 900_000  # 7.2 MB, one supplied chunk per document (under the 8 MiB document limit)
    docs = [Doc(f"big{i}", chunks=[(big + f"tail{i}", V[i])]) for i in range(5)] + [Doc("small", "a small note", vector=V[5])]
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=300) as c:
            for d in docs:  # one document per stream: each message stays under 32 MiB
                c.ingest([d])
            assert c.stats().chunks == 6
            calls = [lambda: c.retrieve("lobster", mode="lexical", top_k=6),
                     lambda: c.stub.Query(oprag_pb2.QueryRequest(question="lobster", mode=oprag_pb2.LEXICAL, top_k=6),
                                          timeout=300),
                     lambda: list(c.stub.QueryStream(oprag_pb2.QueryRequest(question="lobster", mode=oprag_pb2.LEXICAL,
                                                                            top_k=6), timeout=300))]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "over the server's" in err.value.details() and "fewer hits" in err.value.details()
            r = c.retrieve("lobster", mode="lexical", top_k=2)
            assert len(r.hits) == 2 and all(len(h.text) > 7_000_000 for h in r.hits)
            assert c.retrieve("small note", mode="lexical", top_k=1).hits[0].chunk_id == "small#0"
            assert c.stats().chunks == 6
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30).read().decode()
        line = next(ln for ln in metrics.splitlines() if ln.startswith("oprag_requests_total{")
                    and 'code="INVALID_ARGUMENT"' in ln and 'method="Retrieve"' in ln)
        assert float(line.rsplit(" ", 1)[1]) == 1.0
    finally:
        srv.stop()
