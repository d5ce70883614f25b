"""New-user trial 22 (branch fix22b), over a real server (test_fix21b's: 2 shard processes, HTTP
port, no generator): the chat endpoint takes ``min_seq`` and ``query_vector`` in its ``oprag`` extension,
as ``/v1/retrieve`` takes them (the same checks, messages and effect)."""

from __future__ import annotations

import json

import pytest
import requests

from test_fix21b import server  # noqa: F401 - the same real server (tests/integration is on sys.path)

pytestmark = pytest.mark.integration


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body, allow_nan=True),
                         headers={"Content-Type": "application/json"}, timeout=60)


def _chat(server, question: str, stream: bool = False, **oprag) -> requests.Response:
    return _post(server, "/chat/completions", {"model": "oprag", "stream": stream, "oprag": oprag,
                                               "messages": [{"role": "user", "content": question}]})


def _error(r: requests.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    return r.json()["error"]


@pytest.fixture(scope="module")
def bees_vector(server) -> list[float]:
    models = requests.get(server.url + "/models", timeout=30).json()["data"]
    return _post(server, "/embeddings", {"model": models[-1]["id"], "input": "honey bees dancing"}).json()["data"][0]["embedding"]


def test_chat_searches_with_the_query_vector_as_retrieve_does(server, bees_vector):
    # the vector, not the question, is what is searched (dense: the question says lighthouse)
    r = _chat(server, "lighthouse", mode="dense", top_k=3, query_vector=bees_vector)
    assert r.status_code == 200, r.text
    hits = [h["chunk_id"] for h in r.json()["oprag"]["hits"]]
    assert r.json()["oprag"]["hits"][0]["doc_id"] == "bees"
    assert r.json()["oprag"]["timings_ms"].get("embed") is None  # not embedded
    same = _post(server, "/retrieve", {"query": "lighthouse", "mode": "dense", "top_k": 3, "query_vector": bees_vector})
    assert hits == [h["chunk_id"] for h in same.json()["hits"]]
    assert hits == [h.chunk_id for h in server.grpc.retrieve("lighthouse", mode="dense", top_k=3, query_vector=bees_vector).hits]
    own = _chat(server, "lighthouse", mode="dense", top_k=3)  # without it: the question is embedded
    assert own.json()["oprag"]["hits"][0]["doc_id"] == "lighthouse" and "embed" in own.json()["oprag"]["timings_ms"]
    events = [json.loads(line[6:]) for line in _chat(server, "lighthouse", stream=True, mode="dense", top_k=3,
                                                     query_vector=bees_vector).text.splitlines()
              if line.startswith("data: {")]
    assert [h["chunk_id"] for h in events[0]["oprag"]["hits"]] == hits  # streamed too


def test_chat_query_vector_checks_and_messages_are_retrieves(server, bees_vector):
    dim = len(bees_vector)
    for vec in ([0.1, 0.2, 0.3], [], [0.0] * dim, [float("nan")] + [0.1] * (dim - 1), [10**400] + [0.1] * (dim - 1),
                [0.1, "x"], [True] * dim, "0.1,0.2"):
        want = _error(_post(server, "/retrieve", {"query": "bees", "query_vector": vec}))
        got = _error(_chat(server, "bees", query_vector=vec))
        # the same message; one from the request's shape names the field as the chat request spells it
        assert got["message"].replace("oprag.", "", 1) == want["message"], (vec[:3], got, want)
        assert got["param"] == f"oprag.{want['param']}", (vec[:3], got, want)
        assert _error(_chat(server, "bees", stream=True, query_vector=vec)) == got  # a 400, not a stream
    assert _chat(server, "bees", query_vector=None).status_code == 200  # null: embed the question


def test_chat_min_seq(server):
    r = _chat(server, "harbour high water", min_seq=server.seq)
    assert r.status_code == 200 and r.json()["oprag"]["hits"], r.text
    assert _chat(server, "harbour high water", stream=True, min_seq=server.seq).status_code == 200
    for bad in (server.seq + 1000, -1, "3", 2**64):
        want = _error(_post(server, "/retrieve", {"query": "harbour", "min_seq": bad}))
        got = _error(_chat(server, "harbour", min_seq=bad))
        assert got["message"].replace("oprag.", "", 1) == want["message"], (bad, got, want)
        assert got["param"] == (want["param"] and f"oprag.{want['param']}"), (bad, got, want)
        assert _error(_chat(server, "harbour", stream=True, min_seq=bad)) == got  # a 400 before the stream starts
    assert "was never issued" in _error(_chat(server, "harbour", min_seq=server.seq + 1000))["message"]
