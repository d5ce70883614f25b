"""End to end: a real server (real shard processes, all-MiniLM-L6-v2, SmolLM2) on a free
loopback port, driven through the streaming gRPC API, the typed client and the CLI."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient, ingest_messages
from oprag_client.testing import ServerProcess, free_port, oprag_cli

pytestmark = pytest.mark.integration

DOCS = [
    Doc("lighthouse", title="Varnholm Lighthouse", metadata={"topic": "buildings"}, text=(
        "The Varnholm Lighthouse stands on a granite skerry at the mouth of the Varn fjord. "
        "It was completed in 1874 after four summers of work, and its lantern was designed by the engineer "
        "Ingrid Solberg. The tower is 31 metres tall and is painted with red and white bands. Its light "
        "could be seen from 19 nautical miles away. The keepers lived in a stone house at the foot of the tower "
        "until the light was automated in 1961.")),
    Doc("bees", title="Honey bee dances", metadata={"topic": "biology"}, text=(
        "Honey bee foragers tell their nestmates where food is by dancing on the comb. In the waggle dance a bee "
        "runs straight ahead while shaking her abdomen, and the angle of that run relative to vertical encodes "
        "the direction of the flowers relative to the sun. The duration of the waggle run encodes the distance. "
        "For food very close to the hive bees perform a round dance instead.")),
    Doc("sourdough", title="Sourdough starter", metadata={"topic": "food"}, text=(
        "A sourdough starter is a culture of wild yeast and lactic acid bacteria kept in flour and water. Bakers "
        "feed it every day by discarding part of it and adding fresh flour and water. The bacteria produce lactic "
        "and acetic acid, which give the bread its sour taste, while the yeast produces the carbon dioxide that "
        "makes the dough rise.")),
    Doc("volcano", title="Mount Keldur", metadata={"topic": "geology"}, text=(
        "Mount Keldur is a shield volcano on a remote island in the north Atlantic. Its last eruption, in 1783, "
        "sent lava flows eleven kilometres to the sea and covered the island's farms with ash. Shield volcanoes "
        "have gentle slopes because their basaltic lava is runny and flows far before it cools.")),
    Doc("chess", title="Castling in chess", metadata={"topic": "games"}, text=(
        "Castling is the only chess move in which two pieces move at once: the king moves two squares towards a "
        "rook and the rook jumps to the square the king crossed. A player may not castle out of check, through "
        "check or into check, and neither the king nor that rook may have moved before.")),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("oprag-data")
    srv = ServerProcess(data, free_port(), free_port(), "--shards", "2", "--max-new-tokens", "24",
                        "--monitor-fraction", "1.0").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ingested(client):
    docs = DOCS + [Doc("empty", text="   "), Doc("", text="no id")]
    # several messages in one stream: the client splits by count and size
    msgs = list(ingest_messages(docs, max_docs_per_message=2))
    assert len(msgs) >= 3 and msgs[-1].final and msgs[-1].sent_documents == len(docs)
    r = client.stub.Ingest(iter(msgs), timeout=120)
    return r


def test_health_and_reflection(server, client):
    assert client.health() == "SERVING"
    assert client.health("oprag.v1.OpRAG") == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"oprag.v1.OpRAG", "grpc.health.v1.Health"} <= names


def test_streaming_ingest_counts_and_rejections(ingested):
    assert ingested.documents_written == len(DOCS)
    assert ingested.chunks_written == len(DOCS)  # every paragraph is under 900 characters
    rejected = {r.index: r.reason for r in ingested.rejected}
    assert set(rejected) == {5, 6}
    assert "text is empty" in rejected[5] and "id is empty" in rejected[6]
    assert ingested.seq > 0


@pytest.mark.parametrize("mode", ["hybrid", "dense", "lexical", "full_hybrid"])
def test_retrieve_finds_the_right_document(client, ingested, mode):
    r = client.retrieve("How do honey bees communicate the direction of flowers?", top_k=3, mode=mode)
    assert r.hits[0].doc_id == "bees"
    assert len(r.hits) == 3
    assert len({h.chunk_id for h in r.hits}) == 3
    for h in r.hits:
        assert h.shard in (0, 1) and h.text
    assert r.hits[0].lexical_score > 0 and r.hits[0].dense_score > 0.3
    assert r.request_id


def test_filters_fusion_and_query_vector(client, ingested):
    r = client.retrieve("What happens in a volcano or in bread?", top_k=3, filters={"topic": ["food", "games"]})
    assert r.hits and {h.doc_id for h in r.hits} <= {"sourdough", "chess"}
    assert r.retrieval.chunks_searched == 2
    r = client.retrieve("sourdough starter yeast", top_k=3, fusion="rrf", rrf_k=10, mode="full_hybrid")
    assert r.retrieval.fusion == "rrf" and r.retrieval.rrf_k == 10 and r.retrieval.mode == "full_hybrid"
    assert r.hits[0].doc_id == "sourdough" and r.hits[0].dense_rank == 1 and r.hits[0].lexical_rank == 1
    assert r.hits[0].score == pytest.approx(0.5 / 11 + 0.5 / 11)
    with pytest.raises(grpc.RpcError) as ei:
        client.retrieve("x", query_vector=[0.1] * 5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "384" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        client.retrieve("x", dense_weight=-1.0)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_query_answers_with_grounded_sources(client, ingested):
    r = client.query("In what year was the Varnholm Lighthouse completed?", top_k=3)
    assert r.hits[0].doc_id == "lighthouse"
    assert r.sources and r.sources[0].doc_id == "lighthouse" and r.sources[0].number == 1
    assert r.answer.strip()
    assert "1874" in r.answer
    assert 0 < r.completion_tokens <= 24
    assert r.finish_reason in ("stop", "length")
    for stage in ("queue", "embed", "retrieve", "fusion", "rerank", "context", "generate", "total"):
        assert stage in r.timings_ms
    # same request, same answer (greedy decoding, ties broken by id)
    assert client.query("In what year was the Varnholm Lighthouse completed?", top_k=3).answer == r.answer


def test_query_stream_sources_then_text_then_done(client, ingested):
    events = list(client.query_stream("What is castling in chess?", top_k=2, max_new_tokens=12, include_trace=True))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "sources" and kinds[-1] == "done" and kinds.count("sources") == 1 and kinds.count("done") == 1
    assert set(kinds[1:-1]) <= {"text"}
    assert events[0].sources.hits[0].doc_id == "chess"
    done = events[-1].done
    assert "".join(e.text for e in events if e.WhichOneof("event") == "text") == done.answer
    assert done.completion_tokens > 0 and done.ttft_ms > 0
    assert [s.op for s in done.trace.stages] == ["embed", "retrieve", "context", "generate"]
    assert {s.op for s in done.trace.stages} <= set(done.timings_ms)  # one name per operator
    assert all(s.batch_id == done.trace.stages[0].batch_id for s in done.trace.stages)
    # same request, same plan, same answer
    again = client.query("What is castling in chess?", top_k=2, max_new_tokens=12, include_trace=True)
    assert again.answer == done.answer
    assert [(s.op, s.domain) for s in again.trace.stages] == [(s.op, s.domain) for s in done.trace.stages]


def test_a_length_cut_inside_a_character_is_not_shown_as_a_replacement_character(client, ingested):
    """trial51 #3: an answer cut by ``max_new_tokens`` inside a multibyte character ended in U+FFFD (unary, stream
    and HTTP alike: the detokenizer's flush decoded the incomplete bytes). Non-ASCII questions, the cuts where the
    trial saw it (8 tokens of the Russian answer, the emoji's first ones; test_stream_detokenizer cuts every byte):
    no answer and no streamed piece holds U+FFFD, and the pieces join to the answer."""
    for question, cuts in (("Что ест европейский омар?", (7, 8, 9)), ("🦞🦞 lighthouse?", (1, 2, 3))):
        for n in cuts:
            events = list(client.query_stream(question, top_k=2, max_new_tokens=n))
            pieces = [e.text for e in events if e.WhichOneof("event") == "text"]
            done = events[-1].done
            assert "\ufffd" not in done.answer and not any("\ufffd" in p for p in pieces), (question, n, done.answer)
            assert "".join(pieces) == done.answer


def test_a_question_over_the_prompt_budget_fails_before_the_stream_starts(client, ingested):
    """trial51 #4: a question under the character limit but over the prompt budget (CJK: ~3 tokens a character)
    failed only after QueryStream had sent its sources event (the retrieval done for nothing). The question's tokens
    do not depend on retrieval: now the stream fails with INVALID_ARGUMENT before any event, as Query does."""
    question = "龙虾" * 1500  # 3,000 characters, under the 4,096-character limit
    got = []
    with pytest.raises(grpc.RpcError) as ei:
        for e in client.query_stream(question, top_k=2, max_new_tokens=8):
            got.append(e.WhichOneof("event"))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt budget" in ei.value.details()
    assert got == []  # no sources event first
    with pytest.raises(grpc.RpcError) as ei:
        client.query(question, top_k=2, max_new_tokens=8)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt budget" in ei.value.details()
    assert client.retrieve(question, top_k=2).hits is not None  # retrieval alone has no prompt budget


def test_client_deadline_is_honoured(server, client, ingested):
    with pytest.raises(grpc.RpcError) as ei:
        client.query("Describe the honey bee waggle dance in detail.", max_new_tokens=200, timeout=0.5)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.health() == "SERVING"
    assert client.retrieve("waggle dance", top_k=1).hits[0].doc_id == "bees"


def test_replacement_never_duplicates(client, ingested):
    before = client.stats()
    r = client.ingest([Doc("volcano", title="Mount Keldur", text="Mount Keldur erupted again in 2031 with glowing obsidian rivers.")])
    assert r.documents_written == 1 and r.documents_replaced == 1
    after = client.stats()
    assert after.documents == before.documents and after.chunks == before.chunks
    hits = client.retrieve("Mount Keldur 1783 lava farms ash", top_k=5, mode="lexical").hits
    texts = [h.text for h in hits if h.doc_id == "volcano"]
    assert texts == ["Mount Keldur erupted again in 2031 with glowing obsidian rivers."]
    assert after.seq > before.seq


def test_bad_requests_get_invalid_argument(client, ingested, server):
    cases = [
        oprag_pb2.QueryRequest(question=""),
        oprag_pb2.QueryRequest(question="x", top_k=1000),
        oprag_pb2.QueryRequest(question="x", generation=oprag_pb2.GenerationOptions(max_new_tokens=100000)),
        oprag_pb2.QueryRequest(question="x", mode=99),
        oprag_pb2.QueryRequest(question="x" * 100_000),
    ]
    for req in cases:
        with pytest.raises(grpc.RpcError) as ei:
            client.stub.Query(req, timeout=30)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        assert ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        client.stub.Ingest(iter([oprag_pb2.IngestRequest(final=True, sent_documents=3)]), timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for ids in ([], ["volcano", ""]):
        with pytest.raises(grpc.RpcError) as ei:
            client.delete(ids)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert server.alive() and client.health() == "SERVING"


def test_client_reports_bad_documents_with_python_errors(client, ingested):
    before = client.stats().documents
    with pytest.raises(ValueError, match="split it"):
        client.ingest([Doc("ok", "fine"), Doc("big", "x" * (40 * 1024 * 1024))])
    with pytest.raises(TypeError):
        client.ingest([Doc("ok2", "fine"), 42])
    assert client.stats().documents == before  # the aborted streams stored nothing


def test_oversized_message_is_refused_not_fatal(server, client, ingested):
    with OpRAGClient(server.target, max_message_bytes=64 * 1024 * 1024) as big:
        with pytest.raises(grpc.RpcError) as ei:
            big.query("x" * (40 * 1024 * 1024), timeout=60)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.alive() and client.stats().documents == len(DOCS)


FOLLOW_UP = "Tell me more about it."  # no evidence of its own in DOCS: only the session says what "it" is


def test_session_memory_is_isolated(client, ingested):
    alone = client.retrieve(FOLLOW_UP, top_k=3)
    assert alone.hits[0].doc_id != "lighthouse" and not alone.memory_used  # ambiguous without a session
    client.query("When was the Varnholm Lighthouse completed?", session_id="s1", max_new_tokens=8)
    r = client.retrieve(FOLLOW_UP, session_id="s1", top_k=3)
    assert r.memory_used and r.hits[0].doc_id == "lighthouse"
    assert "Varnholm" in r.memory_context and "Varnholm Lighthouse" in r.resolved_query
    other = client.retrieve(FOLLOW_UP, session_id="s2", top_k=3)  # a session with no turns
    assert not other.memory_used and other.memory_context == "" and other.resolved_query == ""
    assert [h.chunk_id for h in other.hits] == [h.chunk_id for h in alone.hits]
    assert client.clear_session("s1").records_removed >= 2  # the Query turn and the Retrieve turn
    cleared = client.retrieve(FOLLOW_UP, session_id="s1", top_k=3)
    assert not cleared.memory_used and cleared.memory_context == ""
    assert [h.chunk_id for h in cleared.hits] == [h.chunk_id for h in alone.hits]


def test_sessions_stay_isolated_under_concurrency(server, ingested):
    from concurrent.futures import ThreadPoolExecutor

    firsts = {"lighthouse": "When was the Varnholm Lighthouse completed?", "bees": "How do honey bees dance?",
              "sourdough": "What is a sourdough starter?", "volcano": "When did Mount Keldur last erupt?",
              "chess": "What is castling in chess?"}
    topics = list(firsts)
    sessions = {f"iso-{i}": topics[i % len(topics)] for i in range(20)}
    with OpRAGClient(server.target, timeout=120) as c, ThreadPoolExecutor(10) as ex:
        list(ex.map(lambda sid: c.retrieve(firsts[sessions[sid]], session_id=sid, top_k=2), sessions))
        alone = c.retrieve(FOLLOW_UP, top_k=2).hits[0].doc_id  # the question's own top document
        follow = dict(zip(sessions, ex.map(lambda sid: c.retrieve(FOLLOW_UP, session_id=sid, top_k=2), sessions)))
        titles = {d.id: d.title for d in DOCS}
        for sid, topic in sessions.items():
            r = follow[sid]
            assert r.hits[0].doc_id == topic, (sid, [h.doc_id for h in r.hits])
            # memory reports itself exactly when it changed the ranking: every session but the
            # ones whose subject the question's own list already puts first
            assert r.memory_used == (topic != alone), sid
            if r.memory_used:
                assert firsts[topic] in r.memory_context and titles[topic] in r.resolved_query, (sid, r.memory_context)
            else:
                assert r.memory_context == "" and r.resolved_query == "", sid
            ctx = r.memory_context + r.resolved_query
            assert not any(q in ctx for t, q in firsts.items() if t != topic), (sid, ctx)
            assert not any(ti in r.resolved_query for t, ti in titles.items() if t != topic), (sid, r.resolved_query)
        removed = list(ex.map(lambda sid: c.clear_session(sid).records_removed, sessions))
    assert removed == [2] * len(sessions)


def test_dense_first_certified_equals_exact(client, ingested):
    """A dense-first window of one chunk per shard: the shards' BM25 lists and the threshold bound
    (widening where it does not hold) still give exact mode's top-k, over gRPC, reported."""
    for q, filters in (("sourdough bacteria lactic acid", None), ("granite tower lava ash", {"topic": ["geology", "buildings"]})):
        hyb = client.retrieve(q, top_k=3, candidates=1, filters=filters)
        exact = client.retrieve(q, top_k=3, candidates=1, mode="full_hybrid", filters=filters)
        assert [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in hyb.hits] == \
            [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in exact.hits]
        assert hyb.retrieval.certified and hyb.retrieval.lexical_candidates >= 64
        assert not exact.retrieval.certified and exact.retrieval.lexical_candidates == 0
        assert hyb.retrieval.exact and exact.retrieval.exact  # (flat: the certified top-k is exact)
        rrf = client.retrieve(q, top_k=3, candidates=1, fusion="rrf", filters=filters)
        assert not rrf.retrieval.certified and not rrf.retrieval.exact


def test_metrics_endpoint_has_stage_histograms(server, client, ingested):
    client.retrieve("sourdough bacteria", top_k=2)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for stage in ("memory", "embed", "retrieve", "fusion", "context", "generate", "promote", "upsert"):
        assert f'oprag_stage_seconds_bucket{{le="0.001",stage="{stage}"}}' in body or \
            f'oprag_stage_seconds_count{{stage="{stage}"}}' in body
    assert 'oprag_requests_total{code="OK",method="Retrieve"}' in body
    assert "oprag_chunks_ingested_total" in body
    assert "oprag_batch_size_bucket" in body
    assert "oprag_retrieval_widened_total" in body and "oprag_retrieval_uncertified_total 0.0" in body
    # --monitor-fraction 1.0: every dense-first query is re-checked in exact mode off the request path
    import re
    import time

    count = 0.0
    for _ in range(50):
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        m = re.search(r"^oprag_pruning_recall_count (\S+)$", body, re.M)
        count = float(m.group(1)) if m else 0.0
        if count > 0:
            break
        time.sleep(0.1)
    assert count > 0


def test_cli_ingest_and_query(server, ingested, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "kites.txt").write_text(
        "Box kites were invented by Lawrence Hargrave in 1893. Their rectangular cells give strong lift and "
        "stable flight, and they were used to lift weather instruments.", encoding="utf-8")
    (folder / "tides.md").write_text(
        "Spring tides happen when the sun and the moon line up, at new and full moon, and give the largest "
        "difference between high and low water.", encoding="utf-8")
    cli = oprag_cli()
    out = subprocess.run(cli + ["ingest", "--server", server.target, "--format", "text", "--json", "--no-progress",
                                str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 2 and summary["chunks"] == 2 and summary["chunks_reused"] == 0
    out = subprocess.run(cli + ["query", "--server", server.target, "--json", "--top-k", "2",
                                "--max-new-tokens", "16", "Who invented the box kite?"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert set(obj) >= {"answer", "hits", "timings_ms", "request_id"}
    assert obj["hits"][0]["doc_id"] == "kites.txt"
    assert set(obj["hits"][0]) >= {"chunk_id", "doc_id", "text", "score", "dense_score", "lexical_score", "shard"}
    bad = subprocess.run(cli + ["query", "--server", server.target, "--top-k", "500", "hello"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr
    missing = subprocess.run(cli + ["ingest", "--server", server.target, "--format", "text", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "no such file" in missing.stderr and "0doc" not in missing.stderr


def test_cli_session_follow_up_no_memory_and_clear(server, ingested):
    cli = oprag_cli()
    base = ["--server", server.target]

    def q(*args: str) -> dict:
        out = subprocess.run(cli + ["query", *base, "--json", "--no-generate", "--top-k", "3", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    alone = q(FOLLOW_UP)
    assert alone["hits"][0]["doc_id"] != "lighthouse" and not alone["memory_used"]
    q("--session", "cli-s", "When was the Varnholm Lighthouse completed?")
    follow = q("--session", "cli-s", FOLLOW_UP)
    assert follow["memory_used"] and "Varnholm" in follow["memory_context"]
    assert "Varnholm Lighthouse" in follow["resolved_query"] and follow["hits"][0]["doc_id"] == "lighthouse"
    off = q("--session", "cli-s", "--no-memory", FOLLOW_UP)
    assert not off["memory_used"] and off["memory_context"] == "" and off["resolved_query"] == ""
    assert [h["chunk_id"] for h in off["hits"]] == [h["chunk_id"] for h in alone["hits"]]
    out = subprocess.run(cli + ["clear-session", *base, "--json", "cli-s"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["records_removed"] == 2  # the two memory-on turns; --no-memory records nothing
    cleared = q("--session", "cli-s", FOLLOW_UP)
    assert not cleared["memory_used"] and cleared["memory_context"] == ""
    assert cleared["hits"][0]["doc_id"] == alone["hits"][0]["doc_id"]


def test_restart_serves_the_same_corpus(server, client, ingested, tmp_path):
    before = client.stats()
    top_before = [h.chunk_id for h in client.retrieve("shield volcano lava", top_k=3).hits]
    assert server.stop() == 0
    server.start()
    with OpRAGClient(server.target, timeout=60) as c2:
        after = c2.stats()
        assert (after.documents, after.chunks) == (before.documents, before.chunks)
        assert after.seq >= before.seq
        assert [h.chunk_id for h in c2.retrieve("shield volcano lava", top_k=3).hits] == top_before
