"""What the new-user trial of issue 14 found at a real server's doors (1 shard, no generator,
HTTP on). An ingest reply over the message limit: the stream committed, then gRPC failed the
reply on the way out (RESOURCE_EXHAUSTED "Sent message larger than max", a traceback in the
server log), so the client read a stored stream as failed. The reply now stays under the limit."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import requests

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration
LIMIT = 32 * 1024 * 1024  # the server's default message limit (LimitsConfig.max_message_bytes)
MAX_ID = 512  # LimitsConfig.max_doc_id_bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    http_port = free_port()
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("trial14") / "data", "--generator", "none",
                                      "--shards", "1", "--http-port", str(http_port))
    srv.start()
    srv.url = f"http://127.0.0.1:{http_port}/v1"
    with OpRAGClient(srv.target, timeout=120) as c:
        srv.client = c
        yield srv
    srv.stop()


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(384).astype(np.float32)


def test_long_rejected_ids_do_not_make_a_committed_streams_reply_unsendable(server):
    c = server.client
    docs = [Doc("echo-valid", chunks=[("a valid document beside forty huge ids", _vec(1))])]
    docs += [Doc(f"{i}" + "x" * 1_000_000, "an id of a megabyte") for i in range(40)]  # 40 MB of ids
    r = c.ingest(docs)  # was RESOURCE_EXHAUSTED, with echo-valid stored
    assert r.documents_written == 1 and len(r.rejected) == 40
    for n, rj in enumerate(r.rejected):
        assert rj.index == n + 1 and "longer than 512 bytes" in rj.reason
        assert rj.id.startswith(f"{n}xxx") and rj.id.endswith("\u2026") and len(rj.id.encode()) <= MAX_ID + 3
    assert [h.doc_id for h in c.retrieve("valid document beside", mode="lexical", top_k=1).hits] == ["echo-valid"]


def test_more_rejections_than_a_reply_holds_are_summed_up_in_a_last_entry(server):
    c = server.client
    n = 60_000  # 511-byte ids and empty texts: ~37 MB of rejections, over the 32 MiB limit
    docs = [Doc("summary-valid", chunks=[("the one valid document among sixty thousand", _vec(2))])]
    docs += [Doc(f"{i:06d}" + "y" * 505, " ") for i in range(n)]
    r = c.ingest(docs)
    assert r.documents_written == 1 and r.ByteSize() <= LIMIT
    listed, last = r.rejected[:-1], r.rejected[-1]
    assert 40_000 < len(listed) < n and all("text is empty" in x.reason for x in listed)
    assert [x.index for x in listed] == list(range(1, len(listed) + 1))
    assert last.index == len(listed) + 1 and last.id == ""
    assert f"this and {n - len(listed) - 1} more rejected documents after it are not listed" in last.reason
    assert c.stats().documents >= 2


def test_an_id_sent_twice_whose_last_version_is_rejected_keeps_the_earlier_one(server):
    """README (ingest semantics), as the trial found it: the last version that is not rejected counts."""
    c = server.client
    r = c.ingest([Doc("twice", chunks=[("good first version nebulaword", _vec(3))]), Doc("twice", " ")])
    assert r.documents_written == 1 and [(x.index, x.id) for x in r.rejected] == [(1, "twice")]
    hits = c.retrieve("nebulaword", mode="lexical", top_k=3, min_seq=r.seq).hits
    assert [(h.doc_id, h.text) for h in hits] == [("twice", "good first version nebulaword")]


def test_a_document_the_server_takes_is_not_refused_by_the_client(server):
    """trial50: the client's per-message budget was 90% of the 32 MiB limit less 1 KiB, so a 29-32 MB document the
    server stores was refused client-side, by a message quoting the 33,554,432-byte limit it was under. Now the budget
    is the limit less 64 KiB: a 31.5 MB document (20,000 chunks with vectors) is sent and stored whole; one over the
    budget is refused before anything is sent, by a message naming the budget."""
    from oprag_client.client import _as_pb, message_budget

    c = server.client
    rng = np.random.default_rng(50)
    vecs = rng.standard_normal((20_200, 384)).astype(np.float32)
    doc = Doc("big50", chunks=[(f"bulk chunk {i} quasarword", vecs[i]) for i in range(len(vecs))])
    n = _as_pb(doc).ByteSize()
    assert int(LIMIT * 0.9) - 1024 < n < message_budget(LIMIT) < LIMIT, n
    r = c.ingest([doc])
    assert r.documents_written == 1 and r.chunks_written == len(vecs) and not r.rejected
    over = Doc("over50", chunks=[(f"c{i}", vecs[i % len(vecs)]) for i in range(23_000)])
    assert _as_pb(over).ByteSize() > message_budget(LIMIT)
    with pytest.raises(ValueError, match=rf"'over50' is {_as_pb(over).ByteSize()} bytes \(\d+ in its message\), over the {message_budget(LIMIT)} bytes one ingest "
                                         rf"message can carry \(the {LIMIT}-byte gRPC message limit"):
        c.ingest([over])
    hits = c.retrieve("quasarword", mode="lexical", top_k=3, min_seq=r.seq).hits
    assert len(hits) == 3 and all(h.doc_id == "big50" for h in hits)


def test_the_asyncio_client_s_ingest_errors_say_what_the_sync_client_s_say(server):
    """trial50 #8: ``AsyncOpRAGClient.ingest`` raised the bare ``AioRpcError``, without the ``nothing_stored`` and
    ``final_message_sent`` the sync client sets (the server sends the same ``oprag-stored: none`` trailer to both).
    A document the client refuses is the same ``ValueError`` in both, and nothing of its stream is stored."""
    import asyncio

    from oprag_client.client import AsyncOpRAGClient

    bad = [Doc("fine8", chunks=[("fine", _vec(8))]), Doc("nan8", chunks=[("nan", np.full(384, np.nan, np.float32))])]
    with pytest.raises(grpc.RpcError) as sync_err:
        server.client.ingest(bad)
    too_big = [Doc("small8", "small"), Doc("big8", "x" * (LIMIT + 10))]

    async def run():
        async with AsyncOpRAGClient(server.target, timeout=60) as ac:
            with pytest.raises(grpc.RpcError) as err:
                await ac.ingest(bad)
            with pytest.raises(ValueError, match=r"'big8' is \d+ bytes \(\d+ in its message\), over the \d+ bytes one ingest message can carry"):
                await ac.ingest(too_big)
            return err.value

    aerr = asyncio.run(run())
    assert sync_err.value.code() == aerr.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sync_err.value.nothing_stored is True and aerr.nothing_stored is True
    assert sync_err.value.final_message_sent is True and aerr.final_message_sent is True
    stored = {h.doc_id for h in server.client.retrieve("fine small", mode="lexical", top_k=10).hits}
    assert not stored & {"fine8", "nan8", "small8", "big8"}, stored


def test_an_ingest_to_no_server_says_nothing_was_stored():
    """trial50b #5: with no server listening, both clients said ``nothing_stored`` False (the CLI already reported
    stored false): a connection never made stores nothing."""
    import asyncio

    from oprag_client.client import AsyncOpRAGClient

    target = f"127.0.0.1:{free_port()}"
    with OpRAGClient(target, timeout=20) as c, pytest.raises(grpc.RpcError) as sync_err:
        c.ingest([Doc("nobody", "no server here")])

    async def run():
        async with AsyncOpRAGClient(target, timeout=20) as ac:
            with pytest.raises(grpc.RpcError) as err:
                await ac.ingest([Doc("nobody", "no server here")])
            return err.value

    aerr = asyncio.run(run())
    for e in (sync_err.value, aerr):
        assert e.code() == grpc.StatusCode.UNAVAILABLE and e.nothing_stored is True, (e.code(), e.details())
