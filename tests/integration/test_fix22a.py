"""New-user trial 22 (branch fix22a), over real servers (2 shard processes, no generator):

* a start on a data directory written with the flat index and restarted with ``--dense-index
  hnsw`` converted the index (157 s on 30K chunks) without a log line, and a large data
  directory's snapshot load and log replay were silent too: each shard now logs the start of
  each step (with its size) and its end (with the seconds taken), in order;
* labelled counters were absent from ``/metrics`` until their first increment: a fresh server now
  exports the known label combinations as 0;
* session ids with NUL, other control characters or leading/trailing whitespace were accepted:
  now ``INVALID_ARGUMENT`` (HTTP 400) saying what a session id may be.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
import requests

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration
COMMON = ("--generator", "none", "--shards", "2", "--snapshot-interval-s", "3600")
FIRST = [Doc(f"reef{i}", f"Coral reef number {i} shelters parrotfish and moray eels near the atoll.", title=f"Reef {i}")
         for i in range(8)]
LATER = [Doc(f"kite{i}", f"Box kite {i} was flown by Lawrence Hargrave over the beach in 1893.", title=f"Kite {i}")
         for i in range(8)]
RULE = ("a session id is 1 to 256 bytes of UTF-8 with no control characters (U+0000-U+001F, U+007F-U+009F) and "
        "no leading or trailing whitespace")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Flat index: ingest FIRST, stop (snapshot); start again, ingest LATER, kill -9 (LATER only in
    the write-ahead logs); then start with ``--dense-index hnsw`` and the HTTP API: ``srv.startup``
    is that start's output, ``srv.first_scrape`` its /metrics before any request."""
    data = tmp_path_factory.mktemp("fix22a") / "data"
    flat = ServerProcess(data, free_port(), free_port(), *COMMON)
    try:
        flat.start()
        with OpRAGClient(flat.target, timeout=120) as c:
            c.ingest(FIRST)
        assert flat.stop() == 0
        flat.start()
        with OpRAGClient(flat.target, timeout=120) as c:
            c.ingest(LATER)
    finally:
        flat.kill9()
    http_port = free_port()
    srv = ServerProcess(data, free_port(), free_port(), *COMMON, "--dense-index", "hnsw", "--http-port", str(http_port))
    srv.start()
    try:
        srv.startup = list(srv.lines)
        srv.first_scrape = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30).text
        srv.url = f"http://127.0.0.1:{http_port}/v1"
        with OpRAGClient(srv.target, timeout=120) as c:
            srv.grpc = c
            yield srv
    finally:
        srv.stop()


def _index(lines: list[str], pattern: str) -> tuple[int, re.Match]:
    """(position, match) of the one line matching ``pattern``."""
    found = [(i, m) for i, ln in enumerate(lines) if (m := re.search(pattern, ln))]
    assert len(found) == 1, (pattern, found, "".join(lines))
    return found[0]


def test_start_up_steps_are_logged_per_shard_in_order_with_sizes_and_times(server):
    lines, total, replayed = server.startup, 0, 0
    for s in (0, 1):
        sh = rf"shard {s}: "
        a, m = _index(lines, sh + r"loading snapshot (snap-\S+): (\d+) chunks$")
        snap, n = m[1], int(m[2])
        b, m = _index(lines, sh + rf"converting the dense index to hnsw: {n} rows \(the snapshot's index is flat\)$")
        c, m = _index(lines, sh + rf"converted the dense index to hnsw: {n} rows in (\d+\.\d) s$")
        d, m = _index(lines, sh + rf"snapshot {re.escape(snap)} loaded: {n} chunks in (\d+\.\d) s$")
        e, m = _index(lines, sh + r"replaying the write-ahead log: (\d+) bytes$")
        assert int(m[1]) > 0
        f, m = _index(lines, sh + r"write-ahead log replayed: (\d+) records applied in (\d+\.\d) s$")
        assert a < b < c < d < e < f, "".join(lines)
        total, replayed = total + n, replayed + int(m[1])
        # each line has the service log's timestamp
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO shard", lines[a]), lines[a]
    assert total == len(FIRST)  # one chunk each, split between the shards
    g, m = _index(lines, r"recovered (\d+) write-ahead log records")
    ready = next(i for i, ln in enumerate(lines) if ln.startswith("OPRAG READY"))
    assert int(m[1]) == replayed > 0 and g < ready
    # and the converted index serves: every document, with an HNSW beam
    hits = server.grpc.retrieve("parrotfish moray eels", top_k=16, ef_search=64).hits
    assert {h.doc_id for h in hits} >= {d.id for d in FIRST}
    assert server.grpc.stats().chunks == len(FIRST) + len(LATER)


def _samples(text: str, name: str) -> dict[tuple, float]:
    out = {}
    for labels, v in re.findall(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        out[tuple(sorted(re.findall(r'(\w+)="(.*?)"', labels)))] = float(v)
    return out


def test_a_fresh_server_exports_its_known_labelled_series_as_zero(server):
    text = server.first_scrape
    req = _samples(text, "oprag_requests_total")
    rpcs = [m.name for m in oprag_pb2.DESCRIPTOR.services_by_name["OpRAG"].methods]
    assert len(rpcs) == 7
    for method in rpcs:
        for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE",
                     "INTERNAL"):
            assert req[(("code", code), ("method", method))] == 0.0, (method, code)
    for route in ("/v1/chat/completions", "/v1/embeddings", "/v1/retrieve", "/v1/models", "other"):
        for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "CANCELLED", "UNAVAILABLE", "INTERNAL"):
            assert req[(("code", code), ("method", f"HTTP {route}"))] == 0.0, (route, code)
    assert not any(dict(k)["code"] == "UNAUTHENTICATED" for k in req)  # no tokens: never answered
    assert set(req.values()) == {0.0}  # bounded: nothing but these
    want = {
        "oprag_writes_after_caller_left_total": [(("kind", k), ("outcome", o)) for k in ("delete", "upsert")
                                                  for o in ("aborted", "applied")],
        "oprag_overload_rejections_total": [(("queue", "ingest"),), (("queue", "query"),), (("queue", "query_latency"),)],
        "oprag_generator_seconds_total": [(("state", "busy"),), (("state", "idle"),)],
        "oprag_embed_tokens_total": [(("kind", "padded"),), (("kind", "real"),)],
        "oprag_answers_without_sources_total": [(("action", "generated"),), (("action", "refused"),)],
        "oprag_engine_tokens_total": [(("kind", "cached"),), (("kind", "completion"),), (("kind", "prompt"),)],
        "oprag_queue_depth": [(("queue", "embed_ingest"),), (("queue", "query"),)],
    }
    for name, labels in want.items():
        assert _samples(text, name) == {k: 0.0 for k in labels}, (name, _samples(text, name))


BAD = [("a\x00b", "session_id contains the control character U+0000 at character 1"),
       ("al\tice", "session_id contains the control character U+0009 at character 2"),
       ("bob\x85", "session_id contains the control character U+0085 at character 3"),
       ("\x7f", "session_id contains the control character U+007F at character 0"),
       (" alice", "session_id starts with whitespace"),
       ("alice\u3000", "session_id ends with whitespace"),
       ("   ", "session_id is only whitespace")]


@pytest.mark.parametrize("sid, why", BAD)
def test_grpc_refuses_a_session_id_with_control_characters_or_outer_whitespace(server, sid, why):
    calls = [lambda: server.grpc.retrieve("kites", session_id=sid), lambda: server.grpc.query("kites", session_id=sid),
             lambda: list(server.grpc.query_stream("kites", session_id=sid))]
    for call in calls:
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details() == f"{why}: {RULE}"
    # fix23a: ClearSession takes any stored id (a session stored before the rule can be cleared)
    assert server.grpc.clear_session(sid).records_removed == 0


def test_grpc_clear_session_needs_one_and_inner_spaces_are_allowed(server):
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.clear_session("")
    assert ei.value.details() == f"session_id is empty: name the session to clear ({RULE})"
    r = server.grpc.retrieve("Who flew box kites?", session_id="alice smith")
    assert r.hits and server.grpc.clear_session("alice smith").records_removed == 1


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                         timeout=60)


@pytest.mark.parametrize("sid, why", BAD)
def test_http_refuses_the_same_session_ids_with_a_400_and_the_same_message(server, sid, why):
    for path, body, param in (("/retrieve", {"query": "kites", "session_id": sid}, "session_id"),
                              ("/chat/completions", {"model": "oprag", "messages": [{"role": "user", "content": "kites"}],
                                                     "oprag": {"session_id": sid}}, "oprag.session_id")):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == f"{why}: {RULE}" and err["param"] == param, err
        assert err["code"] == "invalid_argument"
    assert _post(server, "/retrieve", {"query": "kites", "session_id": "carol jones"}).status_code == 200
