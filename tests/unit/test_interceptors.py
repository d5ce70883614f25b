"""StatusInterceptor: exception -> gRPC status + details + trailers, per-RPC metrics, for unary
and streaming handlers; other services pass through. No server: fake contexts and handlers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from oprag_server.engine.ingest import IngestError
from oprag_server.engine.query import Overloaded, QueryRejected
from oprag_server.service.convert import InvalidArgument
from oprag.v1 import oprag_pb2
from oprag_server.service.interceptors import StatusInterceptor, Undecodable, lenient, status_for
from oprag_server.service.metrics import Metrics
from oprag_server.shards.pool import ShardError

SVC = "oprag.v1.OpRAG"


@pytest.mark.parametrize("exc,code,msg,trailers", [
    (InvalidArgument("bad top_k"), grpc.StatusCode.INVALID_ARGUMENT, "bad top_k", ()),
    (IngestError("bad doc"), grpc.StatusCode.INVALID_ARGUMENT, "bad doc", ()),
    (QueryRejected("too long"), grpc.StatusCode.INVALID_ARGUMENT, "too long", ()),
    (Overloaded("query", 0.25), grpc.StatusCode.RESOURCE_EXHAUSTED, "the query queue is full; retry after 0.25 s",
     (("retry-after-ms", "250"),)),
    (ShardError("shard 1 died"), grpc.StatusCode.UNAVAILABLE,
     "a shard is unavailable (it is being restarted); retry: shard 1 died", ()),
    (KeyError("x"), grpc.StatusCode.INTERNAL, "internal error: KeyError: 'x'", ()),
])
def test_status_for(exc, code, msg, trailers):
    assert status_for(exc, "Query") == (code, msg, trailers)


class Aborted(Exception):
    pass


class Context:
    def __init__(self):
        self.trailers, self.aborted = (), None

    def set_trailing_metadata(self, t):
        self.trailers = t

    async def abort(self, code, msg):
        self.aborted = (code, msg)
        raise Aborted


class Details:
    def __init__(self, method):
        self.method, self.invocation_metadata = method, ()


def wrap(handler, method):
    ic = StatusInterceptor(Metrics(), SVC)

    async def continuation(details):
        return handler

    return ic, asyncio.run(ic.intercept_service(continuation, Details(method)))


def count(ic, method, code):
    return ic.metrics.requests.labels(method=method, code=code)._value.get()


def test_unary_ok_and_error_are_counted_and_mapped():
    async def ok(req, ctx):
        return req + 1

    ic, h = wrap(grpc.unary_unary_rpc_method_handler(ok), f"/{SVC}/Stats")
    assert asyncio.run(h.unary_unary(1, Context())) == 2
    assert count(ic, "Stats", "OK") == 1

    async def overloaded(req, ctx):
        raise Overloaded("query", 1.5)

    ic, h = wrap(grpc.unary_unary_rpc_method_handler(overloaded), f"/{SVC}/Query")
    ctx = Context()
    with pytest.raises(Aborted):
        asyncio.run(h.unary_unary(None, ctx))
    assert ctx.aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and ctx.trailers == (("retry-after-ms", "1500"),)
    assert count(ic, "Query", "RESOURCE_EXHAUSTED") == 1


def test_a_stream_that_failed_before_its_commit_says_nothing_was_stored():
    """trial48 #18: an Ingest refused (a shard down) after its final message, before the commit began: the status
    carries the trailer ``oprag-stored: none`` (abort_stream marks the error), so the client knows nothing was
    stored; an error without the mark (e.g. one during the commit) carries none."""
    from oprag_server.shards.transport import ShardError

    for marked in (True, False):
        async def refused(req, ctx):
            exc = ShardError("shard 1 is not running")
            if marked:
                exc.nothing_stored = True
            raise exc

        ic, h = wrap(grpc.stream_unary_rpc_method_handler(refused), f"/{SVC}/Ingest")
        ctx = Context()
        with pytest.raises(Aborted):
            asyncio.run(h.stream_unary(iter(()), ctx))
        assert ctx.aborted[0] == grpc.StatusCode.UNAVAILABLE
        assert (("oprag-stored", "none") in ctx.trailers) is marked


def test_streaming_handler_error_after_items():
    async def gen(req, ctx):
        yield "a"
        raise InvalidArgument("no")

    ic, h = wrap(grpc.unary_stream_rpc_method_handler(gen), f"/{SVC}/QueryStream")
    ctx, got = Context(), []

    async def consume():
        async for x in h.unary_stream(None, ctx):
            got.append(x)

    with pytest.raises(Aborted):
        asyncio.run(consume())
    assert got == ["a"] and ctx.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "no")
    assert count(ic, "QueryStream", "INVALID_ARGUMENT") == 1


def test_stream_unary_cancelled_is_counted_as_cancelled():
    async def ingest(it, ctx):
        raise asyncio.CancelledError

    ic, h = wrap(grpc.stream_unary_rpc_method_handler(ingest), f"/{SVC}/Ingest")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(h.stream_unary(iter(()), Context()))
    assert count(ic, "Ingest", "CANCELLED") == 1


@pytest.mark.parametrize("remaining,code", [
    (None, "CANCELLED"),  # no deadline: the client cancelled
    (30.0, "CANCELLED"),  # far from its deadline: the client cancelled
    (0.0, "DEADLINE_EXCEEDED"),
    (0.012, "DEADLINE_EXCEEDED"),  # the client's timer fired first (it started when the call was sent)
])
def test_a_stream_cancelled_at_its_deadline_is_counted_deadline_exceeded(remaining, code):
    """Issue 17 trial: 59 of 101 ingest streams whose deadline passed were counted CANCELLED: the
    client's cancellation arrived 0.5-53 ms before the server's own deadline."""
    async def ingest(it, ctx):
        raise asyncio.CancelledError

    class Timed(Context):
        def time_remaining(self):
            return remaining

    ic, h = wrap(grpc.stream_unary_rpc_method_handler(ingest), f"/{SVC}/Ingest")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(h.stream_unary(iter(()), Timed()))
    assert count(ic, "Ingest", code) == 1


def test_other_services_pass_through():
    handler = grpc.unary_unary_rpc_method_handler(lambda r, c: r)
    _, h = wrap(handler, "/grpc.health.v1.Health/Check")
    assert h is handler


BAD = bytes.fromhex("0a 04 63 61 66 e9")  # QueryRequest.question = b"caf\xe9": not UTF-8


def test_lenient_deserializer_returns_undecodable():
    dec = lenient(oprag_pb2.QueryRequest.FromString)
    assert dec(oprag_pb2.QueryRequest(question="café").SerializeToString()).question == "café"
    assert isinstance(dec(BAD), Undecodable) and lenient(None) is None


def test_undecodable_requests_are_invalid_argument_and_counted():
    seen = []

    async def retrieve(req, ctx):
        seen.append(req)

    ic, h = wrap(grpc.unary_unary_rpc_method_handler(retrieve, oprag_pb2.QueryRequest.FromString), f"/{SVC}/Retrieve")
    ctx = Context()
    with pytest.raises(Aborted):
        asyncio.run(h.unary_unary(h.request_deserializer(BAD), ctx))
    assert seen == [] and ctx.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in ctx.aborted[1]
    assert count(ic, "Retrieve", "INVALID_ARGUMENT") == 1

    async def ingest(requests, ctx):  # a request stream fails when it reaches the bad message
        async for r in requests:
            seen.append(r)

    ic, h = wrap(grpc.stream_unary_rpc_method_handler(ingest, oprag_pb2.IngestRequest.FromString), f"/{SVC}/Ingest")

    async def stream():
        yield h.request_deserializer(oprag_pb2.IngestRequest(final=True).SerializeToString())
        yield h.request_deserializer(BAD)

    ctx = Context()
    with pytest.raises(Aborted):
        asyncio.run(h.stream_unary(stream(), ctx))
    assert len(seen) == 1 and ctx.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert count(ic, "Ingest", "INVALID_ARGUMENT") == 1


def test_a_handler_is_wrapped_once_per_method_and_again_when_it_changes():
    async def ok(req, ctx):
        return req

    h1, h2 = grpc.unary_unary_rpc_method_handler(ok), grpc.unary_unary_rpc_method_handler(ok)
    ic = StatusInterceptor(Metrics(), SVC)
    current = {"h": h1}

    async def continuation(details):
        return current["h"]

    async def go():
        a = await ic.intercept_service(continuation, Details(f"/{SVC}/Retrieve"))
        b = await ic.intercept_service(continuation, Details(f"/{SVC}/Retrieve"))
        c = await ic.intercept_service(continuation, Details(f"/{SVC}/Query"))
        current["h"] = h2
        d = await ic.intercept_service(continuation, Details(f"/{SVC}/Retrieve"))
        return a, b, c, d, await a.unary_unary("x", Context()), await d.unary_unary("y", Context())

    a, b, c, d, ra, rd = asyncio.run(go())
    assert a is b and c is not a and d is not a and (ra, rd) == ("x", "y")
    assert count(ic, "Retrieve", "OK") == 2 and count(ic, "Query", "OK") == 0
