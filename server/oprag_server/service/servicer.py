"""Thin gRPC servicer: validate, convert, call the runtime, map errors to status codes."""

from __future__ import annotations

import asyncio
import functools
import math
import logging
import time
import uuid

import grpc
import numpy as np

from oprag.v1 import oprag_pb2, oprag_pb2_grpc

from ..engine.ingest import IngestError
from ..engine.query import Overloaded, QueryJob, QueryRejected
from ..index.analyzer import has_visible_content
from ..domain import MODES, RetrieveSpec
from ..shards.pool import ShardError

log = logging.getLogger(__name__)

_MODE_NAMES = {
    oprag_pb2.RETRIEVAL_MODE_UNSPECIFIED: "hybrid",
    oprag_pb2.HYBRID: "hybrid",
    oprag_pb2.DENSE: "dense",
    oprag_pb2.LEXICAL: "lexical",
    oprag_pb2.FULL_HYBRID: "full_hybrid",
}
assert set(_MODE_NAMES.values()) == set(MODES)


class InvalidArgument(ValueError):
    pass


def _status_for(exc: Exception, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """gRPC status code, message and trailing metadata for an exception raised by a handler."""
    if isinstance(exc, (InvalidArgument, IngestError, QueryRejected)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("retry-after-ms", str(int(exc.retry_after_s * 1000))),)
    if isinstance(exc, ShardError):
        return grpc.StatusCode.UNAVAILABLE, f"a shard is unavailable (it is being restarted); retry: {exc}", ()
    log.exception("%s failed", method)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ()


class _Observed:
    """Counts an RPC by status code, times it, and turns exceptions into gRPC statuses."""

    def __init__(self, servicer, method: str, context) -> None:
        self.servicer, self.method, self.context = servicer, method, context
        self.code = grpc.StatusCode.OK
        self.t = time.perf_counter()

    async def handle(self, exc: BaseException) -> None:
        """Record and re-raise/abort for ``exc`` (always raises)."""
        if isinstance(exc, grpc.aio.AbortError):
            self.code = self.context.code() or grpc.StatusCode.UNKNOWN
            raise exc
        if isinstance(exc, asyncio.CancelledError) or not isinstance(exc, Exception):  # also GeneratorExit
            self.code = grpc.StatusCode.CANCELLED
            raise exc
        self.code, msg, trailers = _status_for(exc, self.method)
        if trailers:
            self.context.set_trailing_metadata(trailers)
        await self.context.abort(self.code, msg)

    def done(self) -> None:
        m = self.servicer.metrics
        m.requests.labels(method=self.method, code=self.code.name).inc()
        m.request_seconds.labels(method=self.method).observe(time.perf_counter() - self.t)


def _observed(method: str):
    def deco(fn):
        @functools.wraps(fn)
        async def wrapper(self, request, context):
            obs = _Observed(self, method, context)
            try:
                return await fn(self, request, context)
            except BaseException as exc:  # noqa: BLE001 - mapped to a status, re-raised
                await obs.handle(exc)
            finally:
                obs.done()

        return wrapper

    return deco


def _observed_stream(method: str):
    """:func:`_observed` for server-streaming handlers (async generators)."""

    def deco(fn):
        @functools.wraps(fn)
        async def wrapper(self, request, context):
            obs = _Observed(self, method, context)
            try:
                async for item in fn(self, request, context):
                    yield item
            except BaseException as exc:  # noqa: BLE001 - mapped to a status, re-raised
                await obs.handle(exc)
            finally:
                obs.done()

        return wrapper

    return deco


class OpRAGServicer(oprag_pb2_grpc.OpRAGServicer):
    def __init__(self, runtime) -> None:
        self.rt = runtime
        self.metrics = runtime.metrics
        self.cfg = runtime.cfg

    # ------------------------------------------------------------------ validation
    def _job(self, req, *, generate: bool) -> QueryJob:
        lim, rcfg, gcfg = self.cfg.limits, self.cfg.retrieval, self.cfg.generate
        q = req.question
        if not has_visible_content(q):  # "", whitespace, or only Default_Ignorable code points
            raise InvalidArgument("question is empty: send a non-empty question")
        if len(q) > lim.max_question_chars:
            raise InvalidArgument(f"question has {len(q)} characters; the limit is {lim.max_question_chars}: shorten it")
        top_k = req.top_k or rcfg.default_top_k
        if not 1 <= top_k <= rcfg.max_top_k:
            raise InvalidArgument(f"top_k must be in [1, {rcfg.max_top_k}], got {req.top_k}")
        if req.mode not in _MODE_NAMES:
            raise InvalidArgument(
                f"unknown retrieval mode {req.mode}: use HYBRID (1), DENSE (2), LEXICAL (3) or FULL_HYBRID (4)"
            )
        mode = _MODE_NAMES[req.mode]
        cand = req.candidates or rcfg.candidates
        if not 1 <= cand <= rcfg.max_candidates:
            raise InvalidArgument(f"candidates must be in [1, {rcfg.max_candidates}], got {req.candidates}")
        cand = max(cand, top_k)
        if len(req.session_id.encode()) > lim.max_session_id_bytes:
            raise InvalidArgument(f"session_id is longer than {lim.max_session_id_bytes} bytes")
        fusion, wd, wl, rrf_k = self._fusion(req.fusion)
        filters = self._filters(req.filters)
        qvec = None
        if len(req.query_vector):
            qvec = np.asarray(req.query_vector, dtype=np.float64)
            dim = self.rt.encoder.dim
            if qvec.shape[0] != dim:
                raise InvalidArgument(f"query_vector has {qvec.shape[0]} values; the embedder produces {dim}")
            if not np.isfinite(qvec).all():
                raise InvalidArgument("query_vector contains NaN or infinity")
            scale = float(np.abs(qvec).max())
            if scale == 0.0:
                raise InvalidArgument("query_vector is all zeros: send the query embedding")
            qvec = qvec / scale  # avoids float overflow/underflow in the norm
            qvec = (qvec / np.linalg.norm(qvec)).astype(np.float32)
        max_new = 0
        if generate:
            max_new = req.generation.max_new_tokens or gcfg.default_max_new_tokens
            if not 1 <= max_new <= gcfg.max_new_tokens_limit:
                raise InvalidArgument(
                    f"max_new_tokens must be in [1, {gcfg.max_new_tokens_limit}], got {req.generation.max_new_tokens}"
                )
        return QueryJob(
            question=q,
            spec=RetrieveSpec(
                mode=mode,
                top_k=top_k,
                candidates=cand,
                dense_weight=wd,
                lexical_weight=wl,
                fusion=fusion,
                rrf_k=rrf_k,
                filters=filters,
            ),
            query_vector=qvec,
            session_id=req.session_id,
            use_memory=not req.disable_memory,
            generate=generate and self.rt.generator is not None,
            max_new_tokens=max_new,
            request_id=uuid.uuid4().hex,
        )

    def _fusion(self, f) -> tuple[str, float, float, int]:
        rcfg = self.cfg.retrieval
        if f.method not in (oprag_pb2.FUSION_UNSPECIFIED, oprag_pb2.WEIGHTED_MINMAX, oprag_pb2.RRF):
            raise InvalidArgument(f"unknown fusion method {f.method}: use WEIGHTED_MINMAX (1) or RRF (2)")
        method = "rrf" if f.method == oprag_pb2.RRF else "minmax"
        wd, wl = f.dense_weight, f.lexical_weight
        for name, w in (("dense_weight", wd), ("lexical_weight", wl)):
            if not math.isfinite(w) or not 0 <= w <= 1e6:
                raise InvalidArgument(f"fusion.{name} must be a number in [0, 1e6], got {w}")
        if wd == 0 and wl == 0:
            wd, wl = rcfg.dense_weight, rcfg.lexical_weight
        rrf_k = f.rrf_k or 60
        if rrf_k > 100_000:
            raise InvalidArgument(f"fusion.rrf_k must be <= 100000, got {rrf_k}")
        return method, wd, wl, rrf_k

    @staticmethod
    def _filters(filters) -> tuple:
        if len(filters) > 16:
            raise InvalidArgument(f"{len(filters)} metadata filters; the limit is 16")
        out = []
        for f in filters:
            if not f.key:
                raise InvalidArgument("a metadata filter has an empty key: name the metadata key to match")
            if not f.values or len(f.values) > 1024:
                raise InvalidArgument(f"metadata filter {f.key!r} needs between 1 and 1024 values")
            out.append((f.key, tuple(f.values)))
        return tuple(out)

    @staticmethod
    def _info(job: QueryJob) -> oprag_pb2.RetrievalInfo | None:
        i = job.info
        if i is None:
            return None
        return oprag_pb2.RetrievalInfo(
            mode=i.mode, fusion=i.fusion, dense_weight=i.dense_weight, lexical_weight=i.lexical_weight,
            rrf_k=i.rrf_k, candidates=i.candidates, chunks_searched=i.chunks_searched,
            partial=bool(i.missing_shards), missing_shards=i.missing_shards,
        )

    @staticmethod
    def _hits(job: QueryJob) -> list[oprag_pb2.Hit]:
        return [
            oprag_pb2.Hit(
                chunk_id=h.chunk_id,
                doc_id=h.doc_id,
                title=h.title,
                text=h.text,
                score=h.score,
                dense_score=h.dense_score,
                lexical_score=h.lexical_score,
                shard=h.shard,
                metadata=h.metadata,
                dense_rank=h.dense_rank,
                lexical_rank=h.lexical_rank,
            )
            for h in job.hits
        ]

    # ------------------------------------------------------------------ RPCs
    async def _read_your_writes(self, request, context) -> None:
        if request.min_seq:
            try:
                await self.rt.wait_applied(request.min_seq, context.time_remaining())
            except LookupError as exc:
                raise InvalidArgument(str(exc)) from exc
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"sequence number {request.min_seq} was not applied before the deadline")

    @staticmethod
    def _sources(job: QueryJob) -> list[oprag_pb2.Source]:
        p = job.payload
        return [
            oprag_pb2.Source(number=s.number, chunk_id=s.chunk_id, doc_id=s.doc_id, title=s.title, tokens=s.tokens,
                             truncated=s.truncated)
            for s in (p.sources if p else [])
        ]

    @staticmethod
    def _trace(job: QueryJob, request) -> oprag_pb2.Trace | None:
        if not request.include_trace:
            return None
        return oprag_pb2.Trace(stages=[oprag_pb2.StageTrace(**st) for st in job.trace()])

    @_observed("Query")
    async def Query(self, request, context):
        job = self._job(request, generate=True)
        await self._read_your_writes(request, context)
        job = await self.rt.query.submit(job)
        p = job.payload
        return oprag_pb2.QueryResponse(
            answer=job.answer if self.rt.generator is not None else "",
            hits=self._hits(job),
            timings_ms=job.timings_ms,
            request_id=job.request_id,
            sources=self._sources(job),
            prompt_tokens=p.prompt_tokens if p else 0,
            completion_tokens=job.completion_tokens,
            finish_reason=job.finish_reason,
            memory_context=job.memory.memory_text if job.memory else "",
            retrieval=self._info(job),
            trace=self._trace(job, request),
            ttft_ms=job.ttft_ms,
        )

    @_observed_stream("QueryStream")
    async def QueryStream(self, request, context):
        job = self._job(request, generate=True)
        await self._read_your_writes(request, context)
        job.events = asyncio.Queue()
        task = asyncio.create_task(self.rt.query.submit(job))
        try:
            while True:
                get = asyncio.create_task(job.events.get())
                done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break
                yield self._event(*get.result())
            while not job.events.empty():
                yield self._event(*job.events.get_nowait())
            job = task.result()
            p = job.payload
            yield oprag_pb2.QueryEvent(done=oprag_pb2.DoneEvent(
                answer=job.answer, timings_ms=job.timings_ms, prompt_tokens=p.prompt_tokens if p else 0,
                completion_tokens=job.completion_tokens, finish_reason=job.finish_reason, ttft_ms=job.ttft_ms,
                trace=self._trace(job, request),
            ))
        finally:
            if not task.done():
                task.cancel()

    def _event(self, kind: str, val) -> oprag_pb2.QueryEvent:
        if kind == "text":
            return oprag_pb2.QueryEvent(text=val)
        return oprag_pb2.QueryEvent(sources=oprag_pb2.SourcesEvent(
            request_id=val.request_id, hits=self._hits(val), sources=self._sources(val), retrieval=self._info(val),
            memory_context=val.memory.memory_text if val.memory else "",
        ))

    @_observed("Retrieve")
    async def Retrieve(self, request, context):
        job = self._job(request, generate=False)
        await self._read_your_writes(request, context)
        job = await self.rt.query.submit(job)
        return oprag_pb2.RetrieveResponse(
            hits=self._hits(job),
            timings_ms=job.timings_ms,
            request_id=job.request_id,
            memory_context=job.memory.memory_text if job.memory else "",
            retrieval=self._info(job),
            trace=self._trace(job, request),
        )

    @_observed("Ingest")
    async def Ingest(self, request_iterator, context):
        res = await self.rt.ingest.run(request_iterator)
        self.rt.mark_dirty()
        return oprag_pb2.IngestResponse(
            documents_written=res.documents_written,
            chunks_written=res.chunks_written,
            documents_replaced=res.documents_replaced,
            rejected=[oprag_pb2.RejectedDocument(index=i, id=d, reason=r) for i, d, r in res.rejected],
            chunks_split=res.chunks_split,
            chunks_reused=res.chunks_reused,
            seq=res.seq,
            elapsed_ms=res.elapsed_ms,
        )

    @_observed("Delete")
    async def Delete(self, request, context):
        ids = list(request.doc_ids)
        if not ids:
            raise InvalidArgument("doc_ids is empty: name at least one document id")
        if any(not i for i in ids):
            raise InvalidArgument("doc_ids contains an empty id: every id must be non-empty")
        if len(ids) > self.cfg.limits.max_delete_ids:
            raise InvalidArgument(f"{len(ids)} ids; the limit per Delete is {self.cfg.limits.max_delete_ids}")
        docs, chunks, seq = await self.rt.delete(ids)
        return oprag_pb2.DeleteResponse(documents_deleted=docs, chunks_deleted=chunks, seq=seq)

    @_observed("ClearSession")
    async def ClearSession(self, request, context):
        if not request.session_id:
            raise InvalidArgument("session_id is empty: name the session to clear")
        if len(request.session_id.encode()) > self.cfg.limits.max_session_id_bytes:
            raise InvalidArgument(f"session_id is longer than {self.cfg.limits.max_session_id_bytes} bytes")
        return oprag_pb2.ClearSessionResponse(records_removed=await self.rt.memory.clear(request.session_id))

    @_observed("Stats")
    async def Stats(self, request, context):
        got, _ = await self.rt.pool.gather_partial("stats", {})
        shards = [got[k] for k in sorted(got)]
        return oprag_pb2.StatsResponse(
            documents=sum(s["documents"] for s in shards),
            chunks=sum(s["chunks"] for s in shards),
            memory_records=sum(s["memory_records"] for s in shards),
            seq=self.rt.seq,
            shards=[
                oprag_pb2.ShardStats(
                    shard=s["shard"],
                    documents=s["documents"],
                    chunks=s["chunks"],
                    memory_records=s["memory_records"],
                    applied_seq=s["applied_seq"],
                )
                for s in shards
            ],
            embedder=self.rt.encoder.name,
            generator=self.rt.generator.name if self.rt.generator is not None else "none",
        )
