"""Hostile input: hypothesis sends random and malformed requests of every RPC to a running
server. No process dies, no INTERNAL/UNKNOWN status for client mistakes, and rejected requests
leave the stored data unchanged."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration

BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}
text = st.text(max_size=300) | st.sampled_from(["", " ", "\x00", "🦀" * 50, "中文检索", "a" * 5000])
u32 = st.integers(0, 2**32 - 1)
weights = st.floats(allow_nan=True, allow_infinity=True) | st.just(0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz"), free_port(), free_port(), "--generator", "none").start()
    with OpRAGClient(srv.target, timeout=60) as c:
        c.ingest([Doc(f"base{i}", f"Baseline document {i} about orchards and pears.") for i in range(5)])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with OpRAGClient(server.target, timeout=30) as c:
        yield c


queries = st.builds(
    oprag_pb2.QueryRequest,
    question=text,
    top_k=u32,
    mode=st.integers(0, 2**31 - 1),
    session_id=text,
    generation=st.builds(oprag_pb2.GenerationOptions, max_new_tokens=u32),
    candidates=u32,
    disable_memory=st.booleans(),
    filters=st.lists(st.builds(oprag_pb2.MetadataFilter, key=text, values=st.lists(text, max_size=3)), max_size=3),
    fusion=st.builds(oprag_pb2.FusionOptions, method=st.integers(0, 2**31 - 1), dense_weight=weights,
                     lexical_weight=weights, rrf_k=u32),
    query_vector=st.lists(st.floats(allow_nan=True, width=32), max_size=400),
    min_seq=st.integers(0, 2**64 - 1),
)

docs = st.builds(oprag_pb2.Document, id=text, title=text, text=text,
                 metadata=st.dictionaries(text, text, max_size=5))


def _check(exc: grpc.RpcError) -> None:
    assert exc.code() not in BAD, f"{exc.code()}: {exc.details()}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(req=queries, which=st.sampled_from(["Query", "Retrieve", "QueryStream"]))
def test_random_queries_never_fail_internally(client, server, req, which):
    try:
        if which == "QueryStream":
            list(client.stub.QueryStream(req, timeout=30))
        else:
            getattr(client.stub, which)(req, timeout=30)
    except grpc.RpcError as exc:
        _check(exc)
    assert server.alive()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(docs, max_size=4), max_size=3), final=st.booleans(), count=st.integers(0, 20),
       bogus_delete=st.lists(text, max_size=5))
def test_random_ingest_and_delete_leave_data_consistent(client, server, batches, final, count, bogus_delete):
    before = client.stats()
    msgs = [oprag_pb2.IngestRequest(documents=b) for b in batches]
    msgs.append(oprag_pb2.IngestRequest(final=final, sent_documents=count))
    try:
        r = client.stub.Ingest(iter(msgs), timeout=60)
    except grpc.RpcError as exc:
        _check(exc)
        after = client.stats()
        assert (after.documents, after.chunks, after.seq) == (before.documents, before.chunks, before.seq)
    else:
        assert r.documents_written + len(r.rejected) <= sum(len(b) for b in batches)
    # the baseline documents are never touched by rejected requests
    _baseline_stored(client)
    try:
        client.stub.Delete(oprag_pb2.DeleteRequest(doc_ids=[d for d in bogus_delete if not d.startswith("base")]),
                           timeout=30)
    except grpc.RpcError as exc:
        _check(exc)
    assert server.alive()
    _baseline_stored(client)


def _baseline_stored(client) -> None:
    """Every baseline document is still stored: found by dense retrieval (which ranks every stored
    chunk). Not by BM25: in a corpus of a few chunks, terms in more than half of them get the
    floored idf 0.25 x the average idf, which is exactly 0 when the average is (the baseline and one
    random one-word chunk: six terms at df 5 of 6, six at df 1), and a chunk whose query terms all
    score 0 is in no BM25 list (README "Lexical ranks"; rank_bm25's running sum leaves -3.7e-17 there)."""
    base = client.retrieve("Baseline document about orchards and pears", mode="dense", top_k=100).hits
    assert {h.doc_id for h in base} >= {f"base{i}" for i in range(5)}
