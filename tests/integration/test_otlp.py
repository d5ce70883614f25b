"""OTLP export end to end: a real server with ``--otlp-endpoint`` pointing at an OTLP/gRPC
receiver in this test (:class:`oprag_client.testing.OtlpSink`, opentelemetry-proto's
TraceService on a grpc server). One Retrieve with a W3C ``traceparent`` in its gRPC metadata (and
one ``POST /v1/retrieve`` with the header) must arrive as one trace under that parent: the request
span and one child span per executed plan step, the steps the response's own trace reports."""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
                    reason="the OTLP receiver needs opentelemetry-proto (pip install 'oprag[otel]')")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                    reason="--otlp-endpoint needs the 'otel' extra (pip install 'oprag[otel]')")

from oprag.v1 import oprag_pb2  # noqa: E402
from oprag_client.client import Doc, OpRAGClient  # noqa: E402
from oprag_client.testing import OtlpSink, ServerProcess, free_port, wait_until  # noqa: E402

pytestmark = pytest.mark.integration
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def sink():
    with OtlpSink() as s:
        yield s


@pytest.fixture(scope="module")
def server(tmp_path_factory, sink):
    http_port = free_port()
    # the SDK's BatchSpanProcessor reads its export interval from the environment (default 5 s)
    srv = ServerProcess(tmp_path_factory.mktemp("otlp"), free_port(), free_port(), "--generator", "none",
                        "--otlp-endpoint", sink.endpoint, "--http-port", str(http_port),
                        env={"OTEL_BSP_SCHEDULE_DELAY": "100"}).start()
    srv.http_port = http_port
    with OpRAGClient(srv.target, timeout=60) as c:
        c.ingest([Doc(f"d{i}", f"Document {i} about lighthouses, granite and the sea.") for i in range(4)])
        srv.client = c
        yield srv
    srv.stop()


def _trace(sink: OtlpSink, trace_id: str, want: int) -> list:
    def spans():
        return [s for s in sink.spans() if s.trace_id.hex() == trace_id]

    assert wait_until(lambda: len(spans()) >= want, timeout=20), f"got {len(spans())} spans of {trace_id}"
    return spans()


def _check(spans: list, name: str, parent_span: str, steps: list[str]) -> None:
    (req,) = [s for s in spans if s.name == name]
    assert req.parent_span_id.hex() == parent_span
    children = [s for s in spans if s.parent_span_id == req.span_id]
    assert [c.name for c in sorted(children, key=lambda s: s.start_time_unix_nano)] == steps
    assert len(spans) == 1 + len(steps)
    for c in children:
        attrs = {a.key for a in c.attributes}
        assert {"oprag.op", "oprag.domain", "oprag.batch_id", "oprag.queue_ms", "oprag.run_ms"} <= attrs
        assert req.start_time_unix_nano <= c.start_time_unix_nano <= c.end_time_unix_nano <= req.end_time_unix_nano


def test_grpc_retrieve_exports_one_trace_under_the_metadata_parent(server, sink):
    parent = "00f067aa0ba902b7"
    r = server.client.stub.Retrieve(oprag_pb2.QueryRequest(question="granite lighthouse", include_trace=True),
                                    metadata=[("traceparent", f"00-{TRACE_ID}-{parent}-01")], timeout=60)
    steps = [s.op for s in r.trace.stages]
    assert steps and r.hits
    _check(_trace(sink, TRACE_ID, 1 + len(steps)), "oprag Retrieve", parent, steps)


def test_http_retrieve_exports_one_trace_under_the_traceparent_header(server, sink):
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/retrieve", timeout=60,
                      json={"query": "granite lighthouse", "include_trace": True},
                      headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert r.status_code == 200, r.text
    steps = [s["op"] for s in r.json()["trace"]]
    assert steps
    _check(_trace(sink, trace_id, 1 + len(steps)), "oprag HTTP /v1/retrieve", parent, steps)
