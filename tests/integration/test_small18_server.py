"""small18's checks on one real server (2 shards, one replica each, HTTP on):

* ``POST /v1/retrieve`` with ``group_by_document`` / ``chunks_per_document``: the same documents,
  order, scores and per-document chunks as the gRPC ``Retrieve`` with the same settings, in every
  mode, and the same validation (the message gRPC gives, as a 400 naming the field). Before
  small18 the HTTP endpoint refused both fields as unknown.
* ``oprag_shard_replica_up`` without ``--replicas``: replica 0 of each shard
  (test_small18_replica_up.py has ``--replicas 2`` and a killed replica).
* Session memory writes (a recorded turn, ``ClearSession``) are snapshotted by the periodic
  snapshot (``--snapshot-interval-s 1`` here) like committed writes, and ``oprag_memory_records``
  follows them. Before small18 they marked nothing: a server that only answered session queries
  never snapshotted them (its write-ahead logs grew, a restart replayed them all) and the gauge
  kept the value of the last ingest.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from oprag_client.testing import ServerProcess, free_port

from oprag_client.client import Doc, OpRAGClient

sys.path.insert(0, str(Path(__file__).parent))
from test_small18_replica_up import _until  # noqa: E402

pytestmark = pytest.mark.integration
TOPICS = {
    "harbour": ["The harbour master logs every ferry that leaves at high water.",
                "Tide tables for the harbour list high water and low water times.",
                "Winter storms close the harbour to small boats for weeks."],
    "ferry": ["The ferry timetable changes in winter, with fewer sailings a day.",
              "Ferry crossings to the island take forty minutes at high water."],
    "lighthouse": ["The lighthouse keeper kept a log of ships passing the harbour.",
                   "A lighthouse lantern turns once every ten seconds.",
                   "The keeper's log records storms, ferries and the tide."],
    "bees": ["Honey bees dance on the comb to show where flowers are.",
             "A waggle dance encodes distance and direction to food."],
    "tides": ["Spring tides bring the highest high water of the month.",
              "Tide tables are printed for every harbour on the coast."],
}
QUESTIONS = ["harbour high water tide", "ferry in winter", "lighthouse keeper log"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("small18-http")
    srv = ServerProcess(d / "data", free_port(), free_port(), "--shards", "2", "--generator", "none",
                        "--chunk-size", "24", "--http-port", str(free_port()), "--snapshot-interval-s", "1")
    srv.http_port = int(srv.extra[srv.extra.index("--http-port") + 1])
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest([Doc(k, "\n\n".join(v), title=k.title()) for k, v in TOPICS.items()])
            srv.grpc = c
            yield srv
    finally:
        srv.stop()


def _post(server, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/retrieve", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _hit(h) -> tuple:
    return (h.chunk_id, h.doc_id, h.score, h.dense_score, h.lexical_score, h.dense_rank, h.lexical_rank)


def _hit_json(h: dict) -> tuple:
    return tuple(h[k] for k in ("chunk_id", "doc_id", "score", "dense_score", "lexical_score", "dense_rank", "lexical_rank"))


@pytest.mark.parametrize("opts", [
    {"mode": "hybrid", "top_k": 3},
    {"mode": "dense", "top_k": 4, "chunks_per_document": 2},
    {"mode": "lexical", "top_k": 2, "chunks_per_document": 2},  # (LEXICAL: chunks of BM25 score > 0 only)
    {"mode": "full_hybrid", "top_k": 5, "chunks_per_document": 2},
    {"mode": "full_hybrid", "top_k": 3, "chunks_per_document": 2, "fusion": {"method": "rrf", "rrf_k": 10}},
])
def test_grouped_http_retrieve_equals_grpc(server, opts):
    kw = {k: v for k, v in opts.items() if k != "fusion"}
    kw |= {"fusion": "rrf", "rrf_k": 10} if "fusion" in opts else {}
    most = 0  # the most chunks a document brought
    for q in QUESTIONS:
        status, h = _post(server, {"query": q, "group_by_document": True, **opts})
        assert status == 200, h
        g = server.grpc.retrieve(q, group_by_document=True, **kw)
        assert g.documents and len(h["documents"]) == len(g.documents) <= opts["top_k"]
        assert [(d["doc_id"], d["title"], d["score"]) for d in h["documents"]] == \
            [(d.doc_id, d.title, d.score) for d in g.documents]  # same documents, order, scores (exact)
        assert [[_hit_json(x) for x in d["hits"]] for d in h["documents"]] == \
            [[_hit(x) for x in d.hits] for d in g.documents]
        assert [_hit_json(x) for x in h["hits"]] == [_hit(x) for x in g.hits]
        most = max(most, *(len(d["hits"]) for d in h["documents"]))
    assert most == opts.get("chunks_per_document", 1)  # (documents of several chunks: the grouping shows)
    # the chunk-level reply says no documents, as gRPC's empty field
    status, h = _post(server, {"query": QUESTIONS[0], "top_k": 3})
    assert status == 200 and h["documents"] == [] and len(h["hits"]) == 3


@pytest.mark.parametrize("body, param", [
    ({"chunks_per_document": 2}, "chunks_per_document"),  # without group_by_document
    ({"group_by_document": True, "top_k": 100, "chunks_per_document": 50}, "chunks_per_document"),
])
def test_grouped_http_validation_is_grpcs(server, body, param):
    status, h = _post(server, {"query": "harbour", **body})
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.retrieve("harbour", **body)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status == 400 and h["error"]["message"] == ei.value.details() and h["error"]["param"] == param, h


@pytest.mark.parametrize("body, want", [({"group_by_document": "yes"}, "group_by_document must be a boolean"),
                                        ({"group_by_document": True, "chunks_per_document": -1},
                                         "chunks_per_document must be at least 0")])
def test_grouped_http_types_are_checked(server, body, want):
    status, h = _post(server, {"query": "harbour", **body})
    assert status == 400 and h["error"]["message"].startswith(want), h


def test_single_replica_reports_replica_zero(server):
    assert _until(server, {(0, 0): 1.0, (1, 0): 1.0}) == 2


def _logs(server) -> dict[str, tuple[str, int]]:
    """``{shard directory: (CURRENT snapshot, write-ahead log bytes)}``."""
    return {d.name: ((d / "CURRENT").read_text().strip() if (d / "CURRENT").exists() else "", (d / "wal.log").stat().st_size)
            for d in sorted(server.data_dir.glob("shard-*"))}


def _wait(what, timeout: float = 60.0):
    t, got = time.monotonic(), None
    while time.monotonic() - t < timeout:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not reached in {timeout} s")


def _memory_gauge(server) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^oprag_memory_records (\S+)$", body, re.M).group(1))


def test_memory_writes_are_snapshotted_and_counted(server):
    c = server.grpc
    before = _wait(lambda: (lambda g: g if all(n == 0 for _, n in g.values()) else None)(_logs(server)))  # all saved
    for q in QUESTIONS:
        c.retrieve(q, session_id="small18-memory", top_k=2)  # each records a turn (the shard's log, fsync)
    assert c.stats().memory_records == len(QUESTIONS)
    # the next rounds of the snapshot loop save them: every log empty again, the session's shard on a new snapshot
    after = _wait(lambda: (lambda g: g if all(n == 0 for _, n in g.values()) and g != before else None)(_logs(server)), 30)
    assert sum(after[k][0] != before[k][0] for k in after) >= 1
    _wait(lambda: _memory_gauge(server) == len(QUESTIONS), 30)
    # a ClearSession too
    assert c.clear_session("small18-memory").records_removed == len(QUESTIONS)
    _wait(lambda: (lambda g: g if all(n == 0 for _, n in g.values()) and g != after else None)(_logs(server)), 30)
    _wait(lambda: _memory_gauge(server) == 0, 30)
