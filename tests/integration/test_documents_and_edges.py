"""Issue 15 on a real server without a generator: document-level retrieval and ``oprag eval beir``
(case 3), undecodable requests (case 5), and the finish reason of a Query without a generator
(case 8)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import grpc
import pytest
from oprag_client.testing import ServerProcess, free_port, oprag_cli

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc

pytestmark = pytest.mark.integration

# 900 characters, "zebra" 10 times: one chunk per block with the default 900-character chunks
_SENT = ("The zebra herd crossed the dry plain at dawn while a zebra foal kept close to its mother. "
         "Dust rose behind the animals as they walked towards the distant river under the pale sky. ")
BLOCK = _SENT * 5
assert len(BLOCK) == 900 and BLOCK.count("zebra") == 10
FILLER_TOPICS = ["tea harvest", "river ferry", "mountain pass", "copper mine", "harbour crane", "violin repair"]


@pytest.fixture(scope="module", params=["process", pytest.param("thread", marks=pytest.mark.slow)])
def server(tmp_path_factory, request):
    """The server with its shards in processes, then on threads (``--shard-workers``; with
    ``-m slow``: the default suite keeps to its 10 minutes, and thread shards are covered there by
    tests/unit/test_thread_shards.py and the kill -9 trial)."""
    srv = ServerProcess(tmp_path_factory.mktemp("docs-data"), free_port(), free_port(), "--generator", "none",
                        "--shards", "2", "--shard-workers", request.param).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def zebra(client):
    # the case used 25 blocks per document, which filled the top-100 chunks at the old
    # 900-character chunking; the token chunker cuts fewer, longer chunks (about 22 from 25
    # blocks), so 32 blocks keep the case's point: D1-D4 alone fill every top-100 chunk slot
    docs = [Doc(f"D{i}", BLOCK * 32, title=f"Herd notes {i}") for i in range(1, 5)]
    docs.append(Doc("D5", "Minutes of the budget meeting: parking permits, a new printer for the second floor, the "
                          "cafeteria menu and the holiday rota; someone left a zebra mug in the kitchen.",
                    title="Meeting minutes"))
    docs += [Doc(f"F{i:03d}", f"Filler note {i} about the {FILLER_TOPICS[i % 6]} and its accounts for week {i}.")
             for i in range(102)]
    r = client.ingest(docs)
    assert r.documents_written == 107 and not r.rejected
    return r


def _requests(server, method: str, code: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^oprag_requests_total{{code="{code}",method="{method}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


# ------------------------------------------------------------------ case 3: document-level retrieval
def test_chunk_level_top_100_never_sees_d5(client, zebra):
    r = client.retrieve("zebra", top_k=100, min_seq=zebra.seq)
    assert len(r.hits) == 100 and {h.doc_id for h in r.hits} == {"D1", "D2", "D3", "D4"}


def test_group_by_document_ranks_documents_by_best_chunk(client, zebra):
    r = client.retrieve("zebra", top_k=10, group_by_document=True, chunks_per_document=3, min_seq=zebra.seq)
    docs = list(r.documents)
    assert [d.doc_id for d in docs[:5]] == ["D1", "D2", "D3", "D4", "D5"] and len(docs) == 10
    for d in docs:
        assert d.score == d.hits[0].score and all(h.doc_id == d.doc_id for h in d.hits)
        assert d.title == d.hits[0].title
    assert [len(d.hits) for d in docs[:5]] == [3, 3, 3, 3, 1]
    assert [d.score for d in docs] == sorted((d.score for d in docs), reverse=True)
    assert [h.chunk_id for h in r.hits] == [h.chunk_id for d in docs for h in d.hits]
    # the exact modes agree on the top documents; without grouping the response has no documents
    for mode in ("full_hybrid", "lexical"):
        ex = client.retrieve("zebra", top_k=5, mode=mode, group_by_document=True)
        assert [d.doc_id for d in ex.documents] == ["D1", "D2", "D3", "D4", "D5"], mode
    assert not client.retrieve("zebra", top_k=5).documents
    with pytest.raises(grpc.RpcError) as ei:
        client.retrieve("zebra", top_k=5, chunks_per_document=2)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "group_by_document" in ei.value.details()


def test_eval_beir_scores_documents(server, zebra, tmp_path):
    (tmp_path / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "zebra"}) + "\n")
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tD5\t1\n")
    out = subprocess.run(oprag_cli() + ["eval", "beir", "--server", server.target, "--queries",
                                        str(tmp_path / "queries.jsonl"), "--qrels", str(tmp_path / "qrels.tsv")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert (res["ndcg@10"], res["recall@100"], res["mrr@10"], res["n"]) == (0.38685, 1.0, 0.2, 1)


# ------------------------------------------------------------------ case 5: undecodable requests
BAD = bytes.fromhex("0a 04 63 61 66 e9")  # field 1 = b"caf\xe9": not UTF-8


def test_invalid_utf8_is_invalid_argument_counted_and_stores_nothing(server, client, zebra):
    before = client.stats()
    ch = client.channel
    unary = {m: ch.unary_unary(f"/oprag.v1.OpRAG/{m}", request_serializer=None, response_deserializer=None)
             for m in ("Retrieve", "Query", "Delete", "ClearSession")}
    counts = {m: _requests(server, m, "INVALID_ARGUMENT") for m in (*unary, "Ingest", "QueryStream")}
    for m, call in unary.items():
        with pytest.raises(grpc.RpcError) as ei:
            call(BAD, timeout=60)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, m
        assert "UTF-8" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        list(ch.unary_stream("/oprag.v1.OpRAG/QueryStream", request_serializer=None,
                             response_deserializer=None)(BAD, timeout=60))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Ingest: a valid message, then a document whose id is not UTF-8, then the final message
    good = oprag_pb2.IngestRequest(documents=[Doc("utf8-ok", "valid text about walruses").to_pb()])
    bad_doc = bytes.fromhex("0a06") + BAD  # IngestRequest{documents: [Document{id: b"caf\xe9"}]}
    final = oprag_pb2.IngestRequest(final=True, sent_documents=2).SerializeToString()
    ingest = ch.stream_unary("/oprag.v1.OpRAG/Ingest", request_serializer=None, response_deserializer=None)
    for msgs in ([good.SerializeToString(), bad_doc, final], [BAD]):
        with pytest.raises(grpc.RpcError) as ei:
            ingest(iter(msgs), timeout=60)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in ei.value.details()
    after = client.stats()
    assert (after.documents, after.chunks, after.seq) == (before.documents, before.chunks, before.seq)
    assert not client.retrieve("walruses", mode="lexical", top_k=5).hits
    want = {**{m: 1 for m in unary}, "QueryStream": 1, "Ingest": 2}
    assert {m: _requests(server, m, "INVALID_ARGUMENT") - counts[m] for m in counts} == want
    assert client.health() == "SERVING"


# ------------------------------------------------------------------ case 8: no generator
def test_query_without_generator_says_so(client, zebra):
    r = client.query("zebra", top_k=2)
    assert r.finish_reason == "no_generator" and r.answer == "" and r.completion_tokens == 0 and len(r.hits) == 2
    events = list(client.query_stream("zebra", top_k=2))
    assert events[0].WhichOneof("event") == "sources" and events[-1].done.finish_reason == "no_generator"
    assert client.retrieve("zebra", top_k=2).hits  # Retrieve is unaffected


# ------------------------------------------------------------------ issue 13: memory by component
def test_stats_and_gauges_report_shard_bytes_by_component(server, client, zebra):
    import time

    st = client.stats()
    assert len(st.shards) == 2
    for s in st.shards:
        assert s.chunks > 0 and s.postings_bytes > 0 and s.terms_bytes > 0 and s.chunks_bytes > 0
        assert s.vectors_bytes >= s.chunks * 384 * 4  # flat: the one float32 copy (FAISS scans it, no second)
        assert s.ann_bytes == 0
    want = {(str(s.shard), c): getattr(s, f"{c}_bytes") for s in st.shards
            for c in ("postings", "terms", "vectors", "ann", "chunks")}
    got: dict = {}
    for _ in range(50):  # the gauges refresh after each write, off the request path
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        got = {(m.group(2), m.group(1)): float(m.group(3)) for m in
               re.finditer(r'^oprag_shard_bytes{component="(\w+)",shard="(\d+)"} (\S+)$', body, re.M)}
        if got == want:
            break
        time.sleep(0.1)
    assert got == want
