"""OpenAI-compatible HTTP front door (FastAPI on uvicorn), served in the gRPC server's process and
event loop (``--http-port``; 0 = off) with the same bearer tokens, TLS files, limits, validation
and exception mapping as the gRPC RPCs.

Endpoints: ``POST /v1/chat/completions`` (``stream`` as server-sent events), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/embeddings``, ``POST /v1/retrieve``. Request and response
shapes: :mod:`oprag_server.service.openai_api`; error replies: :mod:`.openai_errors`. Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with status 400 (bad input), 401 (token),
404 (unknown model or path), 405, 413 (body over ``limits.max_message_bytes``), 429 (overloaded;
``Retry-After`` in whole seconds), 503 (a shard is down), 500 (a server bug only).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..config import ServerConfig
from ..engine.ingest import IngestError
from ..engine.query import Overloaded, QueryRejected
from ..index.analyzer import has_visible_content
from ..shards.pool import ShardError
from . import convert
from . import openai_api as api
from .convert import InvalidArgument
from .http_labels import CODE_NAME as _CODE_NAME
from .http_labels import init_labels
from .http_labels import metric_method as _metric_method
from .http_body import BadBody, JSONRoute
from .openai_errors import NotFound, error_response, exception_response, validation_message
from .servicer import read_your_writes
from .disconnect import ClientGone as _ClientGone
from .disconnect import unless_gone as _unless_gone
from .stream import job_events
from .tracing import CARRIER, carrier_of

ALIAS = "oprag"  # a chat model id that always names the configured generator
_ENDPOINTS = ("the endpoints are POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, POST /v1/embeddings "
           "and POST /v1/retrieve")


#: the request model of each POST route (validation messages list its fields)
_MODELS = {"/v1/retrieve": api.RetrieveRequest, "/v1/chat/completions": api.ChatRequest,
           "/v1/embeddings": api.EmbeddingsRequest}


class Guard:
    """ASGI middleware in front of the app: bearer token (401), body size (413), and per-request
    metrics ``oprag_requests_total{method="HTTP <path>", code}`` / ``oprag_request_seconds``."""

    def __init__(self, app: Any, *, tokens: set[str], max_body: int, metrics: Any, tracing: bool = False) -> None:
        self.app, self.max_body, self.metrics, self.tracing = app, max_body, metrics, tracing
        self.tokens = [t.encode() for t in tokens]
        init_labels(metrics, tokens=bool(tokens))  # every route x code exported as 0 from the start

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.tokens:
            return True
        v = headers.get(b"authorization", b"")
        if v[:7].lower() != b"bearer ":
            return False
        got = v[7:].strip()
        return any(hmac.compare_digest(got, t) for t in self.tokens)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope.get("method") == "POST" and b"json" not in headers.get(b"content-type", b"").lower():
            # every POST body is JSON: read it as such whatever its type (curl -d says form-urlencoded)
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        t0, status, started, ended = time.perf_counter(), [500], [False], [False]
        outcome: dict[str, str] = {}  # "code": a streamed reply's error event (sse() in build_app)
        scope = {**scope, "oprag.outcome": outcome}
        if self.tracing:  # W3C traceparent -> the query's trace (service/tracing.py)
            CARRIER.set((f"HTTP {scope['path']}", carrier_of(scope["headers"])))

        async def observed_send(msg):
            if msg["type"] == "http.response.start":
                status[0], started[0] = msg["status"], True
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                ended[0] = True

        try:  # (every answer is counted, a 401 and a 413 too: trial51 #2)
            if not self._authorized(headers):
                r = error_response(401, "missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await r(scope, receive, observed_send)
            body = await self._body(headers, receive)
            if isinstance(body, int):  # over the limit (a Content-Length, or chunks counted as they came)
                size = f"{body} bytes" if body > 0 else f"more than {self.max_body} bytes"  # (chunked: read up to it)
                r = error_response(413, f"request body has {size}; the limit is {self.max_body}: send a smaller body",
                                   code="body_too_large")
                return await r(scope, receive, observed_send)
            await self.app(scope, _replay(body, receive), observed_send)
        except Exception as exc:  # noqa: BLE001 - a bug, already logged and answered by the app (500)
            if not started[0]:
                await exception_response(exc, scope["path"])(scope, receive, observed_send)
        finally:
            method = _metric_method(scope["path"])
            code = outcome.get("code") or _CODE_NAME.get(status[0], "INTERNAL")
            if started[0] and not ended[0] and status[0] < 400:
                code = "CANCELLED"  # the client left during a streamed reply (as a cancelled QueryStream)
            self.metrics.requests.labels(method=method, code=code).inc()
            self.metrics.request_seconds.labels(method=method).observe(time.perf_counter() - t0)

    async def _body(self, headers: dict[bytes, bytes], receive) -> bytes | int:
        """The whole request body, read before the app runs (trial51 #1: a chunked body raised over the limit inside
        the app, which had answered 500 by then); over ``max_body``: its ``Content-Length``, or -1 when the chunks
        passed the limit (the rest is not read)."""
        try:
            size = int(headers.get(b"content-length", b"0"))
        except ValueError:
            size = 0
        if size > self.max_body:
            return size
        parts, seen, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # (the client left before its body ended: the app sees it next)
                break
            parts.append(msg.get("body", b""))
            seen += len(parts[-1])
            if seen > self.max_body:
                return -1
            more = msg.get("more_body", False)
        return b"".join(parts)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that gives the app ``body`` as one message, then what ``receive`` gives (a disconnect)."""
    given = False

    async def replay():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def build_app(rt: Any) -> FastAPI:
    """The FastAPI app over a runtime (``app.Runtime`` or a test double with ``cfg``, ``encoder``,
    ``generator``, ``query``, ``embedder``); auth and size limits are :class:`Guard`'s."""
    cfg: ServerConfig = rt.cfg
    app = FastAPI(title="OpRAG", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = JSONRoute  # bodies parsed as strict UTF-8 JSON (http_body)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, msg = validation_message(list(exc.errors()), exc.body, _MODELS.get(request.url.path))
        return error_response(400, msg, param=param, code="invalid_value")

    @app.exception_handler(BadBody)  # not UTF-8, not JSON, nested too deeply (http_body.JSONRoute)
    async def _bad_body(request: Request, exc: BadBody) -> JSONResponse:
        return error_response(400, str(exc), code="invalid_json")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:  # an unknown path or method: say which exist
        what = f": {request.method} {request.url.path[:200]}; {_ENDPOINTS}" if exc.status_code in (404, 405) else ""
        return error_response(exc.status_code, f"{exc.detail}{what}",
                              code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> JSONResponse:  # nobody reads it: for the metrics
        return error_response(499, "the client closed the connection", code="cancelled")

    async def _mapped(request: Request, exc: Exception) -> JSONResponse:
        return exception_response(exc, f"HTTP {request.url.path}")

    # the exceptions the gRPC interceptor maps; anything else is a bug, answered 500 in the same
    # shape by the handler for Exception, which then re-raises (to Guard, which ends it there)
    for cls in (InvalidArgument, QueryRejected, IngestError, Overloaded, ShardError, NotFound, Exception):
        app.add_exception_handler(cls, _mapped)

    def chat_models() -> list[str]:
        return [rt.generator.name] if rt.generator is not None else []

    def listed() -> list[str]:  # the generator, its alias, the embedder: what GET /v1/models/{id} knows too
        return list(dict.fromkeys([*chat_models(), *([ALIAS] if rt.generator is not None else []), rt.encoder.name]))

    model_card = lambda name: {"id": name, "object": "model", "created": 0, "owned_by": "oprag"}  # noqa: E731

    @app.get("/v1/models/")  # (it was a 307 to /v1/models with an empty body)
    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(m) for m in listed()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict:
        if model_id not in listed():  # (the alias was 200 on a --generator none server, unlisted: trial22)
            raise NotFound(f"the model {model_id!r} does not exist: GET /v1/models lists them")
        return model_card(model_id)

    def job_for(question: str, opts: api.RetrievalOptions, *, max_new: int = 0, generate: bool, stop=None):
        req = api.query_request(question, opts, max_new, stop)
        return convert.query_job(req, cfg, dim=rt.encoder.dim, generate=generate,
                                 can_generate=rt.generator is not None, chunks=rt.corpus_stats.n_docs)

    def fits(obj: dict, job: Any) -> JSONResponse:
        """``obj`` rendered, or InvalidArgument when its JSON exceeds the message limit (as the
        gRPC replies, ``OpRAGServicer._fits``; JSON escapes can make it several times the protobuf)."""
        try:
            r = JSONResponse(obj)
        except TypeError:  # a value json cannot encode as is (what FastAPI's encoder did for a returned dict)
            r = JSONResponse(jsonable_encoder(obj))
        return too_big(len(r.body), job) or r

    def too_big(n: int, job: Any) -> None:
        """:raises InvalidArgument: ``n`` bytes of reply exceed the message limit."""
        limit = cfg.limits.max_message_bytes
        if n > limit:
            raise InvalidArgument(f"the reply would be {n} bytes of JSON, over the server's {limit}-byte "
                                  f"message limit (top_k {job.spec.top_k}): ask for fewer hits (top_k) or drop include_trace")

    async def applied(request: Request, min_seq: int) -> None:
        """Wait until ``min_seq`` is applied on every shard (read-your-writes, as gRPC's
        :func:`~.servicer.read_your_writes`, with no deadline: a client that leaves ends the wait).
        :raises InvalidArgument: ``min_seq`` was never issued. :raises ClientGone: the client left."""
        if min_seq:
            await _unless_gone(request, read_your_writes(rt, min_seq, None))

    @app.post("/v1/retrieve")
    async def retrieve(body: api.RetrieveRequest, request: Request) -> Any:
        job = job_for(body.query, body, generate=False)
        await applied(request, body.min_seq)
        job = await _unless_gone(request, rt.query.submit(job))
        ext = {k: v for k, v in api.extension(job, include_trace=body.include_trace).items()  # (nothing generated)
               if k not in ("sources", "finish_reason", "ttft_ms")}
        return fits({"object": "retrieval", **ext, "documents": api.document_dicts(job)}, job)

    @app.post("/v1/embeddings")
    async def embeddings(body: api.EmbeddingsRequest) -> dict:
        if body.model != rt.encoder.name:
            what = "is a chat model, not an embedding model" if body.model in [*chat_models(), ALIAS] else "does not exist"
            raise NotFound(f"the embedding model {body.model!r} {what}; this server embeds with {rt.encoder.name!r}")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not 1 <= len(texts) <= api.MAX_EMBED_INPUTS:
            raise InvalidArgument(f"input has {len(texts)} items; send between 1 and {api.MAX_EMBED_INPUTS}")
        for i, t in enumerate(texts):
            if not has_visible_content(t) or len(t) > cfg.limits.max_question_chars:  # (as a question)
                raise InvalidArgument(f"input[{i}] must have visible text (not only whitespace or invisible characters) "
                                      f"and at most {cfg.limits.max_question_chars} characters")
        if body.dimensions is not None and body.dimensions != rt.encoder.dim:
            raise InvalidArgument(f"dimensions must be {rt.encoder.dim} (the embedder's width), got {body.dimensions}")
        # bulk work, as an ingest's: the ingest embedding path (its batches yield to queries' embeddings),
        # not the query path, where one request of 2048 long inputs (~3 min on 2 cores) held every
        # query's embedding behind it (trial20). Same vectors: truncated as a query's, rows batch-invariant.
        ids = await asyncio.get_running_loop().run_in_executor(None, rt.encoder.tokenize, texts, True)
        vecs = await rt.embedder.embed_chunks(ids)
        n = sum(map(len, ids))
        return {"object": "list", "model": rt.encoder.name, "data": api.embedding_data(vecs, body.encoding_format),
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest, request: Request) -> Any:
        if body.model not in [*chat_models(), ALIAS]:
            use = ", ".join([*chat_models(), ALIAS])
            if body.model == rt.encoder.name:  # (listed by /v1/models: it exists, it only embeds; trial27)
                raise NotFound(f"{body.model!r} is this server's embedding model (POST /v1/embeddings), not a chat "
                               f"model: use {use}")
            raise NotFound(f"the model {body.model!r} does not exist: use {use}")
        question, memory = api.conversation(body, cfg.limits.max_question_chars)
        max_new, limit = api.max_new_tokens(body), cfg.generate.max_new_tokens_limit
        if max_new > limit:  # name the HTTP field, not the gRPC one
            field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            raise InvalidArgument(f"{field} must be at most {limit} on this server, got {max_new}")
        job = job_for(question, body.oprag, max_new=max_new, generate=True, stop=body.stops())
        if memory is not None:
            job.memory = memory  # the plan has no memory step: the conversation is the memory
        await applied(request, body.oprag.min_seq)  # (after the checks, as gRPC's Query)
        head = {"id": f"chatcmpl-{job.request_id}", "created": int(time.time()), "model": body.model}
        trace = body.oprag.include_trace
        if not body.stream:
            job = await _unless_gone(request, rt.query.submit(job))
            msg = {"role": "assistant", "content": job.answer if rt.generator is not None else ""}
            return fits({**head, "object": "chat.completion", "usage": api.usage(job), "oprag": api.extension(job, include_trace=trace),
                         "choices": [{"index": 0, "message": msg, "finish_reason": api.finish_reason(job), "logprobs": None}]}, job)
        events = job_events(rt.query.submit, job)
        try:
            first = await events.__anext__()  # refusals and failures before any event: an HTTP status
        except BaseException:
            await events.aclose()
            raise
        usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(delta: dict, finish: str | None = None, **extra: Any) -> bytes:
            return _sse({**head, "object": "chat.completion.chunk", **extra,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

        kind, val = first
        opening = None  # the sources chunk (hits): over the message limit it is a 400, before the stream starts
        if kind == "sources":
            opening = chunk({"role": "assistant", "content": ""}, oprag=api.extension(val, include_trace=trace, last=False))
            try:
                too_big(len(opening), val)
            except InvalidArgument:
                await events.aclose()
                raise

        async def sse():
            kind, val = first
            try:
                while True:
                    if kind == "sources":
                        yield opening
                    elif kind == "text":
                        yield chunk({"content": val})
                    else:  # done
                        yield chunk({}, api.finish_reason(val), oprag=api.extension(val, include_trace=trace, first=False))
                        if usage:
                            yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": api.usage(val)})
                        yield b"data: [DONE]\n\n"
                        return
                    kind, val = await events.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:  # noqa: BLE001 - after the 200 header: an error event ends the stream
                err = exception_response(exc, "HTTP /v1/chat/completions")
                request.scope.get("oprag.outcome", {})["code"] = _CODE_NAME.get(err.status_code, "INTERNAL")
                yield _sse(json.loads(err.body))
            finally:
                await events.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gRPC server's loop owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: D102
        yield


async def start_http(cfg: ServerConfig, rt: Any, tokens: set[str]) -> tuple[_Server, asyncio.Task]:
    """Serve :func:`build_app` behind :class:`Guard` on ``cfg.host:cfg.http_port`` (TLS with the
    gRPC certificate files) as a task of the running loop; returns once it listens.

    :raises RuntimeError: it could not start (e.g. the port was taken).
    """
    sec = cfg.security
    tls: dict[str, Any] = {}
    if sec.tls_cert is not None:
        tls = {"ssl_certfile": str(sec.tls_cert), "ssl_keyfile": str(sec.tls_key)}
        if sec.tls_client_ca is not None:
            import ssl

            tls |= {"ssl_ca_certs": str(sec.tls_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    app = Guard(build_app(rt), tokens=tokens, max_body=cfg.limits.max_message_bytes, metrics=rt.metrics,
                tracing=getattr(rt, "tracing", None) is not None)
    server = _Server(uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=int(cfg.shutdown_grace_s), **tls))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            exc = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"could not start the HTTP port {cfg.host}:{cfg.http_port} (--http-port): {exc!r}")
        await asyncio.sleep(0.02)
    return server, task
