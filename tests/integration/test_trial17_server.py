"""What the new-user trial 17 found at a real server's doors (generator off): error messages that
named the wrong thing. A filter value that is NaN or infinite said "metadata filter metadata 'g':
..." over gRPC, and over HTTP came back with ``param`` null; a document whose chunks lack a
vector said "a vector has 0 values; the index holds vectors of width 384", naming no chunk."""

from __future__ import annotations

import math

import grpc
import pytest
import requests

from oprag.v1 import oprag_pb2, oprag_pb2_grpc
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration


def _started(tmp_path_factory, *options: str) -> ServerProcess:
    """A started server without a generator, its HTTP API on ``srv.http_port``."""
    http = free_port()
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("trial17"), "--generator", "none", "--http-port", str(http),
                                      *options)
    srv.http_port = http
    srv.start()
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _started(tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield oprag_pb2_grpc.OpRAGStub(ch)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_filter_value_names_the_filter_once(stub, value):
    req = oprag_pb2.QueryRequest(question="lighthouse", filters=[oprag_pb2.MetadataFilter(
        key="g", typed_values=[oprag_pb2.MetadataValue(float_value=value)])])
    with pytest.raises(grpc.RpcError) as ei:
        stub.Retrieve(req, timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith(f"metadata filter 'g': {value} is not a finite number"), ei.value.details()


def test_a_non_finite_filter_value_over_http_names_its_param(server):
    # 1e400 is JSON for a number Python reads as infinity
    got = requests.post(f"http://127.0.0.1:{server.http_port}/v1/retrieve", timeout=30,
                        data='{"query": "lighthouse", "filters": {"g": 1e400}}', headers={"content-type": "application/json"})
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert err["param"] == "filters.g" and err["message"].startswith("metadata filter 'g': inf is not a finite number"), err


def test_a_chunk_without_a_vector_is_named(stub, server):
    doc = oprag_pb2.Document(id="c", chunks=[oprag_pb2.ChunkVector(text="one", vector=[0.1] * 384),
                                             oprag_pb2.ChunkVector(text="two")])
    with pytest.raises(grpc.RpcError) as ei:
        stub.Ingest(iter([oprag_pb2.IngestRequest(documents=[doc], final=True, sent_documents=1)]), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("document 0 ('c'): chunk 1 has no vector: "), ei.value.details()
    assert ei.value.details().endswith("nothing was stored")
    assert stub.Stats(oprag_pb2.StatsRequest(), timeout=30).documents == 0


@pytest.fixture(scope="module")
def hnsw_server(tmp_path_factory):
    srv = _started(tmp_path_factory, "--dense-index", "hnsw", "--ann-tail", "0")
    yield srv
    srv.stop()


def test_http_retrieve_takes_the_ann_knobs_as_grpc_does(hnsw_server):
    """/v1/retrieve refused ef_search and nprobe ("unknown field 'ef_search'"): an HNSW or IVF
    server's per-request knobs were gRPC-only, though the README promises the same hits as
    Retrieve for the same settings."""
    import numpy as np

    from oprag_client.client import Doc, OpRAGClient

    vecs = np.random.default_rng(17).standard_normal((40, 384)).astype(np.float32)
    url = f"http://127.0.0.1:{hnsw_server.http_port}/v1/retrieve"
    with OpRAGClient(hnsw_server.target) as c:
        c.ingest([Doc(f"d{i}", f"beacon number {i}", vector=vecs[i]) for i in range(40)])
        for knobs in ({"ef_search": 7}, {"ef_search": 0}, {"nprobe": 3}):
            want = c.retrieve("beacon", mode="dense", top_k=3, **knobs)
            got = requests.post(url, timeout=30, json={"query": "beacon", "mode": "dense", "top_k": 3, **knobs})
            assert got.status_code == 200, got.text
            body = got.json()
            assert [(h["doc_id"], h["score"]) for h in body["hits"]] == [(h.doc_id, h.score) for h in want.hits]
            assert body["retrieval"]["dense_index"] == "hnsw"
            assert body["retrieval"]["ef_search"] == want.retrieval.ef_search
        assert c.retrieve("beacon", mode="dense", top_k=3, ef_search=7).retrieval.ef_search < 512  # the knob was used
    bad = requests.post(url, timeout=30, json={"query": "beacon", "nprobe": 70000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "nprobe", bad.text
    assert "nprobe must be in [0, 65536], got 70000" in bad.json()["error"]["message"]


def test_thread_shards_do_their_idle_work(tmp_path_factory):
    """With --shard-workers thread nothing ran a shard's idle work: ingested HNSW vectors stayed in
    the exactly scanned tail for good (``ann_pending`` 300 a minute later; up to --ann-tail, 131,072
    by default, per shard) and no idle BM25 merge ran (``merge_pending`` stayed), where a shard
    process inserts them between requests and merges once writes are quiet for 5 s."""
    import numpy as np

    from oprag_client.client import Doc, OpRAGClient
    from oprag_client.testing import wait_until

    srv = _started(tmp_path_factory, "--shard-workers", "thread", "--dense-index", "hnsw")
    try:
        vecs = np.random.default_rng(7).standard_normal((600, 384)).astype(np.float32)
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest([Doc(f"d{i}", f"harbour light number {i}", vector=vecs[i]) for i in range(600)])
            first = c.retrieve("harbour", query_vector=vecs[5].tolist(), mode="dense", top_k=3)

            def settled():
                shards = c.stats().shards
                return all(s.ann_pending == 0 and s.merge_pending == 0 for s in shards)

            assert wait_until(settled, timeout=60, interval=0.5), [(s.ann_pending, s.merge_pending) for s in c.stats().shards]
            again = c.retrieve("harbour", query_vector=vecs[5].tolist(), mode="dense", top_k=3)
            assert [(h.doc_id, h.score) for h in again.hits] == [(h.doc_id, h.score) for h in first.hits]
    finally:
        srv.stop()
