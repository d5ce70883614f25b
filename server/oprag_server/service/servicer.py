"""Thin gRPC servicer: validate and convert (``convert``), call the runtime, convert back.

Exceptions become gRPC statuses, and every RPC is counted and timed, in
:class:`~oprag_server.service.interceptors.StatusInterceptor`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from oprag.v1 import oprag_pb2, oprag_pb2_grpc

from . import convert
from .convert import InvalidArgument
from .stream import job_events


async def read_your_writes(rt: Any, min_seq: int, timeout: float | None) -> None:
    """Wait until ``min_seq`` is applied on every shard (0 = do not wait): a request's ``min_seq``
    (gRPC ``QueryRequest``, HTTP ``/v1/retrieve``).

    :raises InvalidArgument: ``min_seq`` was never issued.
    :raises asyncio.TimeoutError: not applied within ``timeout`` seconds (None: no limit)."""
    if min_seq:
        try:
            await rt.wait_applied(min_seq, timeout)
        except LookupError as exc:
            raise InvalidArgument(f"min_seq is too large: {exc}; give a number a write returned") from exc


class OpRAGServicer(oprag_pb2_grpc.OpRAGServicer):
    """The ``oprag.v1.OpRAG`` service over a runtime (``app.Runtime`` or a test double) that has
    ``cfg``, ``encoder``, ``generator``, ``query``, ``ingest``, ``memory``, ``wait_applied``,
    ``delete`` and ``stats``."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.cfg = runtime.cfg

    def _job(self, request, *, generate: bool):
        return convert.query_job(request, self.cfg, dim=self.rt.encoder.dim, generate=generate,
                                 can_generate=self.rt.generator is not None, chunks=self.rt.corpus_stats.n_docs)

    async def _read_your_writes(self, request, context) -> None:
        """Wait until ``request.min_seq`` is applied on every shard (0 = do not wait)."""
        try:
            await read_your_writes(self.rt, request.min_seq, context.time_remaining())
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"sequence number {request.min_seq} was not applied before the deadline")

    def _fits(self, msg, request) -> bytes:
        """``msg`` serialised, or :class:`InvalidArgument` when it would exceed the server's
        message limit (``--max-message-bytes``): gRPC would fail it on the way out after the work
        was done, as RESOURCE_EXHAUSTED, which says nothing of the cause and which clients retry.
        The bytes are what the handler returns: the status interceptor's serializers pass bytes
        through (:func:`.interceptors.passing_bytes`), so the reply is serialised once (upb's
        ``ByteSize`` serialises the whole message too)."""
        raw = msg.SerializeToString()
        n = len(raw)
        limit = self.cfg.limits.max_message_bytes
        if n > limit:
            raise InvalidArgument(f"the reply would be {n} bytes, over the server's {limit}-byte message limit "
                                  f"(top_k {request.top_k or self.cfg.retrieval.default_top_k}): ask for fewer hits "
                                  "(top_k, chunks_per_document) or drop include_trace")
        return raw

    async def Query(self, request, context):
        job = self._job(request, generate=True)
        await self._read_your_writes(request, context)
        job = await self.rt.query.submit(job)
        return self._fits(convert.query_response(job, include_trace=request.include_trace,
                                                 has_generator=self.rt.generator is not None), request)

    async def QueryStream(self, request, context):
        job = self._job(request, generate=True)
        await self._read_your_writes(request, context)
        events = job_events(self.rt.query.submit, job)
        try:
            async for kind, val in events:
                if kind == "done":
                    yield self._fits(convert.done_event(val, include_trace=request.include_trace), request)
                elif kind == "sources":  # the hits: the event that can be over the limit
                    yield self._fits(convert.stream_event(kind, val), request)
                else:
                    yield convert.stream_event(kind, val)
        finally:
            await events.aclose()

    async def Retrieve(self, request, context):
        job = self._job(request, generate=False)
        await self._read_your_writes(request, context)
        job = await self.rt.query.submit(job)
        return self._fits(convert.retrieve_response(job, include_trace=request.include_trace), request)

    async def Ingest(self, request_iterator, context):
        # (a committed stream marked the shards dirty already: CommitProtocol.on_apply)
        # (a stream that waits for a slot is refused shortly before its deadline: engine.ingest_slots)
        left = context.time_remaining() if context is not None else None
        return convert.ingest_response(await self.rt.ingest.run(request_iterator, left), self.cfg.limits)

    async def Delete(self, request, context):
        docs, chunks, seq = await self.rt.delete(convert.delete_ids(request, self.cfg.limits))
        return oprag_pb2.DeleteResponse(documents_deleted=docs, chunks_deleted=chunks, seq=seq)

    async def ClearSession(self, request, context):
        # any stored id: one written before the characters rule can be cleared (session_ids)
        sid = convert.check_session_id(request.session_id, self.cfg.limits, required=True, existing=True)
        return oprag_pb2.ClearSessionResponse(records_removed=await self.rt.memory.clear(sid))

    async def Stats(self, request, context):
        return convert.stats_response(await self.rt.stats())
