"""New-user trial 22, section 11 (branch fix23a), over real servers (2 shard processes, HTTP port,
no generator):

* JSON ``null`` for an optional HTTP field (``top_k``, ``mode``, ``session_id``, ``filters``,
  ``fusion``, ...) was a 400 ("top_k must be an integer, got null") while ``query_vector``,
  ``max_tokens`` and ``temperature`` null meant the default: null now means absent on every
  request shape, required fields and real type errors keep their 400s;
* ``GET /v1/models/oprag`` answered 200 on a ``--generator none`` server whose ``GET /v1/models``
  lists only the embedder: the per-model endpoint now knows exactly the listed ids;
* ``oprag eval beir --top-k`` accepted only 100: now 10 to 100, Recall reported at that depth;
* a session stored under an id the newer session-id rule refuses (control characters, outer
  whitespace) could not be cleared: ``ClearSession`` now takes any stored id.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
import requests

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port, oprag_cli
from oprag_server.shards.snapshot import meta_crc
from server_fixtures import http_server  # (tests/integration is on sys.path)

pytestmark = pytest.mark.integration
DOCS = [Doc(f"tide{i}", f"Tide tables for harbour {i} list the high water times of each day.", title=f"Harbour {i}")
        for i in range(12)] + [
    Doc("bees", "Honey bee foragers tell their nestmates where food is by dancing on the comb.", title="Bees"),
    Doc("lighthouse", "The Varnholm Lighthouse stands on a granite skerry; it was completed in 1874.", title="Lighthouse")]
#: every optional retrieval knob of /v1/retrieve and of a chat request's "oprag"
KNOBS = ("mode", "top_k", "candidates", "filters", "fusion", "session_id", "disable_memory", "include_trace",
         "ef_search", "nprobe", "query_vector", "min_seq")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from http_server(tmp_path_factory, "fix23a", "--generator", "none", "--shards", "2", docs=DOCS, timeout=60)


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                         timeout=60)


def _ids(reply: dict) -> list[str]:
    return [h["chunk_id"] for h in reply["hits"]]


def _error(r: requests.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


# ------------------------------------------------------------------ null means absent (HTTP)
def test_retrieve_null_knobs_are_the_defaults(server):
    plain = _post(server, "/retrieve", {"query": "honey bee dancing"})
    assert plain.status_code == 200, plain.text[:300]
    nulls = {k: None for k in (*KNOBS, "group_by_document", "chunks_per_document")}
    r = _post(server, "/retrieve", {"query": "honey bee dancing", **nulls})
    assert r.status_code == 200, r.text[:300]
    assert _ids(r.json()) == _ids(plain.json()) and r.json()["hits"][0]["doc_id"] == "bees"
    assert r.json()["retrieval"]["mode"] == plain.json()["retrieval"]["mode"] == "hybrid"
    # inside fusion too, and one knob null beside others set
    r = _post(server, "/retrieve", {"query": "honey bee dancing", "top_k": 2, "session_id": None,
                                    "fusion": {"method": None, "dense_weight": None, "lexical_weight": None, "rrf_k": None}})
    assert r.status_code == 200 and _ids(r.json()) == _ids(plain.json())[:2], r.text[:300]


def test_chat_null_fields_and_null_oprag_knobs_are_the_defaults(server):
    msgs = [{"role": "user", "content": "honey bee dancing"}]
    plain = _post(server, "/chat/completions", {"model": "oprag", "messages": msgs})
    assert plain.status_code == 200, plain.text[:300]
    top = {k: None for k in ("stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "n", "user")}
    for oprag in (None, {k: None for k in KNOBS}, {"fusion": {"rrf_k": None}, "top_k": None}):
        r = _post(server, "/chat/completions", {"model": "oprag", "messages": [{**msgs[0], "name": None}], **top,
                                                "oprag": oprag})
        assert r.status_code == 200, (oprag, r.text[:300])
        assert _ids(r.json()["oprag"]) == _ids(plain.json()["oprag"]), oprag
        assert r.json()["oprag"]["finish_reason"] == "no_generator"


def test_embeddings_null_options_are_the_defaults(server):
    model = requests.get(server.url + "/models", timeout=30).json()["data"][-1]["id"]
    plain = _post(server, "/embeddings", {"model": model, "input": "bees"})
    r = _post(server, "/embeddings", {"model": model, "input": "bees", "encoding_format": None, "dimensions": None,
                                      "user": None})
    assert r.status_code == plain.status_code == 200, r.text[:300]
    assert r.json()["data"] == plain.json()["data"]


@pytest.mark.parametrize("path, body, param, message", [
    ("/retrieve", {"query": "bees", "top_k": "x"}, "top_k", 'top_k must be an integer, got "x"'),
    ("/retrieve", {"query": None}, "query", "query must be a string, got null"),
    ("/retrieve", {"query": "bees", "topk": None}, "topk", "unknown field 'topk': did you mean 'top_k'?"),
    ("/retrieve", {"query": "bees", "filters": {"k": None}}, "filters.k",
     "filters.k must be a list, a string, a boolean or a number, got null"),
    ("/chat/completions", {"model": "oprag", "messages": None}, "messages", "messages must be a list, got null"),
    ("/chat/completions", {"model": "oprag", "messages": [{"role": "user", "content": "x"}], "oprag": {"mode": 3}},
     "oprag.mode", "oprag.mode must be one of 'hybrid', 'dense', 'lexical' or 'full_hybrid', got 3"),
])
def test_required_nulls_and_real_type_errors_stay_400s(server, path, body, param, message):
    err = _error(_post(server, path, body))
    assert err["param"] == param and err["message"].startswith(message), err


# --------------------------------------------------------------------------- GET /v1/models
def test_the_per_model_endpoint_knows_exactly_the_listed_models(server):
    listed = [m["id"] for m in requests.get(server.url + "/models", timeout=30).json()["data"]]
    assert len(listed) == 1 and listed[0] != "oprag"  # --generator none: the embedder only
    for m in listed:
        assert requests.get(f"{server.url}/models/{m}", timeout=30).json()["id"] == m
    err = _error(requests.get(server.url + "/models/oprag", timeout=30), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found"), err
    assert err["message"] == "the model 'oprag' does not exist: GET /v1/models lists them"


# -------------------------------------------------------------------------- oprag eval beir
def _oprag(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*oprag_cli(), *args, "--server", server.target], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("top_k", [10, 50])
def test_eval_beir_top_k_below_100_reports_recall_at_that_depth(server, tmp_path, top_k):
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"harbour {i} tide tables"}) + "\n"
                                              for i in range(3)))
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\ttide{i}\t1\n" for i in range(3)))
    out = _oprag(server, "eval", "beir", "--queries", str(tmp_path / "q.jsonl"), "--qrels", str(tmp_path / "qrels.tsv"),
                 "--top-k", str(top_k))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert set(res) >= {"ndcg@10", f"recall@{top_k}", "mrr@10"} and "recall@100" not in res, res
    assert res[f"recall@{top_k}"] == 1.0 and res["judged_docs_retrieved"] == 3, res


# ------------------------------------------------------------- clearing a pre-rule session
def test_a_session_stored_under_an_id_the_rule_now_refuses_can_be_cleared(tmp_path):
    """Turns recorded under "legacy-a" and "legacy-b", then renamed in the stored snapshot (as a
    server before the session-id rule wrote them) to ids the rule refuses: ClearSession removes
    them; Retrieve, which would record a turn under them, still refuses them."""
    old = {"legacy-a": " alice", "legacy-b": "bob\x01"}  # (one shard: no routing to redo)
    srv = ServerProcess(tmp_path / "data", free_port(), free_port(), "--generator", "none", "--shards", "1",
                        "--snapshot-interval-s", "3600").start()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest(DOCS)
            for sid, n in (("legacy-a", 2), ("legacy-b", 1)):
                for i in range(n):
                    c.retrieve(f"honey bee dancing {i}", session_id=sid)
            assert c.stats().memory_records == 3
        assert srv.stop() == 0  # a snapshot holds the turns
        shard = Path(srv.data_dir) / "shard-0"
        mem = shard / (shard / "CURRENT").read_text().strip() / "memory.json"
        items = json.loads(mem.read_text())
        assert sorted(m["session_id"] for m in items) == ["legacy-a", "legacy-a", "legacy-b"]
        mem.write_text(json.dumps([{**m, "session_id": old[m["session_id"]]} for m in items]))
        meta_file = mem.with_name("meta.json")  # (such a server wrote no memory CRCs either)
        meta = json.loads(meta_file.read_text())
        del meta["memory_crc"]
        meta_file.write_text(json.dumps({**meta, "crc32": meta_crc(meta)}))
        srv.start()
        with OpRAGClient(srv.target, timeout=60) as c:
            assert c.stats().memory_records == 3
            with pytest.raises(grpc.RpcError) as ei:  # (creating / writing a session keeps the rule)
                c.retrieve("bees", session_id=" alice")
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert c.clear_session(" alice").records_removed == 2
            assert c.clear_session("bob\x01").records_removed == 1
            assert c.stats().memory_records == 0
            assert c.clear_session("bob\x01").records_removed == 0
    finally:
        srv.stop()
