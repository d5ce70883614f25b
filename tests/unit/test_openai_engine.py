"""The openai backend and the engine dispatcher against a tiny in-test OpenAI-compatible server
(an ASGI app under uvicorn on loopback). The real engine is tested in
tests/integration/test_engine.py; this covers the error paths a real engine rarely shows."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types

import pytest
import uvicorn

from oprag_server.engine.dispatch import EngineDispatch
from oprag_server.models.openai_engine import OpenAIGenerator
from oprag_server.models.protocols import EngineGenerator, EngineRejected, EngineTimeout, EngineUnavailable, EngineUsage
from oprag_server.service.metrics import Metrics


class FakeEngine:
    """Streams ``words`` one chunk per ``step_s``; ``mode`` picks a failure."""

    def __init__(self) -> None:
        self.words = ["Paris", " is", " the", " capital", "."]
        self.step_s, self.mode, self.fail_first = 0.01, "ok", 0
        self.requests, self.running, self.max_running, self.disconnects = 0, 0, 0, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.requests += 1
        if self.fail_first > 0 or self.mode in ("503", "400"):
            self.fail_first -= 1
            code = 400 if self.mode == "400" else 503
            await send({"type": "http.response.start", "status": code,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"3")]})
            await send({"type": "http.response.body", "body": json.dumps({"error": {"message": "busy"}}).encode()})
            return
        req = json.loads(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        gone = asyncio.ensure_future(receive())  # resolves to http.disconnect when the client closes
        try:
            words = self.words[: req["max_tokens"]]
            for i, w in enumerate(words):
                if gone.done():
                    self.disconnects += 1
                    return
                if self.mode == "break" and i == 2:
                    raise RuntimeError("engine died")  # uvicorn drops the connection mid-stream
                chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": req["model"],
                         "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                            "more_body": True})
                await asyncio.sleep(self.step_s)
            last = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": req["model"],
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 11, "completion_tokens": len(words), "total_tokens": 11 + len(words),
                              "prompt_tokens_details": {"cached_tokens": 7}}}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode()})
        finally:
            gone.cancel()
            self.running -= 1


@pytest.fixture(scope="module")
def fake():
    app = FakeEngine()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    app.url = f"http://127.0.0.1:{port}/v1"
    yield app
    server.should_exit = True
    t.join(5)


@pytest.fixture(autouse=True)
def reset(fake):
    end = time.time() + 10
    while fake.running and time.time() < end:  # streams an earlier test abandoned end at their next step
        time.sleep(0.05)
    fake.step_s, fake.mode, fake.fail_first = 0.01, "ok", 0
    fake.requests = fake.max_running = fake.disconnects = 0


def gen(fake, **kw) -> OpenAIGenerator:
    return OpenAIGenerator(fake.url, "m", **kw)


async def collect(g, usage, n=5) -> str:
    try:
        return "".join([d async for d in g.stream(g.chat_messages("sys", "q"), n, usage)])
    finally:
        await g.aclose()


def test_streams_text_and_reports_usage_with_cached_tokens(fake):
    u = EngineUsage()
    g = gen(fake)
    assert isinstance(g, EngineGenerator)
    assert asyncio.run(collect(g, u, 3)) == "Paris is the"
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.finish_reason, u.attempts) == (11, 3, 7, "length", 1)


def test_overload_before_the_first_token_is_retried(fake):
    fake.fail_first = 1
    u = EngineUsage()
    assert asyncio.run(collect(gen(fake), u)) == "Paris is the capital."
    assert u.attempts == 2 and fake.requests == 2


def test_engine_down_or_overloaded_is_unavailable_with_retry_after(fake):
    fake.mode = "503"
    with pytest.raises(EngineUnavailable) as ei:
        asyncio.run(collect(gen(fake, retries=1), EngineUsage()))
    assert ei.value.retry_after_s == 3.0 and fake.requests == 2
    g = OpenAIGenerator("http://127.0.0.1:9/v1", "m", retries=0)  # nothing listens on port 9
    with pytest.raises(EngineUnavailable):
        asyncio.run(collect(g, EngineUsage()))
    assert not g.healthy


def test_broken_stream_after_the_first_token_is_not_retried(fake):
    fake.mode = "break"
    u = EngineUsage()
    with pytest.raises(EngineUnavailable):
        asyncio.run(collect(gen(fake), u))
    assert u.attempts == 1 and fake.requests == 1


def test_refused_request_and_timeout(fake):
    fake.mode = "400"
    with pytest.raises(EngineRejected):
        asyncio.run(collect(gen(fake), EngineUsage()))
    fake.mode, fake.step_s = "ok", 0.5
    with pytest.raises(EngineTimeout):
        asyncio.run(collect(gen(fake, timeout_s=0.3), EngineUsage()))


def test_estimated_token_counts_over_count_with_a_margin():
    g = OpenAIGenerator("http://127.0.0.1:9/v1", "m")
    text = "The quick brown fox jumps over the lazy dog. " * 20  # 900 bytes, ~200 GPT-2 tokens
    assert g.count_tokens(text) == 900 // 3 + 8
    cut = g.truncate_to_tokens(text, 50)
    assert text.startswith(cut) and g.count_tokens(cut) <= 50 and len(cut) > 100


def _job(n: int = 5):
    return types.SimpleNamespace(payload=types.SimpleNamespace(messages=[{"role": "user", "content": "q"}]),
                                 max_new_tokens=n, answer="", completion_tokens=0, finish_reason="")


def test_dispatch_bounds_inflight_and_cancel_closes_the_stream(fake):
    fake.step_s = 0.2

    async def main():
        g = gen(fake, max_inflight=2)
        m = Metrics()
        d = EngineDispatch(g, m, lambda job, delta: None)
        jobs = [_job() for _ in range(4)]
        done = []

        async def run(j):
            await d.generate(j)
            done.append(j)

        for j in jobs:
            d.spawn(j, run)
        for _ in range(200):  # until both slots stream (the machine may be slow)
            if fake.running == 2:
                break
            await asyncio.sleep(0.02)
        assert d.in_engine == 2 and d.waiting == 2 and d.estimated_delay_s(0) > 0
        assert fake.max_running == 2  # the engine never saw more than max_inflight
        d.cancel(jobs[0])
        for _ in range(500):
            if len(done) == 3:
                break
            await asyncio.sleep(0.02)
        await d.stop()
        return m, jobs, done

    m, jobs, done = asyncio.run(main())
    assert fake.disconnects == 1  # the engine saw the cancelled stream close
    assert jobs[0] not in done and all(j.answer == "Paris is the capital." for j in jobs[1:])
    release = m.engine_cancel_release_seconds
    assert release._sum.get() < 0.1 and sum(b.get() for b in release._buckets) == 1
