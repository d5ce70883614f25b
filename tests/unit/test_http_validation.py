"""HTTP validation messages name the field (a path: ``messages[0].content``, ``oprag.top_k``),
what it must be and what was sent (service/openai_api.validation_message); pydantic's own
wording (union tags such as ``list[union[function-after[_utf8(), str],bool,int,float]]``, "Input
should be a valid integer") never reaches the client. No server: the app over a stand-in runtime."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_http_content_type import _post  # noqa: E402

MSG = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/retrieve", {"query": "q", "topk": 5}, "topk",
     "unknown field 'topk': did you mean 'top_k'? the fields here are mode, top_k, candidates, filters, fusion, "
     "session_id, disable_memory, include_trace, ef_search, nprobe, query"),
    ("/v1/retrieve", {"qury": "q"}, "qury", "unknown field 'qury': did you mean 'query'?"),
    ("/v1/retrieve", {"query": "q", "top_k": 1.5}, "top_k", "top_k must be an integer, got 1.5"),
    ("/v1/retrieve", {"query": "q", "top_k": -1}, "top_k", "top_k must be at least 0, got -1"),
    ("/v1/retrieve", {"query": "q", "filters": {"k": None}}, "filters.k",
     "filters.k must be a list, a string, a boolean or a number, got null"),
    ("/v1/retrieve", {"query": "q", "fusion": {"dense_weight": "x"}}, "fusion.dense_weight",
     'fusion.dense_weight must be a number, got "x"'),
    ("/v1/retrieve", {"query": "q", "disable_memory": "yes"}, "disable_memory", 'disable_memory must be a boolean, got "yes"'),
    ("/v1/retrieve", [1, 2], None, "the body must be an object, got [1, 2]"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text must be a string, got 5"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "messages[0].content must be a string or a list, got 5"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "oprag": {"fusion": {"methd": "rrf"}}}, "oprag.fusion.methd",
     "unknown field 'oprag.fusion.methd': did you mean 'method'?"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages", "messages needs at least 1 item(s), got []"),
    ("/v1/embeddings", {"model": "enc", "input": ["a", None]}, "input[1]", "input[1] must be a string, got null"),
])
def test_validation_messages_name_the_field_and_what_to_send(path, body, param, message):
    status, out = _post(path, json.dumps(body).encode(), b"application/json")
    assert status == 400 and out["error"]["param"] == param and out["error"]["code"] == "invalid_value", out
    assert out["error"]["message"].startswith(message), out
    assert "Input should" not in out["error"]["message"] and "function-after" not in out["error"]["message"]


def test_unknown_openai_fields_are_still_accepted():
    body = {"model": "m", "messages": MSG, "top_p": 0.5, "tools": [], "seed": 3}
    status, out = _post("/v1/chat/completions", json.dumps(body).encode(), b"application/json")
    assert status == 404 and out["error"]["code"] == "model_not_found"  # past validation: the model is unknown


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"model": {"\ud800": None}, "input": "x"}),
                                        ("/v1/retrieve", {"query": "q", "\ud800": 1}),
                                        ("/v1/retrieve", {"query": "q", "filters": {"\ud800": [None]}})])
def test_a_lone_surrogate_shown_in_a_message_is_escaped(path, body):
    # (found by test_http_fuzz: the message quoted the value, and the error body could not be encoded: a 500)
    status, out = _post(path, json.dumps(body).encode(), b"application/json")
    assert status == 400 and "\\ud800" in out["error"]["message"], out


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/retrieve", {"query": "q", "fusion": {"dense_weight": -1}}, "fusion.dense_weight", "fusion.dense_weight must be"),
    ("/v1/retrieve", {"query": "q", "top_k": 1000}, "top_k", "top_k must be in [1, 100] (0 = the default), got 1000"),
    ("/v1/retrieve", {"query": "q", "candidates": 100000}, "candidates", "candidates must be in"),
    ("/v1/retrieve", {"query": " \u200b"}, "query", "question is empty"),
    ("/v1/retrieve", {"query": "q" * 5000}, "query", "question has 5000 characters"),
    ("/v1/retrieve", {"query": "q", "session_id": "s" * 300}, "session_id", "session_id is longer than 256 bytes"),
    ("/v1/retrieve", {"query": "q", "filters": {"lang": []}}, "filters.lang", "metadata filter 'lang' needs"),
    ("/v1/retrieve", {"query": "q", "filters": {"": "x"}}, "filters", "a metadata filter has an empty key"),
    ("/v1/chat/completions", {"model": "oprag", "messages": MSG, "oprag": {"top_k": 1000}}, "oprag.top_k", "top_k must be"),
    ("/v1/chat/completions", {"model": "oprag", "messages": MSG, "oprag": {"fusion": {"lexical_weight": 1e7}}},
     "oprag.fusion.lexical_weight", "fusion.lexical_weight must be"),
    ("/v1/chat/completions", {"model": "oprag", "messages": [{"role": "user", "content": ""}]}, "messages", "question is empty"),
    ("/v1/chat/completions", {"model": "oprag", "messages": [{"role": "assistant", "content": "a"}]}, "messages[-1]",
     "messages[-1] has role 'assistant'"),
    ("/v1/embeddings", {"model": "enc", "input": []}, "input", "input has 0 items"),
    ("/v1/embeddings", {"model": "enc", "input": ["a", " "]}, "input[1]", "input[1] must have visible text"),
    ("/v1/embeddings", {"model": "enc", "input": "a", "dimensions": 3}, "dimensions", "dimensions must be 4"),
])
def test_a_value_the_shared_validation_refuses_names_its_param(path, body, param, message):
    """trial14: errors raised past the request's shape (by the validation gRPC shares) had
    ``param: null``: the message named the field, OpenAI's ``param`` did not."""
    status, out = _post(path, json.dumps(body).encode(), b"application/json")
    assert status == 400 and out["error"]["code"] == "invalid_argument", out
    assert out["error"]["param"] == param and out["error"]["message"].startswith(message), out


@pytest.mark.parametrize("method, path, status, code", [("POST", "/v1/nope", 404, "not_found"),
                                                         ("POST", "/v1/models", 405, "method_not_allowed"),
                                                         ("GET", "/v1/retrieve", 405, "method_not_allowed")])
def test_an_unknown_path_or_method_names_it_and_the_endpoints(method, path, status, code):
    """trial14: these said only "Not Found" / "Method Not Allowed" (code null for 405)."""
    import asyncio
    from types import SimpleNamespace

    from oprag_server.config import ServerConfig
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.service.http import Guard, build_app
    from oprag_server.service.metrics import Metrics

    rt = SimpleNamespace(cfg=ServerConfig(), encoder=SimpleNamespace(name="enc", dim=4), generator=None,
                         corpus_stats=CorpusStats())
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"2")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    out = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        out.append(msg)

    asyncio.run(Guard(build_app(rt), tokens=set(), max_body=1 << 20, metrics=Metrics())(scope, receive, send))
    body = json.loads(b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"))["error"]
    assert out[0]["status"] == status and body["code"] == code, body
    assert f"{method} {path}; the endpoints are POST /v1/chat/completions" in body["message"], body
