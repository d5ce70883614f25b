"""No answer without sources, at a real server's doors (trial16 follow-up).

trial16 asked a server with the default generator about a document it had deleted and got
"The Varnholm Lighthouse was completed in 1999." with zero sources (the document said 1887): on
an empty store, after every document was deleted, or with a filter matching nothing, Query,
QueryStream and the HTTP chat endpoint generated anyway. Now such a request is not generated
(``finish_reason`` ``no_sources``); ``--answer-without-sources generate`` keeps the former
behaviour (checked here on an OpenAI-compatible engine backend, the stand-in engine)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import requests

from oprag_client.client import AsyncOpRAGClient, Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port
from standin_process import standin_engine

pytestmark = pytest.mark.integration

QUESTION = "In what year was the Varnholm Lighthouse completed?"
LIGHTHOUSE = Doc("lighthouse", title="Varnholm Lighthouse", metadata={"topic": "history"}, text=(
    "The Varnholm Lighthouse stands on a granite skerry at the mouth of the fjord. It was completed in 1887 "
    "after four summers of work, and its lens was made in Paris."))
NOTHING = {"topic": ["no-such-topic"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default (built-in) generator, the default policy (refuse)."""
    http = free_port()
    srv = ServerProcess(tmp_path_factory.mktemp("nosrc"), free_port(), free_port(), "--shards", "1",
                        "--max-new-tokens", "8", "--monitor-fraction", "0", "--http-port", str(http))
    srv.http_port = http
    srv.start()
    yield srv
    srv.stop()


def _metric(srv, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want + " "))


def _refused(r) -> bool:
    """A QueryResponse or DoneEvent (which has no sources) of a request that was not generated."""
    return (r.answer, len(getattr(r, "sources", ())), r.prompt_tokens, r.completion_tokens, r.finish_reason) == \
        ("", 0, 0, 0, "no_sources")


def _chat(srv, stream=False, **oprag):
    return requests.post(f"http://127.0.0.1:{srv.http_port}/v1/chat/completions", timeout=120, stream=stream,
                         json={"model": "oprag", "messages": [{"role": "user", "content": QUESTION}],
                               "max_tokens": 8, "stream": stream, "oprag": oprag})


def _sse(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True)
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_nothing_stored_nothing_generated(server, client):
    generate_before = _metric(server, "oprag_stage_seconds_count", stage="generate")
    r = client.query(QUESTION)  # the store is empty
    assert _refused(r) and not r.hits, r
    events = list(client.query_stream(QUESTION))
    assert [e.WhichOneof("event") for e in events] == ["sources", "done"]  # no text events
    assert _refused(events[-1].done)

    got = _chat(server)
    assert got.status_code == 200, got.text
    body = got.json()
    choice, ext = body["choices"][0], body["oprag"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("", "stop")
    assert (ext["finish_reason"], ext["sources"], body["usage"]["completion_tokens"]) == ("no_sources", [], 0)
    chunks = _sse(_chat(server, stream=True))
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["oprag"]["finish_reason"] == "no_sources"

    assert _metric(server, "oprag_stage_seconds_count", stage="generate") == generate_before  # never generated
    assert _metric(server, "oprag_answers_without_sources_total", action="refused") == 4


def test_sources_generate_a_filter_matching_nothing_does_not(server, client):
    client.ingest([LIGHTHOUSE])
    r = client.query(QUESTION, top_k=1)
    assert r.answer and r.finish_reason in ("stop", "length") and r.completion_tokens > 0, r
    assert [s.doc_id for s in r.sources] == ["lighthouse"]
    assert _refused(client.query(QUESTION, top_k=1, filters=NOTHING))
    body = _chat(server, top_k=1, filters=NOTHING).json()
    assert (body["choices"][0]["message"]["content"], body["oprag"]["finish_reason"]) == ("", "no_sources")


def test_a_mixed_batch_generates_only_the_requests_with_sources(server):
    async def go():
        async with AsyncOpRAGClient(server.target, timeout=120) as c:
            kws = [{}, {"filters": NOTHING}] * 3  # (concurrent: batched by --max-batch 8, --max-wait-ms 4)
            return await asyncio.gather(*[c.query(QUESTION, top_k=1, **kw) for kw in kws])

    before = _metric(server, "oprag_stage_seconds_count", stage="generate")
    got = asyncio.run(go())
    for i, r in enumerate(got):
        if i % 2:
            assert _refused(r), r
        else:
            assert r.answer and r.finish_reason in ("stop", "length") and r.sources[0].doc_id == "lighthouse", r
    assert len({r.answer for r in got[::2]}) == 1  # greedy: the same answer, batched with refusals or not
    assert _metric(server, "oprag_stage_seconds_count", stage="generate") == before + 3


def test_every_document_deleted_nothing_generated(server, client, capsys):
    seq = client.delete(["lighthouse"]).seq
    assert _refused(client.query(QUESTION, top_k=1, min_seq=seq))
    assert _refused(list(client.query_stream(QUESTION))[-1].done)
    from oprag_client import cli

    assert cli.main(["query", "--server", server.target, QUESTION]) == 0
    out = capsys.readouterr().out
    assert "(no answer: nothing retrieved to answer from" in out and "Sources:" not in out, out


@pytest.fixture(scope="module")
def standin():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with standin_engine() as root:
        yield root


def test_answer_without_sources_generate_keeps_the_former_behaviour(tmp_path, standin):
    with ServerProcess.on_free_ports(tmp_path / "d", "--shards", "1", "--generator", "openai", "--generator-url",
                                     standin + "/v1", "--generator-model", "standin", "--max-new-tokens", "4",
                                     "--monitor-fraction", "0", "--answer-without-sources", "generate") as srv:
        with OpRAGClient(srv.target, timeout=120) as c:
            r = c.query(QUESTION)  # the store is empty: generated anyway, as before
            assert r.answer and r.completion_tokens == 4 and r.finish_reason == "length" and not r.sources, r
            done = list(c.query_stream(QUESTION))[-1].done
            assert done.answer == r.answer and done.finish_reason == "length"
        assert _metric(srv, "oprag_answers_without_sources_total", action="generated") == 2
        assert _metric(srv, "oprag_answers_without_sources_total", action="refused") == 0
