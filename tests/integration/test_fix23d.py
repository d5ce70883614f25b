"""trial23 findings #3 and nits, over a real server (HTTP port, no generator):
a ``min_seq`` never issued names ``min_seq`` (HTTP ``param``), a document id of only whitespace is
refused like an empty one (Ingest and Delete), a metadata filter key over 1024 bytes is refused."""

from __future__ import annotations

import json

import grpc
import pytest
import requests

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc
from server_fixtures import http_server  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = pytest.mark.integration
DOCS = [Doc(f"tide{i}", f"Tide tables for harbour {i} list the high water times of each day.") for i in range(4)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from http_server(tmp_path_factory, "fix23d", "--generator", "none", docs=DOCS, timeout=60)


def _error(server, path: str, body: dict) -> dict:
    r = requests.post(server.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    return r.json()["error"]


def test_min_seq_never_issued_names_min_seq(server):
    bad = server.seq + 1000
    err = _error(server, "/retrieve", {"query": "harbour", "min_seq": bad})
    assert err["param"] == "min_seq" and err["message"].startswith("min_seq is too large: "), err
    assert f"sequence number {bad} was never issued" in err["message"], err
    chat = _error(server, "/chat/completions", {"model": "oprag", "messages": [{"role": "user", "content": "harbour"}],
                                                "oprag": {"min_seq": bad}})
    assert chat["param"] == "oprag.min_seq" and chat["message"] == err["message"], chat
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.retrieve("harbour", min_seq=bad)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details() == err["message"]


def test_an_all_whitespace_document_id_is_refused_like_an_empty_one(server):
    r = server.grpc.ingest([Doc("   ", "zebra wsid"), Doc("\t", "zebra tab"), Doc(" spaced id ", "zebra kept")])
    assert r.documents_written == 1, r  # an id with other characters is kept as it is
    assert {(x.id, x.reason) for x in r.rejected} == {
        (i, "id is only whitespace: give every document an id with a character other than whitespace") for i in ("   ", "\t")}
    hits = server.grpc.retrieve("zebra", mode="lexical", top_k=5).hits
    assert [h.doc_id for h in hits] == [" spaced id "], hits
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.stub.Delete(oprag_pb2.DeleteRequest(doc_ids=["tide0", "  "]), timeout=60, metadata=server.grpc.md)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "doc_ids contains an empty or all-whitespace id" in ei.value.details()


def test_a_metadata_filter_key_over_1024_bytes_is_refused(server):
    assert server.grpc.retrieve("harbour", filters={"k" * 1024: "x"}).hits == []  # at the limit: no match, no error
    for key in ("k" * 1025, "é" * 513, "k" * 100_000):
        with pytest.raises(grpc.RpcError) as ei:
            server.grpc.retrieve("harbour", filters={key: "x"})
        n = len(key.encode())
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(f"a metadata filter key is {n} bytes of UTF-8; the limit is 1024"), ei.value.details()
        assert len(ei.value.details()) < 300  # the key is not echoed whole
    err = _error(server, "/retrieve", {"query": "harbour", "filters": {"k" * 2000: "x"}})
    assert err["param"] == "filters" and "the limit is 1024" in err["message"], err
