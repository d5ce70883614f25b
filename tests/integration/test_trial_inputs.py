"""What the new-user trial (issue 13) found at a real server's doors, one server for the module
(1 shard, no generator, HTTP on): requests another client builds by hand (raw protobuf bytes)
are answered INVALID_ARGUMENT with a message saying the request could not be parsed, never
INTERNAL or a UTF-8-only hint; ``/v1/retrieve`` refuses unknown fields and says which, explains
bad values by field, and refuses a reply over the message limit as gRPC does (JSON escapes make
a reply several times its protobuf size)."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import requests

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration
LIMIT = 32 * 1024 * 1024  # the server's default message limit (LimitsConfig.max_message_bytes)
#: 3.5 MB of control characters after a findable word: 3.5 MB of protobuf, 21 MB of JSON ("\u0001" each)
ESCAPED = "\x01" * 3_500_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    http_port = free_port()
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("trial") / "data", "--generator", "none", "--shards", "1",
                                      "--http-port", str(http_port))
    srv.start()
    srv.url = f"http://127.0.0.1:{http_port}/v1"
    V = np.random.default_rng(5).standard_normal((3, 384)).astype(np.float32)
    with OpRAGClient(srv.target, timeout=120) as c:
        c.ingest([Doc("note", "a short note about lobsters and their claws", vector=V[0]),
                  Doc("escaped1", chunks=[("crustacean " + ESCAPED, V[1])]),
                  Doc("escaped2", chunks=[("crustacean " + ESCAPED + "2", V[2])])])
        srv.client = c
        yield srv
    srv.stop()


def _raw(server, method: str, payload: bytes, stream: bool = False):
    """Call ``method`` with ``payload`` as the request's bytes, as a client with its own encoder would."""
    ch = server.client.channel
    if stream:
        return ch.stream_unary(f"/oprag.v1.OpRAG/{method}", request_serializer=lambda b: b,
                               response_deserializer=oprag_pb2.IngestResponse.FromString)(iter([payload]), timeout=60)
    return ch.unary_unary(f"/oprag.v1.OpRAG/{method}", request_serializer=lambda b: b,
                          response_deserializer=oprag_pb2.RetrieveResponse.FromString)(payload, timeout=60)


def _field(num: int, wire: int, data: bytes) -> bytes:
    """One protobuf field: tag, then (wire type 2) the length and the bytes."""
    assert len(data) < 128
    return bytes([num << 3 | wire]) + (bytes([len(data)]) if wire == 2 else b"") + data


GOOD_DOC = oprag_pb2.Document(id="never", text="never stored").SerializeToString()
RAW = {  # (method, request bytes, what is wrong)
    "lone surrogate in the question": ("Retrieve", _field(1, 2, b"lob\xed\xa0\x80ster"), "WTF-8 of '\\ud800'"),
    "corrupt bytes": ("Retrieve", b"\x0a\xff\xff\xff\x0f", "a length past the end"),
    "truncated request": ("Retrieve", oprag_pb2.QueryRequest(question="lobster", top_k=3).SerializeToString()[:-1], ""),
    "lone surrogate in a document": ("Ingest", _field(1, 2, _field(1, 2, b"d1") + _field(3, 2, b"caf\xed\xb0\x80")), ""),
    "vector of 5 bytes (not floats)": ("Ingest", _field(1, 2, _field(1, 2, b"d1") + _field(3, 2, b"t") + _field(6, 2, b"0.1,x")), ""),
}


@pytest.mark.parametrize("case", sorted(RAW))
def test_a_request_that_does_not_parse_is_invalid_argument_saying_so(server, case):
    method, payload, _ = RAW[case]
    with pytest.raises(grpc.RpcError) as ei:
        _raw(server, method, payload, stream=method == "Ingest")
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, ei.value.details())
    assert f"the {method} request could not be parsed" in ei.value.details() and "send the serialised" in ei.value.details()
    assert server.client.stats().documents == 3 and server.alive()


def test_vectors_another_client_can_send_are_refused_by_value(server):
    c = server.client
    for bad in ([float("nan")] * 384, [0.0] * 384, [0.5] * 3):  # NaN, all zeros, the wrong width
        with pytest.raises(grpc.RpcError) as ei:
            c.stub.Retrieve(oprag_pb2.QueryRequest(question="lobster", query_vector=bad), timeout=60)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query_vector" in ei.value.details()
    # 4 bytes of text where the floats go parse as one float: a document vector of the wrong width
    payload = _field(1, 2, _field(1, 2, b"d1") + _field(3, 2, b"text") + _field(6, 2, b"0.1x")) + _field(2, 0, b"\x01")
    with pytest.raises(grpc.RpcError) as ei:
        _raw(server, "Ingest", payload, stream=True)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "a vector has 1 values" in ei.value.details()
    assert c.stats().documents == 3
    # an empty query_vector on the wire is "no vector" (proto3 cannot tell them apart): the question is embedded
    assert c.stub.Retrieve(oprag_pb2.QueryRequest(question="lobster claws", query_vector=[]), timeout=60).hits


def _post(server, body, path="/retrieve"):
    r = requests.post(server.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=120)
    return r.status_code, r.json()


@pytest.mark.parametrize("body, param, words", [
    ({"query": "lobster", "topk": 1}, "topk", ["unknown field 'topk'", "did you mean 'top_k'?"]),
    ({"query": "lobster", "fusion": {"method": "rrf", "rrfk": 5}}, "fusion.rrfk", ["unknown field", "'rrf_k'"]),
    ({"query": "lobster", "top_k": "five"}, "top_k", ['top_k must be an integer, got "five"']),
    ({"qury": "lobster"}, "qury", ["did you mean 'query'?"]),
    ({}, "query", ["query is required"]),
    ({"query": "lobster", "filters": {"topic": [{"x": 1}]}}, "filters.topic[0]",
     ["filters.topic[0] must be a string, a boolean or a number, got {\"x\": 1}"]),
    ({"query": "lobster", "mode": "psychic"}, "mode", ["mode must be one of 'hybrid'", 'got "psychic"']),
])
def test_http_retrieve_names_the_field_and_what_to_change(server, body, param, words):
    code, out = _post(server, body)
    assert code == 400 and out["error"]["param"] == param, out
    for w in words:
        assert w in out["error"]["message"], out


def test_http_chat_refuses_unknown_oprag_options_but_not_unknown_openai_fields(server):
    msgs = [{"role": "user", "content": "lobster claws"}]
    code, out = _post(server, {"model": "oprag", "messages": msgs, "oprag": {"topk": 2}}, "/chat/completions")
    assert code == 400 and out["error"]["param"] == "oprag.topk", out
    code, out = _post(server, {"model": "oprag", "messages": msgs, "top_p": 0.5, "seed": 1, "oprag": {"top_k": 2}},
                      "/chat/completions")
    assert code == 200 and [h["doc_id"] for h in out["oprag"]["hits"]][0] == "note", out


def test_http_reply_over_the_message_limit_is_refused_like_grpc(server):
    g = server.client.retrieve("crustacean", mode="lexical", top_k=2)  # 7 MB of protobuf: under the limit
    assert {h.doc_id for h in g.hits} == {"escaped1", "escaped2"}
    code, out = _post(server, {"query": "crustacean", "mode": "lexical", "top_k": 2})  # ~42 MB of JSON
    assert code == 400, (code, str(out)[:300])
    msg = out["error"]["message"]
    assert f"over the server's {LIMIT}-byte message limit" in msg and "fewer hits" in msg and "top_k 2" in msg, msg
    code, out = _post(server, {"query": "crustacean", "mode": "lexical", "top_k": 1})  # ~21 MB: fits
    assert code == 200 and len(out["hits"]) == 1 and out["hits"][0]["text"].endswith("\x01")
    for stream in (False, True):  # chat carries the hits too: in its reply, or in the stream's first chunk
        chat = {"model": "oprag", "messages": [{"role": "user", "content": "crustacean"}], "stream": stream,
                "oprag": {"mode": "lexical", "top_k": 2}}
        code, out = _post(server, chat, "/chat/completions")
        assert code == 400 and "over the server's" in out["error"]["message"], (stream, code, str(out)[:300])
    r = requests.post(server.url + "/chat/completions", json={**chat, "oprag": {"mode": "lexical", "top_k": 1}}, timeout=120)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


def test_delete_of_one_string_is_refused_not_read_as_one_id_per_character(server):
    """``c.delete("xyz")`` deleted the documents "x", "y" and "z" (a str is an iterable of ids)
    and not "xyz"; the clients now refuse a lone string before sending, and nothing is deleted."""
    c = server.client
    V = np.random.default_rng(7).standard_normal((4, 384)).astype(np.float32)
    ids = ["x", "y", "z", "xyz"]
    c.ingest([Doc(i, f"per-character delete check {i}", vector=V[k], metadata={"dc": i}) for k, i in enumerate(ids)])
    try:
        with pytest.raises(TypeError, match=r"doc_ids must be a list of ids.*pass \['xyz'\]"):
            c.delete("xyz")
        for i in ids:
            assert c.retrieve("check", mode="dense", top_k=1, filters={"dc": i}).hits, f"{i} was deleted"
        assert c.delete(["xyz"]).documents_deleted == 1
    finally:
        c.delete(ids)


def test_cli_ingest_reports_input_positions_across_streams_and_what_a_failure_left(server, tmp_path, capsys):
    """``oprag ingest --docs-per-stream 2``: a rejection's index is the document's position in the
    input also after a stream that repeated an id (it was offset by the documents written, so one
    position short), and a failing later stream says which streams were committed before it."""
    from oprag_client import cli

    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in [
        {"id": "dupx", "text": "first version"}, {"id": "dupx", "text": "second version"},
        {"id": "okx", "text": "fine"}, {"id": "emptyx", "text": " "}]) + "\n")
    try:
        args = ["ingest", "--server", server.target, "--no-progress", "--docs-per-stream", "2", "--format", "jsonl"]
        assert cli.main(args + ["--json", str(f)]) == 0
        out = capsys.readouterr()
        assert [r["index"] for r in json.loads(out.out)["rejected"]] == [3] and "rejected #3 'emptyx'" in out.err
        bad = tmp_path / "bad.jsonl"  # stream 2 is refused whole: a vector of the wrong width
        bad.write_text('{"id": "p1", "text": "fine"}\n{"id": "p2", "text": "fine"}\n{"id": "p3", "text": "x", "vector": [0.1]}\n')
        assert cli.main(args + [str(bad)]) == 1
        err = capsys.readouterr().err
        assert "stream 1 was committed (the first 2 documents of the input" in err
        assert "stream 2 (its document 0 is input document #2) and the rest stored nothing" in err
        assert "INVALID_ARGUMENT" in err
    finally:
        server.client.delete(["dupx", "okx", "p1", "p2"])
