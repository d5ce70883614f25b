"""Typed Python client for the OpRAG service (sync :class:`OpRAGClient`, asyncio
:class:`AsyncOpRAGClient`).

Both set the same message size limit as the server and split ingest streams into messages that
stay under it. Errors surface as ``grpc.RpcError`` (sync) / ``grpc.aio.AioRpcError`` (async)
with the server's status code and message.
"""

from __future__ import annotations

import asyncio
import numbers
import sys
from collections.abc import AsyncIterable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from oprag.v1 import oprag_pb2, oprag_pb2_grpc

from .channel import open_channel
from .inputs import bad_text, clear_session_request, delete_request, names_bad_text
from .metadata import MetadataValue, metadata_of, metadata_value  # noqa: F401 - re-exported
from .retry import NO_RETRY, RetryPolicy, acall, call, nothing_stored
from .streams import StreamCall, SyncStreamCall
from .vectors import floats as _floats
from .vectors import pack as _pack
from .vectors import _CHUNK_FIX, _DOC_FIX

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
MODES = {
    "hybrid": oprag_pb2.HYBRID,
    "dense": oprag_pb2.DENSE,
    "lexical": oprag_pb2.LEXICAL,
    "full_hybrid": oprag_pb2.FULL_HYBRID,
}


@dataclass
class Doc:
    """One document to ingest. ``metadata`` values are ``str``, ``int`` (signed 64-bit),
    ``float`` (finite) or ``bool`` and keep their type; a ``None`` value drops the key."""

    id: str
    text: str = ""
    title: str = ""
    metadata: dict[str, MetadataValue | None] = field(default_factory=dict)
    #: optional embedding of the whole ``text`` (float sequence of the server's width D): the
    #: document is stored as one chunk and not embedded by the server
    vector: Sequence[float] | None = None
    #: optional ``[(chunk text, vector)]``: the document's chunks with their embeddings, stored as
    #: given (leave ``text`` empty)
    chunks: Sequence[tuple[str, Sequence[float]]] | None = None

    def to_pb(self) -> oprag_pb2.Document:
        """The wire document: strings in ``metadata`` (what servers that predate typed
        metadata read), every other value in ``typed_metadata``.

        :raises ValueError: a key that is not a string or a bad value (:func:`metadata_value`), a
            text that is not valid Unicode (a lone surrogate), a vector element that is not a number.
        """
        try:
            return self._to_pb()
        except UnicodeEncodeError:
            raise bad_text({"id": self.id, "title": self.title, "text": self.text, "metadata": self.metadata,
                            "chunks": [t for t, _ in self.chunks or ()]}, f"document {self.id!r}: ") from None

    def _to_pb(self) -> oprag_pb2.Document:
        for name in ("id", "text", "title"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, bytes)):
                raise TypeError(f"document {name} must be a string, got {type(v).__name__} {v!r}"
                                + (f": pass str({v!r})" if name == "id" and isinstance(v, int) else ""))
        plain, typed = {}, {}
        for k, v in self.metadata.items():
            if not isinstance(k, str):
                raise ValueError(f"metadata key {k!r} is not a string")
            if isinstance(v, str):
                plain[k] = v
            elif v is not None:
                typed[k] = metadata_value(k, v)
        if self.chunks is not None and not len(self.chunks):  # (None: the server chunks the text)
            raise ValueError(f"document {self.id!r}: chunks is empty: give at least one (text, vector) pair, or leave "
                             "chunks None to have the server chunk and embed the text")
        for i, c in enumerate(self.chunks or ()):
            sized = hasattr(c, "__len__") and not isinstance(c, (str, bytes))
            if not sized or isinstance(c, Mapping) or len(c) != 2:  # (trial50: a bare "too many values to unpack")
                raise ValueError(f"document {self.id!r}: chunks[{i}] is a {type(c).__name__}"
                                 + (f" of {len(c)} items" if sized else "") + ": each chunk is a (text, vector) pair")
            _, v = c
            if v is None:  # (the server refuses a chunk without a vector: say so before sending)
                raise ValueError(f"document {self.id!r}: chunks[{i}] vector is None: {_CHUNK_FIX}")
        packed = _pack(self)
        if packed is not None:
            return oprag_pb2.Document(
                id=self.id, title=self.title, text=self.text, metadata=plain, typed_metadata=typed,
                chunks=[oprag_pb2.ChunkVector(text=t) for t, _ in self.chunks or ()],
                vectors_f32=packed[0], vector_dim=packed[1])
        return oprag_pb2.Document(
            id=self.id, title=self.title, text=self.text, metadata=plain, typed_metadata=typed,
            vector=_floats(self.vector, f"document {self.id!r}: vector", empty_fix=_DOC_FIX),
            chunks=[oprag_pb2.ChunkVector(text=t, vector=_floats(v, f"document {self.id!r}: chunks[{i}] vector",
                                                                 empty_fix=_CHUNK_FIX))
                    for i, (t, v) in enumerate(self.chunks or ())])


def _as_pb(d: Any) -> oprag_pb2.Document:
    if isinstance(d, oprag_pb2.Document):
        return d
    if isinstance(d, Doc):
        return d.to_pb()
    if isinstance(d, Mapping):
        return Doc(str(d["id"]), d.get("text") or "", d.get("title") or "", dict(d.get("metadata") or {}),
                   d.get("vector"), [(c["text"], c["vector"]) for c in d["chunks"]] if d.get("chunks") is not None else None
                   ).to_pb()
    raise TypeError(f"cannot ingest {type(d).__name__}: pass Doc, oprag_pb2.Document or a dict with id and text")


#: the server's largest ef_search / nprobe (oprag_server.service.convert.MAX_KNOB; fixed limits, not flags)
MAX_KNOB = 65536


def message_budget(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> int:
    """Bytes of documents one IngestRequest may carry: the message limit less 1/512 of it, at least 1 KiB, for the
    request's own framing (32 MiB: 33,488,896 bytes; trial50: the former 90% less 1 KiB refused 28.8-32 MiB documents
    the server takes)."""
    return max_message_bytes - max(1024, max_message_bytes // 512)


def too_large(n: int, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> str:
    """What a document over :func:`message_budget` is told (the client and the CLI); ``n``: its serialised bytes
    plus the 8 its place in the message takes, as :func:`ingest_messages` counts them."""
    return (f"is {n - 8} bytes ({n} in its message), over the {message_budget(max_message_bytes)} bytes one ingest "
            f"message can carry (the "
            f"{max_message_bytes}-byte gRPC message limit less its framing): not sent (split it into smaller documents)")


def oversized(d: Any, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> int | None:
    """The serialised size in bytes of document ``d`` when it cannot fit in one IngestRequest
    (:func:`ingest_messages` would refuse the stream), else None."""
    n = _as_pb(d).ByteSize() + 8
    return n if n > message_budget(max_message_bytes) else None


class _Sent:
    """An Ingest call's request messages (:func:`ingest_messages`), remembering whether the final one was handed to
    gRPC and the error a document raised while they were made (the sync and the asyncio client)."""

    def __init__(self, docs: Iterable[Any], max_message_bytes: int) -> None:
        self.docs, self.max_message_bytes = docs, max_message_bytes
        self.failed: list[BaseException] = []
        self.final = False

    def messages(self) -> Iterator[oprag_pb2.IngestRequest]:
        try:
            for m in ingest_messages(self.docs, self.max_message_bytes):
                if m.final:  # handed to gRPC now: the server may receive it and commit
                    self.final = True
                yield m
        except Exception as exc:  # noqa: BLE001 - re-raised by explained() with its own type
            self.failed.append(exc)
            raise

    def explained(self, exc: BaseException) -> BaseException:
        """The error to raise for the call's ``exc``: a document's own error, else ``exc`` with
        ``final_message_sent`` and ``nothing_stored`` (:func:`.retry.nothing_stored`, or the final message never
        handed to gRPC: the server cannot have begun the commit)."""
        if self.failed:
            return self.failed[0]
        try:
            exc.final_message_sent = self.final
            exc.nothing_stored = nothing_stored(exc) or not self.final  # (no final message: no commit; trial52 #6)
        except AttributeError:  # (an error type without attributes: callers then assume it was sent)
            pass
        return exc


def ingest_messages(docs: Iterable[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                    max_docs_per_message: int = 64) -> Iterator[oprag_pb2.IngestRequest]:
    """Pack documents into IngestRequest messages each under ``max_message_bytes`` (with room
    for framing), then a final message carrying the number of documents sent.

    :raises ValueError: a single document is larger than the message limit.
    """
    budget = message_budget(max_message_bytes)
    batch: list[oprag_pb2.Document] = []
    size = 0
    sent = 0
    for d in docs:
        pb = _as_pb(d)
        n = pb.ByteSize() + 8
        if n > budget:
            raise ValueError(f"document {pb.id!r} {too_large(n, max_message_bytes)}")
        if batch and (size + n > budget or len(batch) >= max_docs_per_message):
            yield oprag_pb2.IngestRequest(documents=batch)
            batch, size = [], 0
        batch.append(pb)
        size += n
        sent += 1
    yield oprag_pb2.IngestRequest(documents=batch, final=True, sent_documents=sent)


FUSIONS = {"minmax": oprag_pb2.WEIGHTED_MINMAX, "rrf": oprag_pb2.RRF}


@names_bad_text("question", "session_id", "filters")
def query_request(question: str, *, top_k: int = 0, mode: str = "hybrid", session_id: str = "",
                  max_new_tokens: int = 0, candidates: int = 0, disable_memory: bool = False,
                  fusion: str = "minmax", dense_weight: float = 0.0, lexical_weight: float = 0.0, rrf_k: int = 0,
                  filters: Mapping[str, MetadataValue | list[MetadataValue]] | None = None,
                  query_vector=None, min_seq: int = 0, include_trace: bool = False,
                  group_by_document: bool = False, chunks_per_document: int = 0, ef_search: int = 0,
                  nprobe: int = 0, stop: str | Sequence[str] | None = None) -> oprag_pb2.QueryRequest:
    """Build a QueryRequest (for :meth:`OpRAGClient.query`, ``retrieve``, ``query_stream`` and
    their :class:`AsyncOpRAGClient` twins, which take the same keyword arguments).

    :param filters: ``{key: value}`` (equality) or ``{key: [values]}`` (set membership); values
        are typed: ``True`` matches only boolean true, ``"true"`` only the string, numbers match
        by numeric value (README: typed metadata).
    :param query_vector: optional precomputed query embedding (float sequence or 1-D array, width
        D); None (the default) lets the server embed the question. An empty sequence is a
        ValueError (on the wire it would read as "no vector"), as is an element that is not a number.
    :param min_seq: read-your-writes: wait until this ingest/delete sequence number is applied.
    :param group_by_document: document-level retrieval: ``top_k`` counts documents, each scored
        by its best chunk (MaxP); the response's ``documents`` lists them (``doc_id``, ``title``,
        ``score``, ``hits``) and ``hits`` holds their chunks, document by document.
    :param chunks_per_document: with ``group_by_document``, best chunks kept per document (0 = 1).
    :param ef_search: HNSW search beam, :param nprobe: IVF lists visited, for a server started with
        ``--dense-index hnsw`` / ``ivf`` (0 = its default; the response's ``retrieval`` reports
        what was used).
    :param stop: a stop string or up to 4 (OpenAI's ``stop``): generation ends where the first is complete, the answer
        is cut just before it (not returned), ``finish_reason`` ``"stop"``; the server checks them (INVALID_ARGUMENT).
    :raises ValueError: unknown ``mode`` / ``fusion``, a bad filter (:func:`metadata_value`), a count out of range,
        a bad ``query_vector``, a text (question, session_id, filter) that is not valid Unicode (the message names it).
    """
    for name, v in dict(top_k=top_k, max_new_tokens=max_new_tokens, candidates=candidates, rrf_k=rrf_k, nprobe=nprobe,
                        chunks_per_document=chunks_per_document, ef_search=ef_search, min_seq=min_seq).items():
        if v is None:  # unset: the server's default, as 0
            continue
        if not isinstance(v, numbers.Integral):  # protobuf said "'str' object cannot be interpreted as an integer"
            raise TypeError(f"{name} must be an integer (0 = the server's default), got {type(v).__name__} {v!r}")
        if int(v) not in range(hi := 2**64 if name == "min_seq" else MAX_KNOB + 1 if name in ("ef_search", "nprobe") else 2**32):
            raise ValueError(f"{name} must be between 0 and {hi - 1} (0 = the server's default), got {v}")
    for name, v in (("question", question), ("session_id", session_id)):
        if v is not None and not isinstance(v, (str, bytes)):
            raise TypeError(f"{name} must be a string, got {type(v).__name__} {v!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(x, str) for x in stops):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if filters is not None and not isinstance(filters, Mapping):
        raise TypeError(f"filters must be a dict {{key: value or [values]}}, got {type(filters).__name__} {filters!r}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    if fusion not in FUSIONS:
        raise ValueError(f"unknown fusion {fusion!r}: use one of {', '.join(FUSIONS)}")
    flt = []
    for k, v in (filters or {}).items():
        vals = list(v) if isinstance(v, (list, tuple, set, frozenset)) else [v]
        flt.append(oprag_pb2.MetadataFilter(key=k, values=[x for x in vals if isinstance(x, str)],
                                            typed_values=[metadata_value(k, x, "metadata filter") for x in vals if not isinstance(x, str)]))
    return oprag_pb2.QueryRequest(
        filters=flt,
        fusion=oprag_pb2.FusionOptions(method=FUSIONS[fusion], dense_weight=dense_weight,
                                       lexical_weight=lexical_weight, rrf_k=rrf_k),
        query_vector=_floats(query_vector),
        min_seq=min_seq,
        include_trace=include_trace,
        question=question,
        top_k=top_k,
        mode=MODES[mode],
        session_id=session_id,
        generation=oprag_pb2.GenerationOptions(max_new_tokens=max_new_tokens, stop=stops),
        candidates=candidates,
        disable_memory=disable_memory,
        group_by_document=group_by_document,
        chunks_per_document=chunks_per_document,
        ef_search=ef_search,
        nprobe=nprobe,
    )


class OpRAGClient:
    """Blocking client. Use as a context manager or call :meth:`close`."""

    def __init__(self, target: str = "127.0.0.1:50051", *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 timeout: float | None = None, token: str | None = None, tls_ca=None, tls_cert=None,
                 tls_key=None, retry: RetryPolicy = NO_RETRY, channel_options=None) -> None:
        """:param retry: retry of the unary RPCs (query, retrieve, delete, clear_session, stats) on
            UNAVAILABLE / RESOURCE_EXHAUSTED (:mod:`oprag_client.retry`); none by default.
        :param channel_options: gRPC channel arguments (a mapping or ``(name, value)`` pairs) over
            this client's (:func:`oprag_client.channel.channel_options`: a restarted server is
            reconnected to within about a second, :data:`~oprag_client.channel.RECONNECT_OPTIONS`).
        :param token: bearer token; surrounding whitespace (a file's trailing newline) is dropped.
        :raises ValueError: a token with a control or non-ASCII character inside (:func:`~oprag_client.channel.bearer_token`)."""
        self.retry = retry
        self.max_message_bytes = max_message_bytes
        self.timeout = timeout
        self.channel, self.md = open_channel(target, aio=False, max_message_bytes=max_message_bytes,
                                             options=channel_options, token=token, tls_ca=tls_ca,
                                             tls_cert=tls_cert, tls_key=tls_key)
        self.stub = oprag_pb2_grpc.OpRAGStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> OpRAGClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the channel connects. :raises grpc.FutureTimeoutError: not in time."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def ingest(self, docs: Iterable[Any], *, timeout: float | None = None) -> oprag_pb2.IngestResponse:
        """Stream documents in one all-or-nothing Ingest call.

        :raises ValueError | TypeError: a document is too large or of the wrong type (nothing is
            stored: the stream ends without its final message).
        :raises grpc.RpcError: the server's status, or the transport's. Its attribute
            ``final_message_sent`` says whether gRPC had taken the stream's final message: if not,
            the server cannot have committed the stream (README: "Ingest semantics"); if so, a call
            cut short (the connection lost, a deadline) may have been committed whole -- unless
            ``nothing_stored`` (:func:`.retry.nothing_stored`: the server's own status said its commit never began;
            also True whenever ``final_message_sent`` is False).
        """
        sent = _Sent(docs, self.max_message_bytes)
        try:
            return self.stub.Ingest(sent.messages(), timeout=timeout or self.timeout, metadata=self.md)
        except grpc.RpcError as exc:
            raise sent.explained(exc) from None

    def query(self, question: str, *, timeout: float | None = None, **kw) -> oprag_pb2.QueryResponse:
        return call(self.retry, lambda: self.stub.Query(query_request(question, **kw), timeout=timeout or self.timeout, metadata=self.md))

    def query_stream(self, question: str, *, timeout: float | None = None, **kw) -> SyncStreamCall:
        """Iterate QueryEvents: ``sources`` first, then ``text`` pieces, then ``done`` (a
        :class:`~oprag_client.streams.SyncStreamCall`: leaving a ``for`` loop over it early, its
        ``close()`` or the end of ``with c.query_stream(...) as call:`` cancels the query).

        :raises ValueError | TypeError: a bad argument (:func:`query_request`).
        :raises grpc.RpcError: while iterating: the server's status (``CANCELLED`` after a cancel).
        """
        return SyncStreamCall(self.stub.QueryStream(query_request(question, **kw), timeout=timeout or self.timeout,
                                                    metadata=self.md))

    def retrieve(self, question: str, *, timeout: float | None = None, **kw) -> oprag_pb2.RetrieveResponse:
        kw.pop("max_new_tokens", None), kw.pop("stop", None)
        return call(self.retry, lambda: self.stub.Retrieve(query_request(question, **kw), timeout=timeout or self.timeout, metadata=self.md))

    def delete(self, doc_ids: Iterable[str], *, timeout: float | None = None) -> oprag_pb2.DeleteResponse:
        req = delete_request(doc_ids)  # once: a retry resends it (ids from a generator included)
        return call(self.retry, lambda: self.stub.Delete(req, timeout=timeout or self.timeout, metadata=self.md))

    def clear_session(self, session_id: str, *, timeout: float | None = None) -> oprag_pb2.ClearSessionResponse:
        return call(self.retry, lambda: self.stub.ClearSession(clear_session_request(session_id),
                                      timeout=timeout or self.timeout, metadata=self.md))

    def stats(self, *, timeout: float | None = None) -> oprag_pb2.StatsResponse:
        return call(self.retry, lambda: self.stub.Stats(oprag_pb2.StatsRequest(), timeout=timeout or self.timeout, metadata=self.md))

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """``"SERVING"``, ``"NOT_SERVING"``, ... of the standard grpc.health.v1 service."""
        r = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class AsyncOpRAGClient:
    """asyncio client (grpc.aio). Use ``async with`` or await :meth:`close`."""

    def __init__(self, target: str = "127.0.0.1:50051", *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 timeout: float | None = None, token: str | None = None, tls_ca=None, tls_cert=None,
                 tls_key=None, retry: RetryPolicy = NO_RETRY, channel_options=None) -> None:
        """:param retry: and ``channel_options``: as :class:`OpRAGClient`'s."""
        self.retry = retry
        self.max_message_bytes = max_message_bytes
        self.timeout = timeout
        self.channel, self.md = open_channel(target, aio=True, max_message_bytes=max_message_bytes,
                                             options=channel_options, token=token, tls_ca=tls_ca,
                                             tls_cert=tls_cert, tls_key=tls_key)
        self.stub = oprag_pb2_grpc.OpRAGStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> AsyncOpRAGClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def ingest(self, docs: Iterable[Any] | AsyncIterable[Any], *, timeout: float | None = None):
        """:meth:`OpRAGClient.ingest`, awaited: the same errors, the ``grpc.RpcError`` with the same
        ``final_message_sent`` and ``nothing_stored`` (trial50: it had neither)."""
        if isinstance(docs, AsyncIterable):
            collected = [d async for d in docs]
            docs = collected
        sent = _Sent(docs, self.max_message_bytes)
        try:
            return await self.stub.Ingest(sent.messages(), timeout=timeout or self.timeout, metadata=self.md)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not sent.failed:
                raise  # (grpc.aio cancels the call when the request iterator raises: that error instead)
            raise sent.explained(exc) from None

    async def query(self, question: str, *, timeout: float | None = None, **kw):
        return await acall(self.retry, lambda: self.stub.Query(query_request(question, **kw), timeout=timeout or self.timeout, metadata=self.md))

    def query_stream(self, question: str, *, timeout: float | None = None, **kw):
        """Async-iterate QueryEvents: ``sources``, then ``text`` pieces, then ``done`` (a
        :class:`StreamCall`: leaving the loop early cancels the query)."""
        return StreamCall(self.stub.QueryStream(query_request(question, **kw), timeout=timeout or self.timeout,
                                                metadata=self.md))

    async def retrieve(self, question: str, *, timeout: float | None = None, **kw):
        kw.pop("max_new_tokens", None), kw.pop("stop", None)
        return await acall(self.retry, lambda: self.stub.Retrieve(query_request(question, **kw), timeout=timeout or self.timeout, metadata=self.md))

    async def delete(self, doc_ids: Iterable[str], *, timeout: float | None = None):
        req = delete_request(doc_ids)
        return await acall(self.retry, lambda: self.stub.Delete(req, timeout=timeout or self.timeout, metadata=self.md))

    async def clear_session(self, session_id: str, *, timeout: float | None = None):
        return await acall(self.retry, lambda: self.stub.ClearSession(clear_session_request(session_id),
                                            timeout=timeout or self.timeout, metadata=self.md))

    async def stats(self, *, timeout: float | None = None):
        return await acall(self.retry, lambda: self.stub.Stats(oprag_pb2.StatsRequest(), timeout=timeout or self.timeout, metadata=self.md))

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        r = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
