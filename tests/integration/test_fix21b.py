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

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration
DOCS = [Doc(f"tide{i}", f"Tide tables for harbour {i} list the high water times of each day.", title=f"Harbour {i}")
        for i in range(12)] + [
    Doc("bees", "Honey bee foragers tell their nestmates where food is by dancing on the comb.", title="Bees"),
    Doc("lighthouse", "The Varnholm Lighthouse stands on a granite skerry; it was completed in 1874.", title="Lighthouse")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fix21b")
    http_port = free_port()
    srv = ServerProcess(d / "data", free_port(), free_port(), "--generator", "none", "--shards", "2",
                        "--http-port", str(http_port)).start()
    srv.url = f"http://127.0.0.1:{http_port}/v1"
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            srv.seq = c.ingest(DOCS).seq
            srv.grpc = c
            yield srv
    finally:
        srv.stop()


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


def test_max_tokens_must_be_at_least_one(server):
    user = [{"role": "user", "content": "When was the lighthouse completed?"}]
    for field in ("max_tokens", "max_completion_tokens"):
        for n in (0, -1, -(2**40)):
            err = _error(_post(server, "/chat/completions", {"model": "oprag", "messages": user, field: n}))
            assert err["param"] == field and f"{field} must be at least 1, got {n}" in err["message"], err
    for extra in ({}, {"max_tokens": None}, {"max_tokens": 1}):  # absent or null: the server's default
        assert _post(server, "/chat/completions", {"model": "oprag", "messages": user, **extra}).status_code == 200


def _metrics(server) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(oprag_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _shard_pids(server_pid: int) -> list[int]:
    kids = psutil.Process(server_pid).children()
    return [p.pid for p in kids if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]

