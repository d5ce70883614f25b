"""OpenTelemetry traces of queries (service/tracing.py) with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from oprag_server.domain import RetrieveSpec  # noqa: E402
from oprag_server.engine.job import QueryJob  # noqa: E402
from oprag_server.engine.scheduler import PlanStep  # noqa: E402
from oprag_server.service.tracing import CARRIER, TraceInterceptor, Tracing  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _tracing():
    exp = InMemorySpanExporter()
    return Tracing(SimpleSpanProcessor(exp)), exp


async def _fake_submit(job: QueryJob) -> QueryJob:
    """Two steps of one batch: embed (waits 10 ms, runs 5 ms), retrieve (runs 20 ms)."""
    job.batch_id = 7
    t = job.enqueued
    job.record(PlanStep("embed", "embed-thread"), t + 0.015, 0.005)
    job.record(PlanStep("retrieve", "shards"), t + 0.035, 0.020)
    await asyncio.sleep(0)
    return job


def test_query_becomes_one_trace_under_the_remote_parent():
    tr, exp = _tracing()
    submit = tr.wrap(_fake_submit)

    async def go():
        CARRIER.set(("Query", {"traceparent": PARENT}))
        return await submit(QueryJob(question="q", spec=RetrieveSpec(), request_id="r1"))

    asyncio.run(go())
    tr.flush()
    spans = {s.name: s for s in exp.get_finished_spans()}
    assert set(spans) == {"oprag Query", "embed", "retrieve"}
    req = spans["oprag Query"]
    assert f"{req.context.trace_id:032x}" == TRACE_ID and f"{req.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert req.attributes["oprag.request_id"] == "r1" and req.attributes["oprag.mode"] == "hybrid"
    for name in ("embed", "retrieve"):
        s = spans[name]
        assert s.parent.span_id == req.context.span_id and s.context.trace_id == req.context.trace_id
        assert s.attributes["oprag.batch_id"] == 7 and s.attributes["oprag.op"] == name
    e, r = spans["embed"], spans["retrieve"]
    assert e.attributes["oprag.domain"] == "embed-thread" and e.attributes["oprag.queue_ms"] == pytest.approx(10, abs=0.01)
    assert (e.end_time - e.start_time) / 1e6 == pytest.approx(5, abs=0.01)
    assert (e.start_time - req.start_time) / 1e6 == pytest.approx(10, abs=0.01)
    assert r.start_time == pytest.approx(e.end_time, abs=1000) and r.attributes["oprag.run_ms"] == pytest.approx(20)


def test_failed_query_span_has_error_status_and_a_new_trace_without_parent():
    tr, exp = _tracing()

    async def boom(job):
        raise ValueError("no")

    async def go():
        with pytest.raises(ValueError):
            await tr.wrap(boom)(QueryJob(question="q", spec=RetrieveSpec()))

    asyncio.run(go())
    tr.flush()
    (s,) = exp.get_finished_spans()
    assert s.status.status_code == StatusCode.ERROR and s.parent is None and s.name == "oprag query"


def test_grpc_interceptor_hands_method_and_traceparent_to_the_handler():
    seen = []

    async def handler(request, context):
        seen.append(CARRIER.get())
        return "ok"

    class Details:
        method = "/oprag.v1.OpRAG/Retrieve"
        invocation_metadata = (("traceparent", PARENT), ("authorization", "Bearer x"))

    async def go():
        async def cont(details):
            return grpc.unary_unary_rpc_method_handler(handler)

        h = await TraceInterceptor("oprag.v1.OpRAG").intercept_service(cont, Details())
        return await asyncio.create_task(h.unary_unary(None, None))

    assert asyncio.run(go()) == "ok"
    assert seen == [("Retrieve", {"traceparent": PARENT})]


def test_off_imports_no_opentelemetry_sdk():
    # (recent FastAPI imports opentelemetry's API by itself when it is installed; OpRAG's tracing
    # module imports the SDK only when a Tracing is made, i.e. with --otlp-endpoint)
    code = ("import sys, oprag_server.app, oprag_server.service.http; "
            "print(any(m.startswith('opentelemetry.sdk') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def _guard_carrier(tracing: bool):
    """What the app behind :class:`Guard` sees in CARRIER for one request with a traceparent."""
    from oprag_server.service.http import Guard
    from oprag_server.service.metrics import Metrics

    seen = []

    async def app(scope, receive, send):
        seen.append(CARRIER.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        pass

    scope = {"type": "http", "path": "/v1/retrieve", "headers": [(b"traceparent", PARENT.encode())]}
    guard = Guard(app, tokens=set(), max_body=1024, metrics=Metrics(), tracing=tracing)
    asyncio.run(guard(scope, receive, send))
    return seen


def test_http_guard_hands_traceparent_only_when_tracing_is_on():
    # off: no per-request tracing work on HTTP either (the carrier is never made)
    assert _guard_carrier(False) == [None]
    assert _guard_carrier(True) == [("HTTP /v1/retrieve", {"traceparent": PARENT})]
