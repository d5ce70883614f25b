"""A client that leaves a non-streamed chat completion (an SDK timeout, a closed tab) cancels its
query, as a cancelled gRPC call does (trial14: the server generated every token for nobody and
counted the request OK; gRPC stopped after a few tokens and counted it CANCELLED). No server:
the app over a stand-in runtime whose query takes 3 s unless cancelled."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from oprag_server.index.bm25 import CorpusStats
from oprag_server.config import ServerConfig
from oprag_server.service.http import Guard, build_app
from oprag_server.service.metrics import Metrics


def _chat(disconnect_after: float | None) -> tuple[int, float, list[str], Metrics]:
    events: list[str] = []

    async def submit(job):
        events.append("started")
        try:
            await asyncio.sleep(3)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        job.answer = "done"
        return job

    rt = SimpleNamespace(cfg=ServerConfig(), encoder=SimpleNamespace(name="enc", dim=4), generator=None,
                         corpus_stats=CorpusStats(),
                         query=SimpleNamespace(submit=submit))
    metrics = Metrics()
    guard = Guard(build_app(rt), tokens=set(), max_body=1 << 20, metrics=metrics)
    body = json.dumps({"model": "oprag", "messages": [{"role": "user", "content": "kites"}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    out, sent = [], [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_after is None:
            await asyncio.sleep(3600)  # uvicorn: the disconnect comes when the client leaves
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(msg):
        out.append(msg)

    t0 = time.perf_counter()
    asyncio.run(guard(scope, receive, send))
    status = next(m["status"] for m in out if m["type"] == "http.response.start")
    return status, time.perf_counter() - t0, events, metrics


def _count(metrics: Metrics, code: str) -> float:
    return metrics.requests.labels(method="HTTP /v1/chat/completions", code=code)._value.get()


def test_a_client_that_leaves_cancels_its_query_and_is_counted_cancelled():
    status, took, events, metrics = _chat(disconnect_after=0.2)
    assert events == ["started", "cancelled"] and took < 2.0, (events, took)
    assert status == 499 and _count(metrics, "CANCELLED") == 1 and _count(metrics, "OK") == 0


def test_a_client_that_stays_gets_the_answer():
    status, took, events, metrics = _chat(disconnect_after=None)
    assert events == ["started"] and status == 200 and took >= 3.0
    assert _count(metrics, "OK") == 1
