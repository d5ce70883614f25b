"""The OpenAI-compatible HTTP API's request and response shapes (pydantic), and their mapping to
the gRPC request: an HTTP request becomes an ``oprag.v1.QueryRequest`` and goes through the very
same validation (:func:`oprag_server.service.convert.query_job`) as the gRPC RPCs.

Extension fields (README: "OpenAI-compatible HTTP API"):

* request ``oprag``: :class:`ChatOptions` (mode, top_k, candidates, filters, fusion,
  session_id, disable_memory, include_trace, ef_search, nprobe, query_vector, min_seq), sent by the
  ``openai`` package as ``extra_body={"oprag": {...}}``; ``/v1/retrieve`` takes them flat, plus
  ``group_by_document`` and ``chunks_per_document`` (:class:`RetrieveRequest`; its reply is the
  extension without ``sources``, ``finish_reason`` and ``ttft_ms``, plus ``documents``);
* response ``oprag``: ``{"request_id", "sources", "hits", "retrieval", "memory_context", "memory_used",
  "resolved_query", "finish_reason", "timings_ms", "ttft_ms"[, "trace"]}``; in a stream, on the first
  chunk (sources, hits, retrieval, memory fields) and on the last one (finish reason, timings, trace).
"""

from __future__ import annotations

import base64
import dataclasses
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationInfo, field_validator, model_validator)

from oprag.v1 import oprag_pb2

from ..domain import MemoryContext
from ..engine.job import QueryJob
from ..engine.stops import MAX_STOPS
from .convert import MODE_NAMES, InvalidArgument, memory_fields, metadata_value
from .openai_errors import U32 as _U32

_WIRE_MODE = {name: wire for wire, name in MODE_NAMES.items() if wire != oprag_pb2.RETRIEVAL_MODE_UNSPECIFIED}
#: OpenAI's limit on the inputs of one embeddings request.
MAX_EMBED_INPUTS = 2048


def _utf8(s: str) -> str:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no UTF-8 consumer (tokenizer,
    protobuf, Arrow) accepts: refuse them here, as a 400 naming the field."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the string has an unpaired surrogate {s[exc.start]!r} at {exc.start}: send valid Unicode") from None
    return s


def _float(x: float | int) -> float:
    """A JSON number as a float; an integer too large for one is infinite (refused as NaN and
    infinity are, by :func:`~oprag_server.service.convert.query_vector`), not an OverflowError."""
    try:
        return float(x)
    except OverflowError:
        return float("inf") if x > 0 else float("-inf")


def _some(v: list[float]) -> list[float]:
    """A ``query_vector`` that has values (``[]`` on gRPC is no vector: here it is refused)."""
    if not v:
        raise ValueError("it is empty: send the query embedding (as many values as the embedder's vectors), or "
                         "leave query_vector out to have the query embedded")
    return v


#: a string of the request: strictly a JSON string, valid Unicode (no lone surrogates)
Str = Annotated[StrictStr, AfterValidator(_utf8)]
#: QueryRequest's ``query_vector`` (the question's embedding: the server then does not embed it;
#: the checks of convert.query_vector) and ``min_seq`` (read-your-writes: wait until that
#: ingest/delete seq is applied), on /v1/retrieve and in a chat request's ``oprag``
QueryVector = Annotated[list[Annotated[StrictFloat | StrictInt, AfterValidator(_float)]], AfterValidator(_some)] | None
MinSeq = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]


class _Wire(BaseModel):
    """Every request shape of the HTTP API: a JSON ``null`` for an optional field (one with a
    default) means the field is absent, i.e. its default -- clients that serialise unset fields as
    null (pydantic ``Optional``, many SDKs) get the same reply as clients that leave them out
    (trial22: ``"top_k": null`` was a 400, ``"max_tokens": null`` the default). A required field
    sent as null keeps its type error ("query must be a string, got null")."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class _Strict(_Wire):
    # unknown OpenAI fields (tools, top_p, seed, ...) are accepted and ignored, as most
    # OpenAI-compatible servers do; the types of known fields are checked strictly
    model_config = ConfigDict(extra="ignore")


class _Own(_Wire):
    # OpRAG's own shapes (/v1/retrieve, the "oprag" extension, its fusion): an unknown field is a
    # typo ("topk") that would silently fall back to a default, so it is refused, named
    model_config = ConfigDict(extra="forbid")


class Fusion(_Own):
    method: Literal["minmax", "rrf"] = "minmax"
    dense_weight: StrictFloat | StrictInt = 0.0
    lexical_weight: StrictFloat | StrictInt = 0.0
    rrf_k: StrictInt = Field(0, ge=0, le=_U32)


class RetrievalOptions(_Own):
    """Retrieval knobs, the same fields and defaults as ``QueryRequest`` (0 = server default)."""

    mode: Literal["hybrid", "dense", "lexical", "full_hybrid"] = "hybrid"
    top_k: StrictInt = Field(0, ge=0, le=_U32)
    candidates: StrictInt = Field(0, ge=0, le=_U32)
    # typed values (README: typed metadata): true matches only boolean true, "true" only the string
    # {key: [values]} (any value matches) or {key: value} (shorthand for a one-value list)
    filters: dict[Str, list[Str | StrictBool | StrictInt | StrictFloat] | Str | StrictBool | StrictInt | StrictFloat] = \
        Field(default_factory=dict)
    fusion: Fusion = Field(default_factory=Fusion)
    session_id: Str = ""
    disable_memory: StrictBool = False
    include_trace: StrictBool = False
    # HNSW beam / IVF lists of a server started with --dense-index hnsw|ivf (the gRPC bounds, [0, 65536])
    ef_search: StrictInt = Field(0, ge=0, le=_U32)
    nprobe: StrictInt = Field(0, ge=0, le=_U32)


class ChatOptions(RetrievalOptions):
    """A chat request's ``oprag``: the retrieval knobs plus ``query_vector`` and ``min_seq``, as
    on /v1/retrieve (the same types, checks and messages)."""

    query_vector: QueryVector = None
    min_seq: MinSeq = 0


class TextPart(_Strict):
    type: Literal["text"]
    text: Str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: StrictBool = False


#: OpenAI chat fields refused when they ask for something (:meth:`ChatRequest._unsupported`): why, what to do
_UNSUPPORTED = {
    "logprobs": "log probabilities are not returned by this server: remove logprobs (or send false)",
    "top_logprobs": "log probabilities are not returned by this server: remove top_logprobs",
    "tool_choice": "tool calls are not supported (answers come from the retrieved sources): remove tool_choice, "
                   "or send \"auto\" or \"none\" (tools are then not called)",
    "function_call": "function calls are not supported (answers come from the retrieved sources): remove "
                     "function_call, or send \"auto\" or \"none\"",
    "response_format": "only {\"type\": \"text\"} is supported (no JSON mode or schema): remove response_format",
}


#: the values of those fields that ask for nothing
_OFF = {"logprobs": (None, False), "top_logprobs": (None, 0), "tool_choice": (None, "none", "auto"),
        "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"})}


class ChatRequest(_Strict):
    """``POST /v1/chat/completions``. ``temperature`` is accepted in [0, 2] and ignored: decoding
    is greedy (as temperature 0). ``n`` must be 1."""

    model: Str
    messages: list[Message] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # >= 1, as OpenAI's (0 is no answer length; leave the field out, or null, for the server default)
    max_tokens: StrictInt | None = Field(None, ge=1, le=_U32)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=_U32)
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0, le=2)
    n: StrictInt = Field(1, ge=1, le=1)
    user: Str | None = None
    oprag: ChatOptions = Field(default_factory=ChatOptions)
    stop: Str | list[Str] | None = None  # up to 4 stop sequences (engine.stops); "" and empty entries ask for none
    # OpenAI fields this server cannot honour: refused when they ask for something (their "off" values are
    # accepted), since an answer that ignored them is not what the client asked for (trial51 #8)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tool_choice: Str | dict | None = None
    function_call: Str | dict | None = None
    response_format: dict | None = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v in _OFF[info.field_name]:
            return v
        raise ValueError(_UNSUPPORTED[info.field_name])

    def stops(self) -> list[str]:
        """The request's stop strings, empty ones left out (checked with the gRPC field's rules by the query).

        :raises InvalidArgument: more than :data:`~..engine.stops.MAX_STOPS` entries, empty ones counted (OpenAI's
            limit is on the list as sent; trial53b #3)."""
        sent = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(sent) > MAX_STOPS:
            raise InvalidArgument(f"stop has {len(sent)} strings; at most {MAX_STOPS} are allowed: send fewer")
        return [s for s in sent if s]


class RetrieveRequest(RetrievalOptions):
    """``POST /v1/retrieve``: a question and the retrieval knobs (flat), plus document-level
    retrieval (``group_by_document``, ``chunks_per_document``: ``QueryRequest``'s fields, the same
    validation in :func:`~oprag_server.service.convert.chunks_per_document`)."""

    query: Str
    group_by_document: StrictBool = False
    chunks_per_document: StrictInt = Field(0, ge=0, le=_U32)
    query_vector: QueryVector = None
    min_seq: MinSeq = 0


class EmbeddingsRequest(_Strict):
    """``POST /v1/embeddings``: ``input`` a string or a list of strings (token arrays are not
    accepted), ``encoding_format`` float or base64 (little-endian float32, as OpenAI)."""

    model: Str
    input: Str | list[Str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: Str | None = None


# ---------------------------------------------------------------------------------- requests
def query_request(question: str, opts: RetrievalOptions, max_new_tokens: int = 0,
                  stop: list[str] | None = None) -> oprag_pb2.QueryRequest:
    """The ``QueryRequest`` a gRPC client would send for the same question and settings."""
    return oprag_pb2.QueryRequest(
        question=question, top_k=opts.top_k, mode=_WIRE_MODE[opts.mode], session_id=opts.session_id,
        candidates=opts.candidates, disable_memory=opts.disable_memory, include_trace=opts.include_trace,
        ef_search=opts.ef_search, nprobe=opts.nprobe, group_by_document=getattr(opts, "group_by_document", False),
        chunks_per_document=getattr(opts, "chunks_per_document", 0), query_vector=getattr(opts, "query_vector", None),
        generation=oprag_pb2.GenerationOptions(max_new_tokens=max_new_tokens, stop=stop or []),
        filters=[oprag_pb2.MetadataFilter(key=k, typed_values=[metadata_value(x, k, "metadata filter")
                                                               for x in (v if isinstance(v, list) else [v])])
                 for k, v in opts.filters.items()],
        fusion=oprag_pb2.FusionOptions(
            method=oprag_pb2.RRF if opts.fusion.method == "rrf" else oprag_pb2.WEIGHTED_MINMAX,
            dense_weight=opts.fusion.dense_weight, lexical_weight=opts.fusion.lexical_weight, rrf_k=opts.fusion.rrf_k),
    )


def conversation(req: ChatRequest, max_chars: int) -> tuple[str, MemoryContext | None]:
    """The question (the last message, which must be the user's) and, when the conversation has
    earlier user turns and no ``oprag.session_id`` is given, the memory context they make: the
    previous user question (whitespace runs as one space, cut to ``max_chars`` characters, the
    question limit, as a stored session's questions are bounded by it) is shown as memory and is
    the session context of a second retrieval row, fused with the question's own list as the
    memory operator does with stored turns (README: memory). Uncut, one pasted document in an
    earlier message was embedded and BM25-scored whole on the shared query path (trial23: a 10 MB
    message held every other request for minutes).

    :raises InvalidArgument: the last message is not a user message.
    """
    last = req.messages[-1]
    if last.role != "user":
        raise InvalidArgument(f"messages[-1] has role {last.role!r}: the last message must be the user's question")
    question = last.text()
    earlier = [m.text() for m in req.messages[:-1] if m.role == "user" and m.text().strip()]
    if not earlier or req.oprag.session_id or req.oprag.disable_memory:
        return question, None
    prev = _words_upto(earlier[-1], max_chars)
    return question, MemoryContext(question, f"Previous question: {prev}", len(earlier),
                                   context_text=f"{question} {prev}")


def _words_upto(text: str, max_chars: int) -> str:
    """``" ".join(text.split())`` cut to at most ``max_chars`` characters (at a word boundary when
    one is in reach, else mid-word), reading only as much of ``text`` as that needs."""
    out, n = [], -1
    for m in re.finditer(r"\S+", text):
        w = m.group()
        if n + 1 + len(w) > max_chars:
            if not out:
                out.append(w[:max_chars])
            break
        out.append(w)
        n += 1 + len(w)
    return " ".join(out)


def max_new_tokens(req: ChatRequest) -> int:
    """``max_completion_tokens``, else ``max_tokens`` (each >= 1 when given), else 0 (the server default)."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else (req.max_tokens or 0)


# --------------------------------------------------------------------------------- responses
def hit_dicts(job: QueryJob) -> list[dict]:
    """The job's hits in rank order (the fields of the wire ``Hit``)."""
    return [dataclasses.asdict(h) for h in job.hits]


def document_dicts(job: QueryJob) -> list[dict]:
    """The job's ranked documents (the fields of the wire ``DocumentHit``: ``doc_id``, ``title``,
    ``score``, ``hits``); [] for a chunk-level request."""
    return [dataclasses.asdict(d) for d in job.documents or ()]


def extension(job: QueryJob, *, include_trace: bool, first: bool = True, last: bool = True) -> dict[str, Any]:
    """The response's ``oprag`` object; ``first`` carries the sources, ``last`` the timings."""
    out: dict[str, Any] = {"request_id": job.request_id}
    if first:
        p = job.payload
        out["sources"] = [dataclasses.asdict(s) for s in (p.sources if p else [])]
        out["hits"] = hit_dicts(job)
        # partial and exact, as gRPC's RetrievalInfo says them (README: never a silently incomplete result; trial42:
        # exact, a property, was missing here)
        out["retrieval"] = ({**dataclasses.asdict(job.info), "partial": bool(job.info.missing_shards),
                             "exact": job.info.exact} if job.info is not None else None)
        out.update(memory_fields(job))  # gRPC's rule: memory_context only when memory changed the retrieval
    if last:
        # OpenAI's finish_reason has no value for "this server has no generator" or "no sources,
        # not generated"; OpRAG's own reason (stop, length, no_generator, no_sources) is here
        out["finish_reason"] = job.finish_reason or "stop"
        out["timings_ms"] = dict(job.timings_ms)
        out["ttft_ms"] = job.ttft_ms
        if include_trace:
            out["trace"] = job.trace()
    return out


def finish_reason(job: QueryJob) -> str:
    """OpenAI's ``stop`` or ``length`` (the exact reason, e.g. ``no_generator`` or ``no_sources``
    with an empty ``content``, is in the ``oprag`` extension's ``finish_reason``)."""
    return "length" if job.finish_reason == "length" else "stop"


def usage(job: QueryJob) -> dict[str, int]:
    p = job.payload.prompt_tokens if job.payload else 0
    return {"prompt_tokens": p, "completion_tokens": job.completion_tokens, "total_tokens": p + job.completion_tokens}


def embedding_data(vecs: np.ndarray, encoding: str) -> list[dict]:
    """OpenAI ``embedding`` objects from float32[B, D]: lists of floats, or base64 of the
    little-endian float32 bytes."""
    out = []
    for i, v in enumerate(np.asarray(vecs, dtype="<f4")):
        emb: Any = base64.b64encode(v.tobytes()).decode() if encoding == "base64" else v.tolist()
        out.append({"object": "embedding", "index": i, "embedding": emb})
    return out
