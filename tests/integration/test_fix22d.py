"""New-user trial 22 (branch fix22d), over a real server (test_fix21b's: 2 shard processes, HTTP
port, no generator): HTTP bodies in UTF-16/UTF-32 were accepted (``json.loads`` of bytes detects
them) though the README says a body that is not UTF-8 is a 400; a JSON syntax error's message gave no
byte offset; JSON nested 1,000 levels deep got FastAPI's "There was an error parsing the body" with
``code`` null."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_fix21b import _error, _post, server  # noqa: E402,F401 - the same real server (2 shards, HTTP, no generator)

pytestmark = pytest.mark.integration
ENDPOINTS = {"/retrieve": {"query": "bees", "top_k": 1},
             "/chat/completions": {"model": "oprag", "messages": [{"role": "user", "content": "bees"}]},
             "/embeddings": {"model": "x", "input": "bees"}}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_in_utf16_or_utf32_is_refused_as_not_utf8(server, encoding):
    body = json.dumps({"query": "bees", "top_k": 1}).encode(encoding)
    err = _error(_post(server, "/retrieve", body))
    assert err["code"] == "invalid_json" and err["message"].startswith("the body is not "), err
    assert "UTF-8" in err["message"] and "byte offset" in err["message"], err


def test_a_utf8_body_with_a_byte_order_mark_is_still_accepted(server):
    r = _post(server, "/retrieve", b"\xef\xbb\xbf" + json.dumps({"query": "bees", "top_k": 1}).encode())
    assert r.status_code == 200 and r.json()["hits"], r.text[:300]


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_malformed_json_gives_the_byte_offset(server, path):
    body = '{"query": "Zürich", "x": lobster}'.encode()  # ü is 2 bytes: the offset counts bytes, not characters
    err = _error(_post(server, path, body))
    assert err["code"] == "invalid_json", err
    assert f"byte offset {body.index(b'lobster')}: Expecting value" in err["message"], err


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@pytest.mark.parametrize("depth", [1000, 5000])
def test_json_nested_too_deeply_says_so(server, path, depth):
    body = json.dumps(ENDPOINTS[path])[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    err = _error(_post(server, path, body.encode()))
    assert err["code"] == "invalid_json" and "nested too deeply" in err["message"], err
