"""One grpc.aio server interceptor for every OpRAG RPC: maps exceptions to gRPC statuses and
records per-RPC metrics (``oprag_requests_total{method,code}``, ``oprag_request_seconds{method}``).

Covers unary and streaming handlers alike; methods of other services (health, reflection) pass
through uncounted, and untouched but for the health service's undecodable requests (below).

Undecodable requests: grpc deserialises a request before the handler runs, and a deserializer
that raises ends the call with ``UNKNOWN`` (unary request) or, for a request stream, fails
inside the handler as an ordinary error. So the wrapped handlers get a deserializer that never
raises: a message that does not parse (for example a string field that is not valid UTF-8)
becomes an :class:`Undecodable` value, and the wrapped handler raises
:class:`~oprag_server.service.convert.InvalidArgument` for it, where it is answered
``INVALID_ARGUMENT`` and counted like any other failure. In a request stream it is raised when
the handler reaches that message, so an Ingest stream aborts and stores nothing. The standard
health service (``grpc.health.v1.Health``: Check, Watch) gets the same deserializer, and an
undecodable request is answered ``INVALID_ARGUMENT`` there too (it was grpc's ``UNKNOWN``), not
counted in the metrics.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from ..index.disk_errors import disk_error
from ..engine.ingest import IngestError
from ..engine.ingest_slots import IngestIdle
from ..engine.query import Overloaded, QueryRejected
from ..models.protocols import EngineRejected, EngineTimeout, EngineUnavailable
from ..shards.pool import ShardError
from ..shards.transport import StorageUnavailable
from .convert import InvalidArgument
from .metrics import GRPC_CODES

log = logging.getLogger(__name__)


#: the trailer of a failed Ingest stream that stored nothing (the commit never began), whatever its status: a client
#: that lost sight of the stream after its final message (UNAVAILABLE) otherwise cannot know (trial48 #18)
STORED_NONE = ("oprag-stored", "none")


def status_for(exc: Exception, method: str) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """gRPC status code, details message and trailing metadata for an exception a handler raised.

    ``InvalidArgument``, ``IngestError``, ``QueryRejected`` -> INVALID_ARGUMENT;
    ``Overloaded`` (also ``IngestBusy``: no ingest slot) -> RESOURCE_EXHAUSTED with trailer ``retry-after-ms``
    (integer milliseconds); ``IngestIdle`` (the client sent nothing for ``--ingest-idle-s``) -> ABORTED;
    ``ShardError`` -> UNAVAILABLE (``StorageUnavailable``: its own message); ``EngineUnavailable`` (inference engine down or overloaded) ->
    UNAVAILABLE with ``retry-after-ms``; ``EngineTimeout`` -> DEADLINE_EXCEEDED;
    ``EngineRejected`` -> INVALID_ARGUMENT; anything else -> INTERNAL (logged with its traceback).
    """
    if isinstance(exc, (InvalidArgument, IngestError, QueryRejected, EngineRejected)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("retry-after-ms", str(int(exc.retry_after_s * 1000))),)
    if isinstance(exc, IngestIdle):
        return grpc.StatusCode.ABORTED, str(exc), ()
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc), (("retry-after-ms", str(int(exc.retry_after_s * 1000))),)
    if isinstance(exc, EngineTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), ()
    if isinstance(exc, StorageUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc), ()
    if isinstance(exc, ShardError):
        return grpc.StatusCode.UNAVAILABLE, shard_error_message(exc), ()
    if isinstance(exc, OSError) and (why := disk_error(exc)) is not None:  # the frontend's own commit log (trial56b)
        return (grpc.StatusCode.UNAVAILABLE, f"the server could not write its commit log to the data directory ({why}): "
                f"{exc}; the write was not acknowledged: free space on the --data-dir volume (or repair it), then retry",
                ())
    log.exception("%s failed", method)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ()


def shard_error_message(exc: ShardError) -> str:
    """The UNAVAILABLE message for a :class:`ShardError`: a shard that could not write to its data
    directory (disk full, quota, read-only, I/O error; the shard answered) says so and what to do;
    anything else is a shard that is down or being restarted."""
    why = disk_error(exc)
    if why is not None:
        return (f"a shard could not write to its data directory ({why}): {exc}; the write was not acknowledged: "
                "free space on the --data-dir volume (or repair it), then retry")
    if "object storage write failed" in str(exc):  # (a shard's log object: ClearSession, a turn; trial57)
        return (f"a shard could not write to the --storage-uri object storage: {exc}; the write was not "
                "acknowledged: make the storage writable again (space, quota, permissions), then retry")
    return f"a shard is unavailable (it is being restarted); retry: {exc}"


class Undecodable:
    """A request message that did not parse (what :func:`lenient` returns instead of raising)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def lenient(deserializer):
    """``deserializer`` (bytes -> message) returning :class:`Undecodable` where it would raise."""
    if deserializer is None:
        return None

    def decode(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - e.g. protobuf DecodeError; answered by the handler
            return Undecodable(exc)

    return decode


def passing_bytes(serializer):
    """``serializer`` (message -> bytes) that returns a ``bytes`` response as it is: a handler
    that serialised its reply already (to check its size, ``OpRAGServicer._fits``) returns the
    bytes, and they are not serialised twice."""
    if serializer is None:
        return None

    def encode(msg) -> bytes:
        return msg if type(msg) is bytes else serializer(msg)

    return encode


def checked(request: Any, method: str, package: str = "oprag.v1") -> Any:
    """:returns: ``request``. :raises InvalidArgument: it is :class:`Undecodable`."""
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"the {method} request could not be parsed ({request.error}): it is truncated or "
                              "corrupt, another message type, or has a string that is not valid UTF-8; send the "
                              f"serialised {package} request message of {method}")
    return request


async def _checked_stream(requests, method: str):
    async for r in requests:
        yield checked(r, method)


#: A cancellation that reaches the server this close to the RPC's deadline (seconds) is the
#: client's deadline: the client's timer starts when it sends the call, the server's when the
#: call arrives, so the client gives up (and cancels) a little before the server's deadline. Of
#: 40 ingest streams with deadlines of 0.02-1 s, 5 were cancelled 0.5-53 ms before it (issue 17
#: trial: 59 of 101 counted CANCELLED though every client saw DEADLINE_EXCEEDED).
DEADLINE_SLACK_S = 0.25


def _expired(context: Any) -> bool:
    """Whether the RPC's deadline has passed, or is less than :data:`DEADLINE_SLACK_S` away
    (False without a deadline)."""
    try:
        left = context.time_remaining()
    except Exception:  # noqa: BLE001 - a context without the call (tests), or one already torn down
        return False
    return left is not None and left <= DEADLINE_SLACK_S


class _Call:
    """One observed RPC: its method label, start time and final status code."""

    def __init__(self, method: str, context: Any) -> None:
        self.method, self.context = method, context
        self.code = grpc.StatusCode.OK
        self.t = time.perf_counter()

    async def fail(self, exc: BaseException) -> None:
        """Record ``exc``'s status and abort the RPC with it (always raises)."""
        if isinstance(exc, grpc.aio.AbortError):  # the handler aborted with its own status
            self.code = self.context.code() or grpc.StatusCode.UNKNOWN
            raise exc
        if isinstance(exc, asyncio.CancelledError) or not isinstance(exc, Exception):  # also GeneratorExit
            # the client left, or its deadline passed (what the client is told then: trial16
            # found every expired request counted CANCELLED)
            self.code = grpc.StatusCode.DEADLINE_EXCEEDED if _expired(self.context) else grpc.StatusCode.CANCELLED
            raise exc
        self.code, msg, trailers = status_for(exc, self.method)
        if getattr(exc, "nothing_stored", False):  # an Ingest stream that failed before its commit began
            trailers = (*trailers, STORED_NONE)
        if trailers:
            self.context.set_trailing_metadata(trailers)
        await self.context.abort(self.code, msg)

    def record(self, metrics: Any) -> None:
        metrics.requests.labels(method=self.method, code=self.code.name).inc()
        metrics.request_seconds.labels(method=self.method).observe(time.perf_counter() - self.t)


#: services of others whose undecodable requests are answered INVALID_ARGUMENT (:func:`decode_checked`)
DECODE_CHECKED = ("/grpc.health.v1.Health/",)


def decode_checked(handler, method: str, package: str):
    """``handler`` (unary request, coroutine: health's Check and Watch) with :func:`lenient`'s
    deserializer, aborting ``INVALID_ARGUMENT`` (:func:`checked`'s message) for an undecodable
    request; any other handler as it is."""
    fn = handler.unary_unary or handler.unary_stream
    if handler.request_streaming or not inspect.iscoroutinefunction(fn):
        return handler

    async def run(request, context):
        try:
            request = checked(request, method, package)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await fn(request, context)

    make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
    return make(run, request_deserializer=lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of ``service`` (full name, e.g. ``oprag.v1.OpRAG``).

    :param metrics: a :class:`~oprag_server.service.metrics.Metrics` (``requests``, ``request_seconds``).
    """

    def __init__(self, metrics: Any, service: str) -> None:
        self.metrics = metrics
        try:  # every method of the service exported from the start, with the codes it answers with
            methods = [m.name for m in descriptor_pool.Default().FindServiceByName(service).methods]
        except KeyError:  # (a service whose descriptor was not imported: its series appear as used)
            methods = []
        metrics.init_requests(methods, GRPC_CODES)
        self.prefix = f"/{service}/"
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method path -> (its handler, the wrapped one)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        ours = details.method.startswith(self.prefix)
        if handler is None or not (ours or details.method.startswith(DECODE_CHECKED)):
            return handler
        got = self._wrapped.get(details.method)
        if got is not None and got[0] is handler:  # the service's handlers are built once: wrap each once
            return got[1]
        name = details.method.rsplit("/", 1)[-1]
        wrapped = self._wrap(handler, name) if ours else decode_checked(handler, name, "grpc.health.v1")
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        kw = {"request_deserializer": lenient(handler.request_deserializer),
              "response_serializer": passing_bytes(handler.response_serializer)}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method, False), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, method, True), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, method, False), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, method, True), **kw)

    def _unary(self, fn, method: str, streaming: bool):
        async def observed(request, context):
            call = _Call(method, context)
            try:
                request = _checked_stream(request, method) if streaming else checked(request, method)
                return await fn(request, context)
            except BaseException as exc:  # noqa: BLE001 - mapped to a status, re-raised
                await call.fail(exc)
            finally:
                call.record(self.metrics)

        return observed

    def _stream(self, fn, method: str, streaming: bool):
        async def observed(request, context):
            call = _Call(method, context)
            try:
                request = _checked_stream(request, method) if streaming else checked(request, method)
                async for item in fn(request, context):
                    yield item
            except BaseException as exc:  # noqa: BLE001 - mapped to a status, re-raised
                await call.fail(exc)
            finally:
                call.record(self.metrics)

        return observed
