"""POST bodies are JSON whatever their Content-Type (curl -d sends form-urlencoded)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from oprag_server.index.bm25 import CorpusStats
from oprag_server.config import ServerConfig
from oprag_server.service.http import Guard, build_app
from oprag_server.service.metrics import Metrics


def _post(path: str, body: bytes, content_type: bytes | None) -> tuple[int, dict]:
    # query.submit is never called: the requests here fail validation, which runs first
    rt = SimpleNamespace(cfg=ServerConfig(), encoder=SimpleNamespace(name="enc", dim=4), generator=None,
                         corpus_stats=CorpusStats(),
                         query=SimpleNamespace(submit=None))
    guard = Guard(build_app(rt), tokens=set(), max_body=1 << 20, metrics=Metrics())
    headers = [(b"host", b"x"), (b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent, out = [False], []

    async def receive():
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg):
        out.append(msg)

    asyncio.run(guard(scope, receive, send))
    status = next(m["status"] for m in out if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"))


@pytest.mark.parametrize("ctype", [b"application/x-www-form-urlencoded", b"text/plain", None, b"application/json"])
def test_a_json_body_is_read_whatever_the_content_type(ctype):
    # the wrong model is refused after the body was parsed: 404 naming it, not a pydantic "valid dictionary"
    status, body = _post("/v1/embeddings", json.dumps({"model": "nope", "input": "x"}).encode(), ctype)
    assert status == 404, body
    assert "'nope'" in body["error"]["message"]


def test_a_body_that_is_not_json_says_to_send_json():
    status, body = _post("/v1/embeddings", b"model=nope&input=x", b"application/x-www-form-urlencoded")
    assert status == 400 and "Content-Type: application/json" in body["error"]["message"]
