"""New-user trial 21 findings, over a real server (2 shard processes, HTTP port, no generator):
invalid UTF-8 in an HTTP body, ``/v1/retrieve``'s reply without the generation fields and with
``min_seq`` / ``query_vector``, ``max_tokens`` 0, the index gauges while a shard is down, and an
undecodable gRPC health request."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import grpc
import psutil
import pytest
import requests
from grpc_health.v1 import health_pb2

from oprag_client.client import Doc
from server_fixtures import http_server  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = pytest.mark.integration
DOCS = [Doc(f"tide{i}", f"Tide tables for harbour {i} list the high water times of each day.", title=f"Harbour {i}")
        for i in range(12)] + [
    Doc("bees", "Honey bee foragers tell their nestmates where food is by dancing on the comb.", title="Bees"),
    Doc("lighthouse", "The Varnholm Lighthouse stands on a granite skerry; it was completed in 1874.", title="Lighthouse")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from http_server(tmp_path_factory, "fix21b", "--generator", "none", "--shards", "2", docs=DOCS, timeout=60)


def _post(server, path: str, body, **kw) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True)
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60, **kw)


def _error(r: requests.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def test_invalid_utf8_body_is_a_400_naming_utf8_and_the_byte_offset(server):
    for path, body in (("/retrieve", b'{"query": "tide \xff tables"}'),
                       ("/chat/completions", b'{"model": "oprag", "messages": [{"role": "user", "content": "\xc3\x28"}]}'),
                       ("/embeddings", b'{"model": "x", "input": "\x80\x80"}')):
        err = _error(_post(server, path, body))
        at = re.search(rb"[\x80-\xff]", body).start()
        assert "not valid UTF-8" in err["message"] and f"byte offset {at}" in err["message"], err
        assert err["code"] == "invalid_json"


def test_retrieve_reply_has_no_generation_fields(server):
    r = _post(server, "/retrieve", {"query": "harbour high water", "top_k": 3, "include_trace": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert not {"finish_reason", "ttft_ms", "sources"} & set(body), sorted(body)
    assert {"object", "request_id", "hits", "retrieval", "memory_context", "timings_ms", "trace", "documents"} <= set(body)


def test_max_tokens_must_be_at_least_one(server):
    user = [{"role": "user", "content": "When was the lighthouse completed?"}]
    for field in ("max_tokens", "max_completion_tokens"):
        for n in (0, -1, -(2**40)):
            err = _error(_post(server, "/chat/completions", {"model": "oprag", "messages": user, field: n}))
            assert err["param"] == field and f"{field} must be at least 1, got {n}" in err["message"], err
    for extra in ({}, {"max_tokens": None}, {"max_tokens": 1}):  # absent or null: the server's default
        assert _post(server, "/chat/completions", {"model": "oprag", "messages": user, **extra}).status_code == 200


def test_retrieve_min_seq(server):
    r = _post(server, "/retrieve", {"query": "harbour high water", "min_seq": server.seq})
    assert r.status_code == 200 and r.json()["hits"], r.text
    err = _error(_post(server, "/retrieve", {"query": "harbour", "min_seq": server.seq + 1000}))
    assert f"sequence number {server.seq + 1000} was never issued" in err["message"], err  # gRPC's message
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.retrieve("harbour", min_seq=server.seq + 1000)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details() == err["message"]
    for bad, want in ((-1, "min_seq must be at least 0"), ("3", "min_seq must be an integer"),
                      (2**64, "min_seq must be at most")):
        err = _error(_post(server, "/retrieve", {"query": "harbour", "min_seq": bad}))
        assert want in err["message"] and err["param"] == "min_seq", err


def test_retrieve_query_vector(server):
    models = requests.get(server.url + "/models", timeout=30).json()["data"]
    emb = _post(server, "/embeddings", {"model": models[-1]["id"], "input": "honey bees dancing"}).json()["data"][0]["embedding"]
    # the vector, not the query text, is what is searched (dense: the text says lighthouse)
    r = _post(server, "/retrieve", {"query": "lighthouse", "mode": "dense", "top_k": 3, "query_vector": emb})
    assert r.status_code == 200, r.text
    hits = [h["chunk_id"] for h in r.json()["hits"]]
    assert r.json()["hits"][0]["doc_id"] == "bees"
    g = server.grpc.retrieve("lighthouse", mode="dense", top_k=3, query_vector=emb)
    assert hits == [h.chunk_id for h in g.hits]  # as gRPC with the same vector
    dim = len(emb)
    cases = [([0.1, 0.2, 0.3], f"query_vector has 3 values; the embedder produces {dim}"),
             ([], "query_vector: it is empty"), ([0.0] * dim, "query_vector is all zeros"),
             ([float("nan")] + [0.1] * (dim - 1), "query_vector contains NaN or infinity"),
             ([10**400] + [0.1] * (dim - 1), "query_vector contains NaN or infinity"),  # not a 500 (float overflow)
             ([0.1, "x"], "query_vector[1] must be a number"), ([True] * dim, "query_vector[0] must be a number"),
             ("0.1,0.2", "query_vector must be a list")]
    for vec, want in cases:
        err = _error(_post(server, "/retrieve", {"query": "bees", "query_vector": vec}))
        assert want in err["message"] and err["param"] and err["param"].startswith("query_vector"), (vec[:3], err)
    with pytest.raises(grpc.RpcError) as ei:  # the same message as gRPC's
        server.grpc.retrieve("bees", query_vector=[0.1, 0.2, 0.3])
    assert ei.value.details() == f"query_vector has 3 values; the embedder produces {dim}"
    assert _post(server, "/retrieve", {"query": "bees", "query_vector": None}).status_code == 200  # null: embed the query
    r = _post(server, "/chat/completions", {"model": "oprag", "messages": [{"role": "user", "content": "x"}],
                                            "oprag": {"query_vector": emb}})
    assert r.status_code == 200, r.text  # also in a chat request since fix22b (tests/integration/test_fix22b.py)


def test_health_check_with_an_undecodable_request_is_invalid_argument(server):
    with grpc.insecure_channel(server.target) as ch:
        for raw in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff", b"\x0a\x10ab"):  # bad UTF-8, bad tag, truncated
            with pytest.raises(grpc.RpcError) as ei:
                ch.unary_unary("/grpc.health.v1.Health/Check")(raw, timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
            assert "could not be parsed" in ei.value.details() and "grpc.health.v1" in ei.value.details()
            with pytest.raises(grpc.RpcError) as ei:
                next(iter(ch.unary_stream("/grpc.health.v1.Health/Watch")(raw, timeout=10)))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        ok = health_pb2.HealthCheckRequest(service="").SerializeToString()
        assert health_pb2.HealthCheckResponse.FromString(ch.unary_unary("/grpc.health.v1.Health/Check")(ok, timeout=10)).status \
            == health_pb2.HealthCheckResponse.SERVING
        first = next(iter(ch.unary_stream("/grpc.health.v1.Health/Watch")(ok, timeout=10)))
        assert health_pb2.HealthCheckResponse.FromString(first).status == health_pb2.HealthCheckResponse.SERVING
    assert server.grpc.health() == "SERVING"


def _metrics(server) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(oprag_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _shard_pids(server_pid: int) -> list[int]:
    kids = psutil.Process(server_pid).children()
    return [p.pid for p in kids if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def test_index_gauges_leave_a_down_shard_out_and_count_it_again(server):
    """Run last in this module (it kills a shard). While a shard is down, ``oprag_documents`` and
    ``oprag_chunks`` are the other shard's (as Stats) and the down shard's ``oprag_shard_bytes``
    series are gone; after its restart they are the totals again and its series are back."""
    st = server.grpc.stats()
    per = {s.shard: s for s in st.shards}
    assert per[0].documents and per[1].documents
    m = _metrics(server)
    assert m["oprag_documents"] == st.documents and m['oprag_shard_bytes{component="chunks",shard="0"}'] > 0
    pids = _shard_pids(server.proc.pid)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    down = None  # the shard killed (the one whose oprag_shard_replica_up turns 0)
    seen_partial = False
    deadline = time.time() + 90
    while time.time() < deadline:
        m = _metrics(server)
        if m["oprag_shards_up"] == 1:
            down = next(i for i in (0, 1) if m[f'oprag_shard_replica_up{{replica="0",shard="{i}"}}'] == 0)
            left = [k for k in m if k.startswith("oprag_shard_bytes{") and f'shard="{down}"' in k]
            if (m["oprag_documents"], m["oprag_chunks"]) == (per[1 - down].documents, per[1 - down].chunks) and not left:
                seen_partial = True
        elif down is not None and m["oprag_shards_up"] == 2 and m["oprag_documents"] == st.documents \
                and f'oprag_shard_bytes{{component="chunks",shard="{down}"}}' in m:
            break
        time.sleep(0.005)
    else:
        pytest.fail(f"the shard was not seen down, or the gauges did not come back after its restart: {m}")
    assert seen_partial, "the index gauges kept the down shard's counts and series"
    assert m["oprag_chunks"] == st.chunks and m[f'oprag_shard_replica_up{{replica="0",shard="{down}"}}'] == 1
