"""What the new-user trial of issue 15 found at a real server's doors.

A shard whose data directory filled up: the write that hit the full disk failed, and its partial
record stayed in the shard's write-ahead log; the writes acknowledged after space came back were
appended behind it, and a restart (which cuts a log at its first torn record) dropped them and
served without them, silently. The start now checks every shard against the commit log with a
local --data-dir too (as with --storage-uri): acknowledged writes are served, or the start is
refused naming the shard. The failed write's message said the shard was "being restarted"; it
now says that its data directory could not be written. The disk is made full with the shard
process's RLIMIT_FSIZE (EFBIG on a write past the limit; Python ignores SIGXFSZ), lowered and
raised again from outside with prlimit(2).
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import resource
import socket
import time

import grpc
import numpy as np
import pytest
import requests

from oprag_client.client import AsyncOpRAGClient, Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit(2) (Linux)")]


def _docs(prefix: str, n: int, words: int, seed: int) -> list[Doc]:
    vecs = np.random.default_rng(seed).standard_normal((n, 384)).astype(np.float32)
    return [Doc(f"{prefix}{i}", f"{prefix} marker{prefix}x{i} " + "padding " * words, vector=vecs[i])
            for i in range(n)]


def _shard_pid(srv: ServerProcess, shard: int = 0, replica: int | None = None) -> int:
    """The pid of the latest process of ``shard`` the server logged (``shard i: process pid P``;
    ``shard i replica r: process pid P`` with ``--replicas`` above 1): of its ``replica``, or of
    any replica (None)."""
    pids = [int(m.group(2)) for line in srv.lines
            if (m := re.search(rf"shard {shard}(?: replica (\d+))?: process pid (\d+)", line))
            and replica in (None, int(m.group(1) or 0))]
    assert pids, f"the server did not log the pid of shard {shard} (replica {replica})"
    return pids[-1]


def _health(srv: ServerProcess, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(srv.target) as ch:
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(st)


def _ingest_health(srv: ServerProcess) -> str:
    """The write path's health name (supervision.INGEST_HEALTH): NOT_SERVING while writes fail."""
    return _health(srv, "oprag.v1.OpRAG.Ingest")


def _present(c: OpRAGClient, doc_id: str, prefix: str) -> bool:
    hits = c.retrieve(f"marker{prefix}x{doc_id[len(prefix):]}", mode="lexical", top_k=1).hits
    return bool(hits) and hits[0].doc_id == doc_id


def test_writes_acknowledged_after_a_full_disk_are_served_after_a_restart(tmp_path):
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "1")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(_docs("before", 20, 20, 1))
            pid = _shard_pid(srv)
            wal = tmp_path / "data" / "shard-0" / "wal.log"
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (wal.stat().st_size + 64 * 1024, hard))  # the disk fills
            with pytest.raises(grpc.RpcError) as e:
                c.ingest(_docs("full", 200, 200, 2))  # ~400 KB of log record: cut short at 64 KB
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            msg = e.value.details()
            assert "could not write to its data directory" in msg and "being restarted" not in msg, msg
            assert _wait_for(lambda: _ingest_health(srv) == "NOT_SERVING", 10), _ingest_health(srv)
            assert _health(srv, "") == "SERVING"  # reads go on
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))  # space is back
            after = _docs("after", 10, 5, 3)
            c.ingest(after)  # acknowledged
            assert all(_present(c, d.id, "after") for d in after)
            assert _wait_for(lambda: _ingest_health(srv) == "SERVING", 10), _ingest_health(srv)
        srv.kill9()
        srv.start()  # the failed append was cut back (index/wal.py): nothing torn hides the later ones
        with OpRAGClient(srv.target, timeout=120) as c:
            lost = [d.id for d in after if not _present(c, d.id, "after")]
            assert not lost, f"acknowledged documents lost after the restart: {lost}"
            assert all(_present(c, f"before{i}", "before") for i in range(20))
            assert not any(_present(c, f"full{i}", "full") for i in (0, 99, 199))  # never acknowledged
    finally:
        srv.stop()


def test_a_start_whose_shard_log_lost_acknowledged_writes_is_refused_naming_the_shard(tmp_path):
    """The start's check of every shard against the commit log, with a local --data-dir: a shard
    log that lost its last acknowledged records (cut here by hand) refuses the start, naming the
    shard and the sequence numbers, instead of serving without them."""
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "1")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(_docs("one", 5, 5, 5))
            c.ingest(_docs("two", 5, 5, 6))
        srv.kill9()
        wal = tmp_path / "data" / "shard-0" / "wal.log"
        data = wal.read_bytes()
        wal.write_bytes(data[: len(data) - 40])  # the last record torn: the restart drops it
        with pytest.raises(RuntimeError) as info:
            srv.start()
        assert "recovered up to sequence" in str(info.value) and "commit log" in str(info.value), str(info.value)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def gen_server(tmp_path_factory):
    """1 shard, the builtin generator, HTTP on; a few documents."""
    http_port = free_port()
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("trial15") / "data", "--shards", "1",
                                      "--http-port", str(http_port))
    srv.start()
    srv.http_port = http_port
    with OpRAGClient(srv.target, timeout=120) as c:
        c.ingest(_docs("lobster", 3, 5, 4))
    yield srv
    srv.stop()


def _counts(metrics_port: int, method: str) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    pat = r'^oprag_requests_total\{code="(\w+)",method="' + re.escape(method) + r'"\} (\S+)$'
    return {code: float(n) for code, n in re.findall(pat, text, re.M) if float(n)}  # (known codes are exported as 0)


def _wait_for(fn, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := fn()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_a_streamed_chat_reply_the_client_left_is_counted_cancelled_not_ok(gen_server):
    """A client that closes the connection in the middle of ``stream: true`` stopped the
    generation, but the request was counted ``OK``; a cancelled gRPC QueryStream counts
    ``CANCELLED``, and so does this one now. A stream read to its end stays ``OK``."""
    srv, http_port = gen_server, gen_server.http_port
    chat = lambda: _counts(srv.metrics_port, "HTTP /v1/chat/completions")  # noqa: E731
    body = json.dumps({"model": "oprag", "stream": True, "max_tokens": 200,
                       "messages": [{"role": "user", "content": "Tell me everything about lobsters."}]}).encode()
    with socket.create_connection(("127.0.0.1", http_port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data:") < 3:  # the sources chunk and two pieces of text: generating
            piece = s.recv(65536)
            assert piece, got
            got += piece
    _wait_for(lambda: chat().get("CANCELLED"))
    assert chat() == {"CANCELLED": 1.0}
    r = requests.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", stream=True, timeout=120,
                      json={"model": "oprag", "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "lobster?"}]})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    _wait_for(lambda: chat().get("OK"))
    assert chat() == {"CANCELLED": 1.0, "OK": 1.0}


def test_an_async_query_stream_left_by_break_is_cancelled_on_the_server(gen_server):
    """``async for`` over ``AsyncOpRAGClient.query_stream`` left by ``break``: the server went
    on generating every token for nobody (counted OK at the end), since grpc.aio's iterator and
    call form a cycle only a garbage collection frees; the sync client's iterator cancelled at
    once. The async one now cancels too (garbage collection off here: the fix must not need it)."""
    streams = lambda: _counts(gen_server.metrics_port, "QueryStream")  # noqa: E731
    before = streams()

    async def leave_early() -> None:
        async with AsyncOpRAGClient(gen_server.target, timeout=120) as c:
            async for ev in c.query_stream("Tell me everything about lobsters.", max_new_tokens=400):
                if ev.WhichOneof("event") == "text":
                    break
            got = await asyncio.to_thread(_wait_for, lambda: streams() != before, 20.0)
            assert got and streams().get("CANCELLED", 0) == before.get("CANCELLED", 0) + 1, (before, streams())
            call = c.query_stream("lobster?", max_new_tokens=2)  # read to the end: the call's methods still work
            kinds = [ev.WhichOneof("event") async for ev in call]
            assert kinds[0] == "sources" and kinds[-1] == "done" and await call.code() == grpc.StatusCode.OK

    gc.disable()
    try:
        asyncio.run(leave_early())
    finally:
        gc.enable()


def test_a_held_sync_query_stream_left_by_break_or_closed_is_cancelled_on_the_server(gen_server):
    """trial26 #1: ``OpRAGClient.query_stream`` returned grpc's call, which cancels only when a
    garbage collection frees it; a loop left by ``break`` while the caller still held the call
    (``it = c.query_stream(...)``; ``for i, ev in enumerate(it)``) went on generating all 512
    tokens on the server, and the next query waited ~80 s. The call the client returns now
    cancels when the loop ends, on ``close()`` and at the end of a ``with`` block (garbage
    collection off here: the fix must not need it)."""
    streams = lambda: _counts(gen_server.metrics_port, "QueryStream")  # noqa: E731

    def cancelled_after(leave) -> None:
        before = streams()
        held = leave()  # the call stays referenced until the check is done
        got = _wait_for(lambda: streams().get("CANCELLED", 0) > before.get("CANCELLED", 0), 20.0)
        assert got and streams().get("CANCELLED", 0) == before.get("CANCELLED", 0) + 1, (before, streams(), held)

    gc.disable()
    try:
        with OpRAGClient(gen_server.target, timeout=120) as c:
            def by_break():
                it = c.query_stream("Tell me everything about lobsters.", max_new_tokens=400)
                for i, _ev in enumerate(it):
                    if i == 2:
                        break
                return it
            cancelled_after(by_break)

            def by_close():
                it = c.query_stream("Tell me everything about lobsters.", max_new_tokens=400)
                assert next(it).WhichOneof("event") == "sources" and next(it).WhichOneof("event") == "text"
                it.close()
                return it
            cancelled_after(by_close)

            def by_with():
                with c.query_stream("Tell me everything about lobsters.", max_new_tokens=400) as it:
                    assert next(it).WhichOneof("event") == "sources" and next(it).WhichOneof("event") == "text"
                return it
            cancelled_after(by_with)

            call = c.query_stream("lobster?", max_new_tokens=2)  # read to the end: not cancelled, methods work
            kinds = [ev.WhichOneof("event") for ev in call]
            call.close()  # after the end: nothing to cancel
            assert kinds[0] == "sources" and kinds[-1] == "done" and call.code() == grpc.StatusCode.OK
    finally:
        gc.enable()
