"""OpenTelemetry traces of queries (``--otlp-endpoint``; the optional extra ``otel``).

Each query becomes one trace: a request span ``oprag <method>`` (admission to answer) with one
child span per executed plan step (:meth:`QueryJob.trace`), whose attributes are
``oprag.op``, ``oprag.domain``, ``oprag.batch_id``, ``oprag.queue_ms`` and ``oprag.run_ms``. A
step span starts after its queue wait and lasts its run time (batch-wide). The parent context
comes from W3C ``traceparent``/``tracestate``: gRPC metadata (:class:`TraceInterceptor`) or HTTP
headers (:class:`~oprag_server.service.http.Guard`), handed down in :data:`CARRIER`.

Spans are made after the query finished, from its recorded steps, on a thread of their own, so
tracing adds no work between operators nor between a query's end and its response. When tracing is off nothing here is instantiated: no interceptor, no
wrapper, :data:`CARRIER` is never set, and ``opentelemetry`` is not even imported.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Mapping

import grpc

from ..engine.job import QueryJob

#: ``(method, {"traceparent": ..., "tracestate": ...})`` of the request being served; set by the
#: gRPC interceptor and the HTTP guard only when tracing is on.
CARRIER: contextvars.ContextVar[tuple[str, dict[str, str]] | None] = contextvars.ContextVar("oprag_trace_carrier",
                                                                                           default=None)
TRACE_HEADERS = ("traceparent", "tracestate")


def carrier_of(pairs: Any) -> dict[str, str]:
    """The W3C trace headers among ``(key, value)`` pairs (gRPC metadata or ASGI headers, str or
    bytes, any case)."""
    out = {}
    for k, v in pairs or ():
        k = (k.decode("latin-1") if isinstance(k, bytes) else k).lower()
        if k in TRACE_HEADERS:
            out[k] = v.decode("latin-1") if isinstance(v, bytes) else v
    return out


class Tracing:
    """A tracer provider of its own (the global one is left alone) exporting through
    ``processor`` (an OpenTelemetry ``SpanProcessor``)."""

    def __init__(self, processor: Any, service_name: str = "oprag") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("oprag_server")
        self.propagator = TraceContextTextMapPropagator()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="oprag-trace")

    @classmethod
    def otlp(cls, endpoint: str) -> "Tracing":
        """Batched export over OTLP/gRPC to ``endpoint`` (e.g. ``http://127.0.0.1:4317``).

        :raises RuntimeError: the ``otel`` extra is not installed.
        """
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError("--otlp-endpoint needs the 'otel' extra: pip install 'oprag[otel]'") from exc
        return cls(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))))

    def wrap(self, submit: Callable[[QueryJob], Awaitable[QueryJob]]) -> Callable[[QueryJob], Awaitable[QueryJob]]:
        """``QueryEngine.submit`` that exports the finished (or failed) query as a trace."""

        async def traced(job: QueryJob) -> QueryJob:
            carrier = CARRIER.get()
            try:
                out = await submit(job)
            except BaseException as exc:
                self._later(job, error=exc, carrier=carrier)
                raise
            self._later(out, carrier=carrier)
            return out

        return traced

    def _later(self, job: QueryJob, **kw: Any) -> None:
        # span building (~0.1 ms for 3 spans, bench/tracing.py) runs on the exporter's own thread,
        # not between the finished query and its response
        self._pool.submit(self.export, job, **kw)

    def flush(self) -> None:
        """Wait until every finished query so far is exported (made into spans and sent)."""
        self._pool.submit(lambda: None).result()
        self.provider.force_flush()

    def export(self, job: QueryJob, *, error: BaseException | None = None,
               carrier: tuple[str, Mapping[str, str]] | None = None) -> None:
        """Make the spans of ``job`` (see the module docstring); the parent context and method
        come from ``carrier`` or else :data:`CARRIER`."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        method, headers = carrier or CARRIER.get() or ("query", {})
        now_ns, now_perf = time.time_ns(), time.perf_counter()

        def wall(perf_s: float) -> int:  # perf_counter seconds -> epoch ns
            return now_ns - int((now_perf - perf_s) * 1e9)

        span = self.tracer.start_span(f"oprag {method}", context=self.propagator.extract(dict(headers)),
                                      start_time=wall(job.enqueued), attributes={
                                          "oprag.request_id": job.request_id, "oprag.mode": job.spec.mode,
                                          "oprag.top_k": job.spec.top_k, "oprag.generate": job.generate,
                                          "oprag.completion_tokens": job.completion_tokens})
        ctx, prev = set_span_in_context(span), job.enqueued
        for st in job.stages:
            start = prev + st.queue_ms / 1000
            s = self.tracer.start_span(st.op, context=ctx, start_time=wall(start), attributes={
                "oprag.op": st.op, "oprag.domain": st.domain, "oprag.batch_id": st.batch_id,
                "oprag.queue_ms": st.queue_ms, "oprag.run_ms": st.run_ms})
            prev = start + st.run_ms / 1000
            s.end(end_time=wall(prev))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end(end_time=now_ns)

    def shutdown(self) -> None:
        """Export what is pending, then stop (the spans of every finished query are sent)."""
        self._pool.shutdown(wait=True)
        self.provider.shutdown()


class TraceInterceptor(grpc.aio.ServerInterceptor):
    """Hands each unary-request RPC of ``service`` its method name and trace headers through
    :data:`CARRIER` (installed only when tracing is on)."""

    def __init__(self, service: str) -> None:
        self.prefix = f"/{service}/"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        carrier = (details.method[len(self.prefix):], carrier_of(details.invocation_metadata))
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            fn = handler.unary_unary

            async def unary(request, context):
                CARRIER.set(carrier)
                return await fn(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if handler.unary_stream:
            gen = handler.unary_stream

            async def stream(request, context):
                CARRIER.set(carrier)
                async for item in gen(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, **kw)
        return handler
