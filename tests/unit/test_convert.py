"""service/convert.py: request validation (every message), mode and fusion mapping, filters,
query vectors, and the conversion of finished jobs to wire messages. No server needed."""

from __future__ import annotations

import numpy as np
import pytest

from oprag.v1 import oprag_pb2
from oprag_server.config import ServerConfig
from oprag_server.domain import (ContextPayload, DocumentHit, Hit, MemoryContext, RetrievalInfo, RetrieveSpec,
                                 SourceRef)
from oprag_server.engine.job import QueryJob
from oprag_server.engine.scheduler import PlanStep
from oprag_server.service import convert
from oprag_server.service.convert import InvalidArgument

CFG = ServerConfig()
DIM = 4


def job(*, generate=True, can_generate=True, **fields):
    req = oprag_pb2.QueryRequest(**{"question": "what?", **fields})
    return convert.query_job(req, CFG, dim=DIM, generate=generate, can_generate=can_generate)


def test_defaults_come_from_the_config():
    j = job()
    r, g = CFG.retrieval, CFG.generate
    assert j.spec == RetrieveSpec(mode="hybrid", top_k=r.default_top_k,
                                  candidates=max(r.hybrid_candidates, 4 * r.default_top_k),
                                  dense_weight=r.dense_weight, lexical_weight=r.lexical_weight, fusion="minmax",
                                  rrf_k=60, filters=())
    assert j.max_new_tokens == g.default_max_new_tokens and j.generate and j.use_memory
    assert j.query_vector is None and len(j.request_id) == 32


def test_retrieve_and_no_generator_do_not_generate():
    assert job(generate=False).max_new_tokens == 0 and not job(generate=False).generate
    assert not job(can_generate=False).generate


def test_no_generator_finish_reason():
    assert job(can_generate=False).finish_reason == convert.NO_GENERATOR == "no_generator"
    assert job().finish_reason == "" and job(generate=False, can_generate=False).finish_reason == ""


def test_group_by_document_request():
    assert (job().spec.group_by_document, job().spec.chunks_per_document) == (False, 1)
    j = job(top_k=20, group_by_document=True)
    assert (j.spec.group_by_document, j.spec.top_k, j.spec.chunks_per_document) == (True, 20, 1)
    assert job(top_k=10, group_by_document=True, chunks_per_document=5).spec.chunks_per_document == 5
    with pytest.raises(InvalidArgument, match="^chunks_per_document needs group_by_document: set it, or send 0$"):
        job(chunks_per_document=2)
    with pytest.raises(InvalidArgument) as e:
        job(top_k=100, group_by_document=True, chunks_per_document=41)
    assert str(e.value) == (f"top_k x chunks_per_document is 4100; the limit is {R.max_candidates}: "
                            "ask for fewer documents or chunks")


@pytest.mark.parametrize("wire,name", [(oprag_pb2.RETRIEVAL_MODE_UNSPECIFIED, "hybrid"), (oprag_pb2.HYBRID, "hybrid"),
                                       (oprag_pb2.DENSE, "dense"), (oprag_pb2.LEXICAL, "lexical"),
                                       (oprag_pb2.FULL_HYBRID, "full_hybrid")])
def test_mode_mapping(wire, name):
    assert job(mode=wire).spec.mode == name


def test_candidates_at_least_top_k_and_session_and_memory():
    j = job(top_k=50, candidates=10, session_id="s1", disable_memory=True)
    assert (j.spec.top_k, j.spec.candidates, j.session_id, j.use_memory) == (50, 50, "s1", False)


LIM, R, G = CFG.limits, CFG.retrieval, CFG.generate


@pytest.mark.parametrize("fields,msg", [
    ({"question": ""}, "question is empty: send a non-empty question"),
    ({"question": "  \n"}, "question is empty: send a non-empty question"),
    ({"question": "\u200b"}, "question is empty: send a non-empty question"),  # only invisible characters
    ({"question": "\u00ad\ufeff\u200b"}, "question is empty: send a non-empty question"),
    ({"question": "\x00\x01\x02"}, "question is empty: send a non-empty question"),  # only control characters
    ({"question": "x" * (LIM.max_question_chars + 1)},
     f"question has {LIM.max_question_chars + 1} characters; the limit is {LIM.max_question_chars}: shorten it"),
    ({"top_k": R.max_top_k + 1}, f"top_k must be in [1, {R.max_top_k}] (0 = the default), got {R.max_top_k + 1}"),
    ({"mode": 9}, "unknown retrieval mode 9: use HYBRID (1), DENSE (2), LEXICAL (3) or FULL_HYBRID (4)"),
    ({"candidates": R.max_candidates + 1}, f"candidates must be in [1, {R.max_candidates}] (0 = the default), got {R.max_candidates + 1}"),
    ({"session_id": "s" * (LIM.max_session_id_bytes + 1)},
     f"session_id is longer than {LIM.max_session_id_bytes} bytes: a session id is 1 to {LIM.max_session_id_bytes} "
     "bytes of UTF-8 with no control characters (U+0000-U+001F, U+007F-U+009F) and no leading or trailing whitespace"),
    ({"fusion": oprag_pb2.FusionOptions(method=7)}, "unknown fusion method 7: use WEIGHTED_MINMAX (1) or RRF (2)"),
    ({"fusion": oprag_pb2.FusionOptions(dense_weight=float("nan"))}, "fusion.dense_weight must be 0 or a number in [1e-12, 1e6], got nan"),
    ({"fusion": oprag_pb2.FusionOptions(lexical_weight=-1.0)}, "fusion.lexical_weight must be 0 or a number in [1e-12, 1e6], got -1.0"),
    ({"fusion": oprag_pb2.FusionOptions(dense_weight=2e6)}, "fusion.dense_weight must be 0 or a number in [1e-12, 1e6], got 2000000.0"),
    ({"fusion": oprag_pb2.FusionOptions(dense_weight=1e-320)}, "fusion.dense_weight must be 0 or a number in [1e-12, 1e6], got 1e-320"),
    ({"fusion": oprag_pb2.FusionOptions(lexical_weight=9e-13, dense_weight=1.0)},
     "fusion.lexical_weight must be 0 or a number in [1e-12, 1e6], got 9e-13"),
    ({"fusion": oprag_pb2.FusionOptions(rrf_k=100_001)}, "fusion.rrf_k must be <= 100000, got 100001"),
    ({"filters": [oprag_pb2.MetadataFilter(key="k", values=["v"])] * 17}, "17 metadata filters; the limit is 16"),
    ({"filters": [oprag_pb2.MetadataFilter(key="", values=["v"])]},
     "a metadata filter has an empty key: name the metadata key to match"),
    ({"filters": [oprag_pb2.MetadataFilter(key="k")]}, "metadata filter 'k' needs between 1 and 1024 values"),
    ({"filters": [oprag_pb2.MetadataFilter(key="k", values=["v"] * 1025)]},
     "metadata filter 'k' needs between 1 and 1024 values"),
    ({"query_vector": [1.0, 2.0]}, f"query_vector has 2 values; the embedder produces {DIM}"),
    ({"query_vector": [1.0, float("inf"), 0.0, 0.0]}, "query_vector contains NaN or infinity (float32 holds at most "
     "about 3.4e38 in magnitude: a larger value arrives as infinity)"),
    ({"query_vector": [0.0] * DIM}, "query_vector is all zeros: send the query embedding (float32 rounds magnitudes "
     "below about 1.4e-45 to 0)"),
    ({"query_vector": [1e-46] * DIM}, "query_vector is all zeros: send the query embedding (float32 rounds magnitudes "
     "below about 1.4e-45 to 0)"),
    ({"generation": oprag_pb2.GenerationOptions(max_new_tokens=G.max_new_tokens_limit + 1)},
     f"max_new_tokens must be in [1, {G.max_new_tokens_limit}] (0 = the default), got {G.max_new_tokens_limit + 1}"),
])
def test_validation_messages(fields, msg):
    with pytest.raises(InvalidArgument) as e:
        job(**fields)
    assert str(e.value) == msg


def test_max_new_tokens_is_not_checked_without_generation():
    big = oprag_pb2.GenerationOptions(max_new_tokens=G.max_new_tokens_limit + 1)
    assert job(generate=False, generation=big).max_new_tokens == 0


def test_fusion_mapping():
    dflt = (0.3, 0.7)
    assert convert.fusion(oprag_pb2.FusionOptions(), default_weights=dflt) == ("minmax", 0.3, 0.7, 60)
    assert convert.fusion(oprag_pb2.FusionOptions(method=oprag_pb2.WEIGHTED_MINMAX, dense_weight=2.0),
                          default_weights=dflt) == ("minmax", 2.0, 0.0, 60)
    assert convert.fusion(oprag_pb2.FusionOptions(method=oprag_pb2.RRF, rrf_k=10, lexical_weight=1.0),
                          default_weights=dflt) == ("rrf", 0.0, 1.0, 10)
    # the ends of the range (trial24: 1e-320 was accepted and every fused score was 0)
    assert convert.fusion(oprag_pb2.FusionOptions(dense_weight=1e-12, lexical_weight=1e6),
                          default_weights=dflt) == ("minmax", 1e-12, 1e6, 60)


def test_filters():
    fs = [oprag_pb2.MetadataFilter(key="lang", values=["en", "de"]), oprag_pb2.MetadataFilter(key="y", values=["1"])]
    assert convert.filters(fs) == (("lang", ("en", "de")), ("y", ("1",)))
    assert convert.filters([]) == ()


def test_query_vector_is_unit_norm_float32_without_overflow():
    v = convert.query_vector([3e300, 4e300, 0.0, 0.0], DIM)
    assert v.dtype == np.float32 and np.allclose(v, [0.6, 0.8, 0, 0])
    assert convert.query_vector([], DIM) is None


def test_session_and_delete_ids():
    assert convert.check_session_id("", LIM) == ""
    with pytest.raises(InvalidArgument, match=r"^session_id is empty: name the session to clear \(a session id is 1 to 256 bytes"):
        convert.check_session_id("", LIM, required=True)
    assert convert.delete_ids(oprag_pb2.DeleteRequest(doc_ids=["a", "b"]), LIM) == ["a", "b"]
    for ids, msg in (([], "doc_ids is empty: name at least one document id"),
                     (["a", ""], "doc_ids contains an empty or all-whitespace id: every id must have a non-space character"),
                     (["a", " \t "], "doc_ids contains an empty or all-whitespace id: every id must have a non-space character")):
        with pytest.raises(InvalidArgument) as e:
            convert.delete_ids(oprag_pb2.DeleteRequest(doc_ids=ids), LIM)
        assert str(e.value) == msg
    with pytest.raises(InvalidArgument) as e:
        convert.delete_ids(oprag_pb2.DeleteRequest(doc_ids=["a"] * 3), type(LIM)(max_delete_ids=2))
    assert str(e.value) == "3 ids; the limit per Delete is 2"


def finished_job() -> QueryJob:
    j = QueryJob(question="q", spec=RetrieveSpec(), request_id="r1")
    j.hits = [Hit("c1", "d1", "T", "text", 0.9, 0.8, 1.5, 1, {"k": "v"}, 1, 2)]
    j.info = RetrievalInfo("hybrid", "minmax", 0.5, 0.5, 60, 256, chunks_searched=10, missing_shards=[1])
    j.payload = ContextPayload("prompt", 42, [SourceRef(1, "c1", "d1", "T", 30, True)])
    j.memory = MemoryContext("rq", "earlier turn", 1, context_text="rq subject", used=True)
    j.answer, j.completion_tokens, j.finish_reason, j.ttft_ms = "A", 5, "stop", 12.5
    j.timings_ms = {"queue": 1.0}
    j.plan = (PlanStep("embed", "gpu"),)
    j.last_end = 10.0
    j.record(j.plan[0], end=10.003, run_s=0.002)  # ran 2 ms after waiting 1 ms
    return j


def test_query_response_converts_every_field():
    r = convert.query_response(finished_job(), include_trace=True, has_generator=True)
    h = r.hits[0]
    assert (h.chunk_id, h.doc_id, h.title, h.text, h.shard, dict(h.metadata), h.dense_rank, h.lexical_rank) == \
        ("c1", "d1", "T", "text", 1, {"k": "v"}, 1, 2)
    assert h.score == pytest.approx(0.9) and h.lexical_score == pytest.approx(1.5)
    s = r.sources[0]
    assert (s.number, s.chunk_id, s.doc_id, s.title, s.tokens, s.truncated) == (1, "c1", "d1", "T", 30, True)
    assert r.retrieval.partial and list(r.retrieval.missing_shards) == [1] and r.retrieval.chunks_searched == 10
    assert (r.answer, r.prompt_tokens, r.completion_tokens, r.finish_reason, r.memory_context, r.request_id) == \
        ("A", 42, 5, "stop", "earlier turn", "r1")
    assert dict(r.timings_ms) == pytest.approx({"queue": 1.0, "embed": 2.0}) and r.ttft_ms == 12.5
    assert [(t.op, t.domain) for t in r.trace.stages] == [("embed", "gpu")]
    assert [t.queue_ms for t in r.trace.stages] == pytest.approx([1.0]) and r.trace.stages[0].run_ms == pytest.approx(2.0)


def test_memory_context_only_when_memory_changed_the_retrieval():
    j = finished_job()
    for r in (convert.retrieve_response(j, include_trace=False),
              convert.query_response(j, include_trace=False, has_generator=True),
              convert.stream_event("sources", j).sources):
        assert (r.memory_context, r.memory_used, r.resolved_query) == ("earlier turn", True, "rq subject")
    j.memory.used = False  # looked up, but the fused ranking equals the question's own
    for r in (convert.retrieve_response(j, include_trace=False),
              convert.query_response(j, include_trace=False, has_generator=True),
              convert.stream_event("sources", j).sources):
        assert (r.memory_context, r.memory_used, r.resolved_query) == ("", False, "")


def test_response_without_trace_generator_payload_or_info():
    j = finished_job()
    assert convert.query_response(j, include_trace=False, has_generator=False).answer == ""
    assert not convert.query_response(j, include_trace=False, has_generator=True).HasField("trace")
    j.payload, j.info, j.memory = None, None, None
    r = convert.retrieve_response(j, include_trace=False)
    assert not r.HasField("retrieval") and r.memory_context == "" and len(r.hits) == 1
    assert list(convert.sources(j)) == []


def test_documents_in_every_response():
    j = finished_job()
    assert list(convert.documents(j)) == [] and not convert.retrieve_response(j, include_trace=False).documents
    j.documents = [DocumentHit("d1", "T", 0.9, list(j.hits))]
    for r in (convert.retrieve_response(j, include_trace=False),
              convert.query_response(j, include_trace=False, has_generator=True),
              convert.stream_event("sources", j).sources):
        (d,) = r.documents
        assert (d.doc_id, d.title, [h.chunk_id for h in d.hits]) == ("d1", "T", ["c1"])
        assert d.score == pytest.approx(0.9) and d.hits[0] == r.hits[0]


def test_stream_events():
    j = finished_job()
    assert convert.stream_event("text", "tok").text == "tok"
    ev = convert.stream_event("sources", j).sources
    assert ev.request_id == "r1" and len(ev.hits) == 1 and len(ev.sources) == 1 and ev.memory_context == "earlier turn"
    d = convert.done_event(j, include_trace=True).done
    assert (d.answer, d.prompt_tokens, d.completion_tokens, d.finish_reason, len(d.trace.stages)) == ("A", 42, 5, "stop", 1)


def test_ingest_and_stats_responses():
    from oprag_server.engine.ingest import IngestResult

    res = IngestResult(documents_written=2, chunks_written=5, documents_replaced=1, chunks_split=1, chunks_reused=3,
                       rejected=[(4, "x", "empty text")], seq=7, elapsed_ms=9.5)
    r = convert.ingest_response(res)
    assert (r.documents_written, r.chunks_written, r.documents_replaced, r.chunks_split, r.chunks_reused, r.seq) == \
        (2, 5, 1, 1, 3, 7)
    assert [(x.index, x.id, x.reason) for x in r.rejected] == [(4, "x", "empty text")] and r.elapsed_ms == 9.5
    shard = {"shard": 0, "documents": 2, "chunks": 5, "memory_records": 1, "applied_seq": 7, "extra": "ignored"}
    st = convert.stats_response({"documents": 2, "chunks": 5, "memory_records": 1, "seq": 7, "embedder": "e",
                                 "generator": "none", "shards": [shard]})
    assert (st.documents, st.chunks, st.memory_records, st.seq, st.embedder, st.generator) == (2, 5, 1, 7, "e", "none")
    assert (st.shards[0].shard, st.shards[0].applied_seq) == (0, 7)
