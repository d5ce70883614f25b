"""fix22c over one real server (``--tokens-file``, ``--http-port``, no generator): trial22's
findings 2, 3 and 4.

* 2: HTTP ``/v1/retrieve`` and the chat extension set ``memory_context`` whenever the session or
  conversation had an earlier turn; gRPC only when memory changed the retrieval. Both now use
  :func:`oprag_server.service.convert.memory_fields`, and HTTP replies carry ``memory_used`` and
  ``resolved_query`` too.
* 3: a stream whose deadline passed after its final message arrived, while its documents were
  still embedded (before the two-phase commit), was not counted in
  ``oprag_writes_after_caller_left_total{kind=upsert,outcome=aborted}``.
* 4: a bearer token with a trailing newline (a file, a Kubernetes secret) failed as gRPC's
  ``INTERNAL: Invalid metadata`` with C-core log lines; clients now strip it, and refuse a token
  with a control character inside with a message naming ``--token``/``OPRAG_TOKEN``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import urllib.request

import grpc
import pytest

from oprag_client.client import AsyncOpRAGClient, Doc, OpRAGClient
from oprag_client.testing import oprag_cli, wait_until
from server_fixtures import http_server
from test_http import DOCS  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = pytest.mark.integration
TOKEN = "fix22c-token"
FIRST = "Tell me about honey bee dances."
UNRELATED = "How often do bakers feed a sourdough starter with flour and water?"  # the session adds nothing
FOLLOW_UP = "Why do they do it?"  # only the earlier turn says who "they" are


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("fix22c-tokens") / "tokens"
    tokens.write_text(TOKEN + "\n")
    yield from http_server(tmp_path_factory, "fix22c", "--shards", "1", "--generator", "none", "--tokens-file",
                           str(tokens), docs=DOCS, timeout=120, token=TOKEN)


@pytest.fixture(scope="module")
def client(server):
    return server.grpc


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{server.url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


MEMORY = ("memory_context", "memory_used", "resolved_query")


# ------------------------------------------------------------------------------ finding 2
@pytest.mark.parametrize("second, changed", [(UNRELATED, False), (FOLLOW_UP, True)])
def test_http_retrieve_memory_fields_are_grpcs(server, client, second, changed):
    tag = f"{random.random()}"
    client.retrieve(FIRST, session_id=f"g-{tag}", top_k=2)
    _post(server, "/retrieve", {"query": FIRST, "session_id": f"h-{tag}", "top_k": 2})
    g = client.retrieve(second, session_id=f"g-{tag}", top_k=2)
    h = _post(server, "/retrieve", {"query": second, "session_id": f"h-{tag}", "top_k": 2})
    assert g.memory_used is changed, (g.memory_used, g.memory_context)  # (the case this test means)
    assert {k: h.get(k) for k in MEMORY} == {k: getattr(g, k) for k in MEMORY}  # (before: no memory_used)
    assert [x["chunk_id"] for x in h["hits"]] == [x.chunk_id for x in g.hits]
    if not changed:  # before: "Previous question: Tell me about honey bee dances. (sources: ...)"
        assert h["memory_context"] == "" and h["resolved_query"] == ""
    else:
        assert "honey bee dances" in h["memory_context"] and h["resolved_query"]


def test_chat_conversation_memory_shown_only_when_it_changed_the_retrieval(server):
    def chat(*questions: str) -> dict:
        msgs = []
        for q in questions[:-1]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]
        body = {"model": "oprag", "messages": [*msgs, {"role": "user", "content": questions[-1]}],
                "oprag": {"top_k": 2}}
        return _post(server, "/chat/completions", body)["oprag"]

    alone, after = chat(UNRELATED), chat(FIRST, UNRELATED)
    assert [x["chunk_id"] for x in after["hits"]] == [x["chunk_id"] for x in alone["hits"]]
    # before: memory_context "Previous question: Tell me about honey bee dances." and no memory_used
    assert {k: after[k] for k in MEMORY} == {"memory_context": "", "memory_used": False, "resolved_query": ""}
    follow = chat(FIRST, FOLLOW_UP)
    assert follow["memory_used"] and follow["memory_context"] == f"Previous question: {FIRST}"
    assert FIRST in follow["resolved_query"] and follow["hits"][0]["doc_id"] == "bees"


# ------------------------------------------------------------------------------ finding 4
def test_token_with_trailing_newline_is_stripped(server):
    with OpRAGClient(server.target, timeout=60, token=TOKEN + "\n") as c:  # before: INTERNAL: Invalid metadata
        assert c.stats().documents >= len(DOCS)

    async def run() -> int:
        async with AsyncOpRAGClient(server.target, timeout=60, token=f"  {TOKEN}\r\n") as c:
            return (await c.stats()).documents

    assert asyncio.run(run()) >= len(DOCS)
    env = {**os.environ, "OPRAG_TOKEN": TOKEN + "\n"}
    p = subprocess.run([*oprag_cli(), "stats", "--server", server.target, "--json"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["documents"] >= len(DOCS), p.stderr
    assert p.stderr == ""


def test_token_with_a_control_character_inside_is_refused_clearly(server):
    with pytest.raises(ValueError, match=r"control character, '\\n', at position 5"):
        OpRAGClient(server.target, token="fix22\nc-token")
    for how in (["--token", "fix22\tc-token"], []):
        env = {**os.environ, "OPRAG_TOKEN": "fix22\nc-token"}
        p = subprocess.run([*oprag_cli(), "stats", "--server", server.target, *how], env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert p.stderr.startswith("oprag: the bearer token (--token or OPRAG_TOKEN) holds a control character")
        assert "Invalid metadata" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr  # no C-core lines


# ------------------------------------------------------------------------------ finding 3
def _left_counters(server) -> tuple[float, float]:
    """``oprag_writes_after_caller_left_total{kind="upsert",outcome="aborted"}`` and
    ``oprag_ingest_streams_aborted_total`` (0 when the series does not exist yet)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
    left = re.search(r'^oprag_writes_after_caller_left_total\{kind="upsert",outcome="aborted"\} (\S+)$', text, re.M)
    aborted = re.search(r"^oprag_ingest_streams_aborted_total (\S+)$", text, re.M)
    return float(left.group(1)) if left else 0.0, float(aborted.group(1)) if aborted else 0.0


def _long_docs(n: int, words: int, seed: int) -> list[Doc]:
    """``n`` documents of ``words`` made-up words each: many chunks to embed, few bytes to send."""
    rnd = random.Random(seed)
    syll = ["ka", "lo", "mir", "tes", "vun", "dra", "pel", "os", "qui", "zen", "bar", "fo"]
    vocab = ["".join(rnd.choice(syll) for _ in range(rnd.randint(2, 4))) for _ in range(2000)]
    return [Doc(f"long-{seed}-{i}", " ".join(rnd.choice(vocab) for _ in range(words)) + ".") for i in range(n)]


def test_deadline_while_the_final_stream_is_embedded_counts_as_caller_left(server, client):
    """30 documents in one message (the final one): the server reads it at once (its load queue
    holds 32 documents), then spends seconds chunking and embedding them before the commit; the
    1.5 s deadline passes in between. The stream stores nothing and is counted both as aborted and
    as a write whose caller left (before: aborted only)."""
    for words in (3000, 12000, 48000):  # until the embedding outlasts the deadline (a fast machine)
        docs_before, (left0, aborted0) = client.stats().documents, _left_counters(server)
        try:
            client.ingest(_long_docs(30, words, words), timeout=1.5)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
            break
    else:
        pytest.skip("every stream was embedded and committed within 1.5 s")
    assert wait_until(lambda: _left_counters(server)[1] == aborted0 + 1, timeout=60)
    assert _left_counters(server) == (left0 + 1, aborted0 + 1)
    assert client.stats().documents == docs_before
