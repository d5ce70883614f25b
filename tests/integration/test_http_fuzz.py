"""Hostile HTTP input, fuzzed like the gRPC RPCs (``test_fuzz.py``): hypothesis sends random
bodies to a running server's OpenAI-compatible endpoints (``--http-port``) through ``requests``
(raw bytes on the wire, so malformed JSON and invalid UTF-8 get through): random JSON shapes,
known fields with wrong types, huge and non-finite numbers, unicode and lone surrogates, invalid
UTF-8, random headers and content types, good, wrong and missing bearer tokens, wrong methods.

Every answer is a status the client caused or a success, never a 5xx; every 4xx carries
OpenAI's error object; 200s have the endpoint's shape; the server stays up and the stored data is
unchanged. The tiny default generator answers with at most 2 new tokens (``--max-new-tokens 2``;
fuzzed ``max_tokens`` are small or out of range, never a long valid generation). Oversized bodies
(413) are tested in ``test_http.py``."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration
TOKEN = "fuzz-token"
EMBED = "$EMBED"  # replaced by the server's embedder name
ERROR_CODES = {400, 401, 404, 405, 413, 415, 422}

# ------------------------------------------------------------------------------- strategies
odd_text = st.sampled_from(["", " ", "\x00", "🦀" * 40, "中文检索", "\ud800", "a\udfffb"]) | st.just(5000).map("a".__mul__)
any_text = st.text(max_size=80) | odd_text
words = st.text(st.sampled_from("orchard pears baseline document 12 é中🦀"), min_size=1, max_size=40)
text = words | words | any_text  # the fields' strings: mostly words, so that requests get past validation
number = (st.integers(-(2**70), 2**70) | st.floats() | st.sampled_from([0, 1, 2, -1, 2**31, 2**32, 2**63, 2**64])
          | st.decimals(allow_nan=False, allow_infinity=False, places=3).map(float))
scalar = st.none() | st.booleans() | number | any_text
jsonish = st.recursive(scalar, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(any_text, ch, max_size=4), max_leaves=12)
small_tokens = st.sampled_from([0, 1, 2, 513, 2**32, -1, 2**64, 1.5, "2", True, None])


@st.composite
def mutated(draw, valid: st.SearchStrategy, keys: list[str]):
    """A mostly valid object: ``valid``, then 0-2 of its fields (or unknown ones) set to any JSON
    value or removed."""
    obj = dict(draw(valid))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(keys) | any_text)
        if draw(st.booleans()) and key in obj:
            del obj[key]
        else:
            obj[key] = draw(jsonish)
    return obj


fusion = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["minmax", "rrf", "RRF", ""]), "dense_weight": number, "lexical_weight": number,
    "rrf_k": st.integers(0, 2**32 + 1)})
OPTS = {"mode": st.sampled_from(["hybrid", "dense", "lexical", "full_hybrid", "exact"]),
        "top_k": st.integers(0, 20) | st.integers(0, 2**32 + 1), "candidates": st.integers(0, 2**32 + 1),
        "filters": st.dictionaries(text, st.lists(scalar, max_size=3), max_size=2), "fusion": fusion,
        "session_id": text, "disable_memory": st.booleans(), "include_trace": st.booleans()}
opts = mutated(st.fixed_dictionaries({}, optional=OPTS), list(OPTS))
content = text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
earlier = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "bot"]),
                                 "content": content | st.none()})
messages = st.tuples(st.lists(earlier, max_size=2), st.fixed_dictionaries({"role": st.just("user"), "content": content}))
CHAT = {"stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "max_tokens": small_tokens, "max_completion_tokens": small_tokens, "temperature": number | st.just(0),
        "n": st.sampled_from([1, 2, 0]), "user": text, "oprag": opts, "tools": jsonish}
chat = mutated(st.fixed_dictionaries(
    {"model": st.sampled_from(["oprag", "oprag", EMBED, "gpt-4o", ""]), "messages": messages.map(lambda t: [*t[0], t[1]])},
    optional=CHAT), ["model", "messages", *CHAT])
EMB = {"encoding_format": st.sampled_from(["float", "base64", "binary"]),
       "dimensions": st.sampled_from([None, 384, 0, -1, 2**40]), "user": text}
embeddings = mutated(st.fixed_dictionaries(
    {"model": st.sampled_from([EMBED, EMBED, "oprag", "text-embedding-3-small"]),
     "input": text | st.lists(text, max_size=4) | st.lists(st.integers(), max_size=4)},
    optional=EMB), ["model", "input", *EMB])
GROUP = {"group_by_document": st.booleans(), "chunks_per_document": st.integers(0, 50) | st.integers(-1, 2**32 + 1),
         # (seq 1: the baseline ingest; larger ones were never issued)
         "min_seq": st.integers(0, 3) | st.integers(-1, 2**64 + 1),
         "query_vector": st.lists(number, max_size=4) | st.lists(st.floats(-1, 1) | number, min_size=384, max_size=384)
         | st.sampled_from([[10**400] * 384, [0] * 384, [-1e39] + [0.5] * 383])}
retrieve = mutated(st.fixed_dictionaries({"query": text}, optional={**OPTS, **GROUP}), ["query", *OPTS, *GROUP])
SHAPES = {"/v1/chat/completions": chat, "/v1/embeddings": embeddings, "/v1/retrieve": retrieve}


@st.composite
def body_bytes(draw, shape):
    """A JSON body of ``shape`` (or any JSON), or bytes that are not JSON or not UTF-8."""
    kind = draw(st.sampled_from(["shape"] * 5 + ["any", "raw", "bad_utf8", "truncated"]))
    obj = draw(shape if kind in ("shape", "bad_utf8", "truncated") else jsonish)
    data = json.dumps(obj, allow_nan=True).encode()
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "bad_utf8":  # invalid UTF-8 spliced into the body (inside a string when there is one)
        at = data.find(b'"') + 1 or draw(st.integers(0, len(data)))
        return data[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + data[at:]
    if kind == "truncated":
        return data[:draw(st.integers(0, max(0, len(data) - 1)))]
    return data


header_name = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True).filter(
    lambda h: h.lower() not in {"content-length", "transfer-encoding", "host", "authorization", "connection", "expect"})
header_value = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
headers = st.dictionaries(header_name, header_value, max_size=4)
content_type = st.sampled_from([None] * 4 + ["application/json"] * 6 + ["application/json; charset=latin-1", "text/plain",
                                "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "*/*"])
auth = st.sampled_from(["good", "none", "wrong", "Bearer", "basic"])


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("http-fuzz")
    (d / "tokens").write_text(TOKEN + "\n")
    http_port = free_port()
    srv = ServerProcess(d / "data", free_port(), free_port(), "--max-new-tokens", "2", "--tokens-file",
                        str(d / "tokens"), "--http-port", str(http_port)).start()
    srv.url = f"http://127.0.0.1:{http_port}"
    with OpRAGClient(srv.target, timeout=60, token=TOKEN) as c:
        c.ingest([Doc(f"base{i}", f"Baseline document {i} about orchards and pears.") for i in range(5)])
        srv.client = c
        before = c.stats()
        srv.embedder = requests.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"},
                                    timeout=30).json()["data"][-1]["id"]
        yield srv
        after = c.stats()
        assert (after.documents, after.chunks, after.seq) == (before.documents, before.chunks, before.seq)
    srv.stop()


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def _auth(kind: str) -> dict[str, str]:
    return {"good": {"Authorization": f"Bearer {TOKEN}"}, "none": {}, "wrong": {"Authorization": "Bearer nope"},
            "Bearer": {"Authorization": "Bearer"}, "basic": {"Authorization": "Basic Zm9vOmJhcg=="}}[kind]


def _check(r: requests.Response, path: str, auth_kind: str) -> None:
    assert r.status_code < 500, f"{r.status_code} on {path}: {r.text[:500]}"
    if auth_kind != "good":
        assert r.status_code == 401, r.text[:300]
    if r.status_code >= 400:
        assert r.status_code in ERROR_CODES, r.status_code
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert set(err) == {"message", "type", "param", "code"}
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", r.text[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e[6:]), e
        return
    body = r.json()
    want = {"/v1/chat/completions": "chat.completion", "/v1/embeddings": "list", "/v1/retrieve": "retrieval",
            "/v1/models": "list"}.get(path, "model")
    assert body["object"] == want, body


def _send(session, server, method, path, data, hdrs, auth_kind, ctype) -> None:
    h = {**hdrs, **_auth(auth_kind)}
    if ctype is not None:
        h["Content-Type"] = ctype
    r = session.request(method, server.url + path, data=data, headers=h, timeout=120)
    event(f"{path} {r.status_code}")  # pytest --hypothesis-show-statistics: what the examples reached
    _check(r, path, auth_kind)
    assert server.alive()


# ------------------------------------------------------------------------------------ tests
SETTINGS = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


@settings(SETTINGS, max_examples=30)
@given(data=st.data(), path=st.sampled_from(sorted(SHAPES)), hdrs=headers)
def test_mostly_valid_bodies_never_get_a_server_error(session, server, data, path, hdrs):
    """The endpoints' own shapes, a field or two changed at random: these reach the handlers."""
    raw = json.dumps(data.draw(SHAPES[path]), allow_nan=True).replace(EMBED, server.embedder).encode()
    _send(session, server, "POST", path, raw, hdrs, "good", "application/json")


@SETTINGS
@given(data=st.data(), path=st.sampled_from(sorted(SHAPES)), hdrs=headers, auth_kind=auth, ctype=content_type)
def test_hostile_post_bodies_never_get_a_server_error(session, server, data, path, hdrs, auth_kind, ctype):
    """Any JSON, bytes, invalid UTF-8, truncated bodies, odd content types and tokens."""
    raw = data.draw(body_bytes(SHAPES[path]))
    raw = raw.replace(EMBED.encode(), server.embedder.encode())
    _send(session, server, "POST", path, raw, hdrs, auth_kind, ctype)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/models", "/v1/chat/completions", "/v1/embeddings", "/v1/retrieve", "/v1/nope", "/"])
       | st.from_regex(r"/v1/models/[A-Za-z0-9._%~-]{0,30}", fullmatch=True),
       raw=st.binary(max_size=50), hdrs=headers, auth_kind=auth)
def test_random_methods_and_paths_never_get_a_server_error(session, server, method, path, raw, hdrs, auth_kind):
    h = {**hdrs, **_auth(auth_kind)}
    r = session.request(method, server.url + path, data=raw or None, headers=h, timeout=60)
    assert r.status_code < 500, f"{r.status_code} on {method} {path}: {r.text[:500]}"
    if auth_kind != "good":
        assert r.status_code == 401
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert server.alive()
