"""Wire <-> domain conversion and request validation: the one place that reads ``oprag.v1``
messages and builds them. Pure functions; no server, runtime or event loop needed.

Every validation failure raises :class:`InvalidArgument` (``INVALID_ARGUMENT``) and says what to change."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from oprag.v1 import oprag_pb2

from .. import metadata as md
from ..config import LimitsConfig, RetrievalConfig, ServerConfig
from ..domain import DEFAULT_RRF_K, MODES, RetrieveSpec
from ..engine.job import QueryJob
from ..engine.stops import stop_strings
from ..index.analyzer import has_visible_content
from ..operators.hybrid import exact_dense, first_candidates
from ..records import F32_HINT
from . import session_ids
from .ingest_reply import ingest_response  # noqa: F401 - convert's proto <-> domain API

#: Wire retrieval mode -> domain mode name (UNSPECIFIED means the default, hybrid).
MODE_NAMES = {
    oprag_pb2.RETRIEVAL_MODE_UNSPECIFIED: "hybrid",
    oprag_pb2.HYBRID: "hybrid",
    oprag_pb2.DENSE: "dense",
    oprag_pb2.LEXICAL: "lexical",
    oprag_pb2.FULL_HYBRID: "full_hybrid",
}
assert set(MODE_NAMES.values()) == set(MODES)
MAX_FILTERS, MAX_FILTER_VALUES = 16, 1024
MAX_FILTER_KEY_BYTES = md.MAX_KEY_BYTES  # (UTF-8; a 100 KB key was accepted and echoed in messages, trial23)
MAX_FUSION_WEIGHT, MIN_FUSION_WEIGHT = 1e6, 1e-12  # (non-zero min: 1e-320 made every fused score 0, trial24)
MAX_RRF_K = 100_000
MAX_KNOB = 65536  #: the largest ef_search / nprobe a request may give (oprag_client.client.MAX_KNOB is the same)
#: ``finish_reason`` of a Query/QueryStream answered by a server without a generator.
NO_GENERATOR = "no_generator"


class InvalidArgument(ValueError):
    """A request field is out of range or malformed (-> ``INVALID_ARGUMENT``)."""


# ---------------------------------------------------------------------------------- requests
def query_job(req: Any, cfg: ServerConfig, *, dim: int, generate: bool, can_generate: bool, chunks: int = 0) -> QueryJob:
    """A validated :class:`QueryJob` from a ``QueryRequest`` (Query, QueryStream, Retrieve).

    :param dim: the embedder's output width D (a ``query_vector`` must have D values).
    :param generate: the RPC generates an answer (Query, QueryStream; not Retrieve).
    :param can_generate: the server has a generator (``--generator none`` has not: a generating RPC then gets
        ``finish_reason`` :data:`NO_GENERATOR`). :param chunks: the corpus' live chunks (the first N, ``exact_dense``).
    :raises InvalidArgument: empty or too long question, top_k / candidates / max_new_tokens / stop out of range,
        unknown mode or fusion, bad weights, rrf_k, filters, session id, query vector or chunks_per_document.
    """
    lim, rcfg, gcfg = cfg.limits, cfg.retrieval, cfg.generate
    q = req.question
    if not has_visible_content(q):  # "", whitespace, or only Default_Ignorable code points
        raise InvalidArgument("question is empty: send a non-empty question")
    if len(q) > lim.max_question_chars:
        raise InvalidArgument(f"question has {len(q)} characters; the limit is {lim.max_question_chars}: shorten it")
    top_k = req.top_k or rcfg.default_top_k
    if not 1 <= top_k <= rcfg.max_top_k:
        raise InvalidArgument(range_error("top_k", req.top_k, rcfg))
    if req.mode not in MODE_NAMES:
        raise InvalidArgument(f"unknown retrieval mode {req.mode}: use HYBRID (1), DENSE (2), LEXICAL (3) or FULL_HYBRID (4)")
    method, wd, wl, rrf_k = fusion(req.fusion, default_weights=(rcfg.dense_weight, rcfg.lexical_weight))
    exact = exact_dense(cfg.dense.kind, cfg.dense.ann_check, cfg.shards, chunks)
    cand = req.candidates or first_candidates(rcfg, MODE_NAMES[req.mode], method, req.group_by_document, top_k, exact)
    if not 1 <= cand <= rcfg.max_candidates:
        raise InvalidArgument(range_error("candidates", req.candidates, rcfg))
    check_session_id(req.session_id, lim)
    per_doc = chunks_per_document(req, top_k, rcfg.max_candidates)
    for name in ("ef_search", "nprobe"):
        if getattr(req, name, 0) > MAX_KNOB:
            raise InvalidArgument(range_error(name, getattr(req, name)))
    spec = RetrieveSpec(mode=MODE_NAMES[req.mode], top_k=top_k, candidates=max(cand, top_k), dense_weight=wd,
                        lexical_weight=wl, fusion=method, rrf_k=rrf_k, filters=filters(req.filters),
                        group_by_document=req.group_by_document, chunks_per_document=per_doc,
                        ef_search=getattr(req, "ef_search", 0), nprobe=getattr(req, "nprobe", 0))
    qvec = query_vector(req.query_vector, dim)
    max_new, stop = 0, ()
    if generate:
        max_new = req.generation.max_new_tokens or gcfg.default_max_new_tokens
        if not 1 <= max_new <= gcfg.max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens must be in [1, {gcfg.max_new_tokens_limit}] (0 = the default), got {req.generation.max_new_tokens}")
        stop = stop_strings(req.generation.stop, InvalidArgument)
    return QueryJob(question=q, spec=spec, query_vector=qvec, session_id=req.session_id, stop=stop,
                    use_memory=not req.disable_memory, generate=generate and can_generate, max_new_tokens=max_new,
                    request_id=request_id(), finish_reason=NO_GENERATOR if generate and not can_generate else "")


def range_error(name: str, got: Any, rcfg: Any = RetrievalConfig) -> str:
    """The message of a retrieval knob out of range: ``top_k`` and ``candidates`` in [1, the
    bound of ``rcfg``] or 0 (the default; ``rcfg``: the server's config, else the defaults),
    ``ef_search`` and ``nprobe`` in [0, 65536]; HTTP says the same for a value beyond uint32."""
    most = {"top_k": rcfg.max_top_k, "candidates": rcfg.max_candidates}.get(name)
    return f"{name} must be in [1, {most}] (0 = the default), got {got}" if most else f"{name} must be in [0, {MAX_KNOB}], got {got}"


def chunks_per_document(req: Any, top_k: int, max_chunks: int) -> int:
    """Chunks kept per document of a ``QueryRequest`` (1 when it is 0).

    :raises InvalidArgument: set without ``group_by_document``, or ``top_k * chunks_per_document``
        above ``max_chunks`` (the server's maximum candidates).
    """
    n = req.chunks_per_document
    if not req.group_by_document:
        if n:
            raise InvalidArgument("chunks_per_document needs group_by_document: set it, or send 0")
        return 1
    n = n or 1
    if top_k * n > max_chunks:
        raise InvalidArgument(f"top_k x chunks_per_document is {top_k * n}; the limit is {max_chunks}: "
                              "ask for fewer documents or chunks")
    return n


def fusion(f: Any, *, default_weights: tuple[float, float]) -> tuple[str, float, float, int]:
    """``(method, dense_weight, lexical_weight, rrf_k)`` from a ``Fusion`` message.

    Method ``"minmax"`` (UNSPECIFIED, WEIGHTED_MINMAX) or ``"rrf"``; both weights 0 means
    ``default_weights``; rrf_k 0 means :data:`~oprag_server.domain.DEFAULT_RRF_K`.

    :raises InvalidArgument: unknown method, a weight neither 0 nor in [1e-12, 1e6], rrf_k > 100000.
    """
    if f.method not in (oprag_pb2.FUSION_UNSPECIFIED, oprag_pb2.WEIGHTED_MINMAX, oprag_pb2.RRF):
        raise InvalidArgument(f"unknown fusion method {f.method}: use WEIGHTED_MINMAX (1) or RRF (2)")
    method = "rrf" if f.method == oprag_pb2.RRF else "minmax"
    wd, wl = f.dense_weight, f.lexical_weight
    for name, w in (("dense_weight", wd), ("lexical_weight", wl)):
        if w != 0 and not (math.isfinite(w) and MIN_FUSION_WEIGHT <= w <= MAX_FUSION_WEIGHT):
            raise InvalidArgument(f"fusion.{name} must be 0 or a number in [1e-12, 1e6], got {w}")
    if wd == 0 and wl == 0:
        wd, wl = default_weights
    rrf_k = f.rrf_k or DEFAULT_RRF_K
    if rrf_k > MAX_RRF_K:
        raise InvalidArgument(f"fusion.rrf_k must be <= 100000, got {rrf_k}")
    return method, wd, wl, rrf_k


def filters(fs: Any) -> tuple[tuple[str, tuple[md.Value, ...]], ...]:
    """``((key, (value, ...)), ...)`` from repeated ``MetadataFilter`` messages: its string
    ``values`` then its ``typed_values`` (str, int, float or bool; README: typed metadata).

    :raises InvalidArgument: more than 16 filters, an empty key or one over 1024 bytes of UTF-8, no
        values or more than 1024, a null (no kind set), NaN or infinite typed value.
    """
    if len(fs) > MAX_FILTERS:
        raise InvalidArgument(f"{len(fs)} metadata filters; the limit is {MAX_FILTERS}")
    out = []
    for f in fs:
        if not f.key:
            raise InvalidArgument("a metadata filter has an empty key: name the metadata key to match")
        if (kb := len(f.key.encode("utf-8", "surrogatepass"))) > MAX_FILTER_KEY_BYTES:
            raise InvalidArgument(f"a metadata filter key is {kb} bytes of UTF-8; the limit is {MAX_FILTER_KEY_BYTES} "
                                  f"(key starting {f.key[:40]!r}): name the metadata key to match")
        typed = getattr(f, "typed_values", ())
        n = len(f.values) + len(typed)
        if not n or n > MAX_FILTER_VALUES:
            raise InvalidArgument(f"metadata filter {f.key!r} needs between 1 and {MAX_FILTER_VALUES} values")
        values = list(f.values)
        for tv in typed:
            v = md.wire_value(tv)
            if v is None:
                raise InvalidArgument(f"metadata filter {f.key!r} has a null value (no kind set): "
                                      "send a string, integer, float or boolean")
            try:
                values.append(md.check_value(f.key, v))
            except ValueError as exc:
                raise InvalidArgument("metadata filter" + str(exc).removeprefix("metadata")) from exc
        out.append((f.key, tuple(values)))
    return tuple(out)


def query_vector(values: Any, dim: int) -> np.ndarray | None:
    """A client-given query embedding as unit-norm float32[dim], or None when none was sent.

    Scaled by its max |value| before the norm so that float overflow and underflow cannot occur.

    :raises InvalidArgument: not ``dim`` values, NaN or infinity, all zeros.
    """
    if not len(values):
        return None
    v = np.asarray(values, dtype=np.float64)  # (a new array: divided in place below)
    if v.shape[0] != dim:
        raise InvalidArgument(f"query_vector has {v.shape[0]} values; the embedder produces {dim}")
    scale = float(np.abs(v).max())  # NaN when any value is NaN, inf when one is infinite
    if not math.isfinite(scale):
        raise InvalidArgument(f"query_vector contains NaN or infinity{F32_HINT}")
    if scale == 0.0:
        raise InvalidArgument("query_vector is all zeros: send the query embedding (float32 rounds magnitudes below about 1.4e-45 to 0)")
    v /= scale
    v /= math.sqrt(v.dot(v))  # (np.linalg.norm of a 1-D float64 array: sqrt of its dot with itself)
    return v.astype(np.float32)


def request_id() -> str:
    """A random request id, as ``uuid.uuid4().hex`` (32 hex digits, version 4, RFC 4122 variant)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()


def check_session_id(session_id: str, limits: LimitsConfig, *, required: bool = False, existing: bool = False) -> str:
    """:returns: ``session_id``. :raises InvalidArgument: not a session id (:mod:`.session_ids`:
    control characters, leading or trailing whitespace -- not checked when ``existing`` --, over
    ``limits.max_session_id_bytes`` UTF-8 bytes) or empty when ``required``."""
    why = session_ids.problem(session_id, limits.max_session_id_bytes, required=required, existing=existing)
    if why is not None:
        raise InvalidArgument(why)
    return session_id


def delete_ids(req: Any, limits: LimitsConfig) -> list[str]:
    """The document ids of a ``DeleteRequest``.

    :raises InvalidArgument: no id, an empty or all-whitespace id, more than ``limits.max_delete_ids`` ids.
    """
    ids = list(req.doc_ids)
    if not ids:
        raise InvalidArgument("doc_ids is empty: name at least one document id")
    if any(not i.strip() for i in ids):  # (all-whitespace too: no document can have it, trial23)
        raise InvalidArgument("doc_ids contains an empty or all-whitespace id: every id must have a non-space character")
    if len(ids) > limits.max_delete_ids:
        raise InvalidArgument(f"{len(ids)} ids; the limit per Delete is {limits.max_delete_ids}")
    return ids


# --------------------------------------------------------------------------------- responses
def info(job: QueryJob) -> oprag_pb2.RetrievalInfo | None:
    """``RetrievalInfo`` of a finished job (``partial`` when a shard was missing), or None."""
    i = job.info
    if i is None:
        return None
    return oprag_pb2.RetrievalInfo(
        mode=i.mode, fusion=i.fusion, dense_weight=i.dense_weight, lexical_weight=i.lexical_weight, rrf_k=i.rrf_k,
        candidates=i.candidates, chunks_searched=i.chunks_searched, partial=bool(i.missing_shards),
        missing_shards=i.missing_shards, dense_index=i.dense_index, ef_search=i.ef_search, nprobe=i.nprobe,
        lexical_candidates=i.lexical_candidates, certified=i.certified, widen_rounds=i.widen_rounds,
        exact=i.exact,
    )


def hits(job: QueryJob) -> list[oprag_pb2.Hit]:
    """The job's ranked hits as wire ``Hit`` messages, in rank order."""
    return _hits(job.hits)


def _hits(hs: list, into: Any = None) -> list[oprag_pb2.Hit]:
    """Wire ``Hit`` messages of ``hs``; built in place in ``into`` (a repeated ``Hit`` field of
    a response: no copy of each message into it) when given."""
    out = []
    for h in hs:
        kw = dict(chunk_id=h.chunk_id, doc_id=h.doc_id, title=h.title, text=h.text, score=h.score,
                  dense_score=h.dense_score, lexical_score=h.lexical_score, shard=h.shard,
                  dense_rank=h.dense_rank, lexical_rank=h.lexical_rank)
        m = oprag_pb2.Hit(**kw) if into is None else into.add(**kw)
        if h.metadata:
            m.MergeFromString(_metadata_bytes(h.metadata))
        out.append(m)
    return out


_META: dict[tuple, bytes] = {}  # metadata (keys, types, exact values) -> its two wire maps, serialised


def _metadata_bytes(m: dict) -> bytes:
    """A ``Hit`` holding only ``metadata`` (text form) and ``typed_metadata`` of ``m``, serialised
    once per distinct metadata (corpora repeat a few: filling two protobuf maps costs ~12 us a
    hit, merging their bytes ~1 us). Keyed by type and ``repr`` (``True`` / ``1`` / ``1.0`` and
    ``0.0`` / ``-0.0`` differ on the wire); at most 4,096 kept.
    :raises InvalidArgument: as :func:`metadata_value`."""
    key = tuple((k, type(v), repr(v)) for k, v in m.items())
    b = _META.get(key)
    if b is None:
        b = oprag_pb2.Hit(metadata={k: md.as_text(v) for k, v in m.items()},
                          typed_metadata={k: metadata_value(v) for k, v in m.items()}).SerializeToString()
        if len(_META) >= 4096:
            _META.clear()
        _META[key] = b
    return b


def metadata_value(v: md.Value, key: str = "", what: str = "metadata") -> oprag_pb2.MetadataValue:
    """The wire ``MetadataValue`` of one typed metadata value (a filter's: ``what`` ``"metadata filter"``).

    :raises InvalidArgument: not a str/int/float/bool, an integer outside signed 64-bit, NaN
        or infinity (:func:`..metadata.check_value`); the message starts ``{what} 'key': ``.
    """
    try:
        return oprag_pb2.MetadataValue(**md.wire_kind(md.check_value(key, v)))
    except ValueError as exc:
        raise InvalidArgument(what + str(exc).removeprefix("metadata")) from exc


def documents(job: QueryJob) -> list[oprag_pb2.DocumentHit]:
    """The job's ranked documents as wire ``DocumentHit`` messages ([] for a chunk-level request)."""
    return [oprag_pb2.DocumentHit(doc_id=d.doc_id, title=d.title, score=d.score, hits=_hits(d.hits))
            for d in job.documents or ()]


def sources(job: QueryJob) -> list[oprag_pb2.Source]:
    """Provenance of the sources placed in the prompt ([] when no prompt was built)."""
    p = job.payload
    return [
        oprag_pb2.Source(number=s.number, chunk_id=s.chunk_id, doc_id=s.doc_id, title=s.title, tokens=s.tokens,
                         truncated=s.truncated)
        for s in (p.sources if p else [])
    ]


def trace(job: QueryJob, include: bool) -> oprag_pb2.Trace | None:
    """The executed plan as a wire ``Trace`` when the request asked for it (``include_trace``)."""
    if not include:
        return None
    return oprag_pb2.Trace(stages=[oprag_pb2.StageTrace(**st) for st in job.trace()])


def _memory_text(job: QueryJob) -> str:
    """The memory context shown to the caller: only when memory changed the retrieval."""
    return job.memory.memory_text if job.memory and job.memory.used else ""


def memory_fields(job: QueryJob) -> dict:
    """``memory_context``, ``memory_used`` and ``resolved_query`` of a response (gRPC and HTTP)."""
    return {"memory_context": _memory_text(job), "memory_used": bool(job.memory and job.memory.used),
            "resolved_query": job.resolved_query}


def _prompt_tokens(job: QueryJob) -> int:
    return job.payload.prompt_tokens if job.payload else 0


def query_response(job: QueryJob, *, include_trace: bool, has_generator: bool) -> oprag_pb2.QueryResponse:
    """``QueryResponse`` of a finished job (answer "" when the server has no generator; the
    job's ``finish_reason`` is then :data:`NO_GENERATOR`, set by :func:`query_job`)."""
    return oprag_pb2.QueryResponse(
        answer=job.answer if has_generator else "", hits=hits(job), timings_ms=job.timings_ms,
        request_id=job.request_id, sources=sources(job), prompt_tokens=_prompt_tokens(job),
        completion_tokens=job.completion_tokens,
        finish_reason=job.finish_reason, **memory_fields(job),
        retrieval=info(job), trace=trace(job, include_trace), ttft_ms=job.ttft_ms, documents=documents(job),
    )


def retrieve_response(job: QueryJob, *, include_trace: bool) -> oprag_pb2.RetrieveResponse:
    """``RetrieveResponse`` of a finished retrieval-only job."""
    resp = oprag_pb2.RetrieveResponse(timings_ms=job.timings_ms, request_id=job.request_id, **memory_fields(job),
                                      retrieval=info(job), trace=trace(job, include_trace), documents=documents(job))
    _hits(job.hits, resp.hits)
    return resp


def stream_event(kind: str, val: Any) -> oprag_pb2.QueryEvent:
    """A ``QueryEvent`` from one item of ``QueryJob.events``: ``("text", str)`` -> text,
    ``("sources", job)`` -> sources (hits, sources, retrieval info, memory context, documents)."""
    if kind == "text":
        return oprag_pb2.QueryEvent(text=val)
    return oprag_pb2.QueryEvent(sources=oprag_pb2.SourcesEvent(
        request_id=val.request_id, hits=hits(val), sources=sources(val), retrieval=info(val),
        **memory_fields(val), documents=documents(val),
    ))


def done_event(job: QueryJob, *, include_trace: bool) -> oprag_pb2.QueryEvent:
    """The last ``QueryEvent`` of a stream: the full answer, timings and token counts."""
    return oprag_pb2.QueryEvent(done=oprag_pb2.DoneEvent(
        answer=job.answer, timings_ms=job.timings_ms, prompt_tokens=_prompt_tokens(job),
        completion_tokens=job.completion_tokens, finish_reason=job.finish_reason, ttft_ms=job.ttft_ms,
        trace=trace(job, include_trace),
    ))


_SHARD_FIELDS = ("shard", "documents", "chunks", "memory_records", "applied_seq")
#: ``ShardStats`` byte fields and the shard's ``nbytes`` component each one reports
BYTE_FIELDS = {"postings_bytes": "postings", "terms_bytes": "terms", "vectors_bytes": "vectors",
               "ann_bytes": "ann", "chunks_bytes": "chunks"}


def stats_response(st: dict) -> oprag_pb2.StatsResponse:
    """``StatsResponse`` from ``Runtime.stats()``: a dict with ``documents``, ``chunks``,
    ``memory_records``, ``seq``, ``embedder``, ``generator`` and ``shards`` (one dict per
    answering shard with ``shard``, ``documents``, ``chunks``, ``memory_records``, ``applied_seq``
    and ``bytes``, ``{component: bytes}``, see :data:`BYTE_FIELDS`; optional ``ann_pending``, ``merge_pending``, ``segment_unsaved`` and ``seeds_pending``)."""
    return oprag_pb2.StatsResponse(
        documents=st["documents"], chunks=st["chunks"], memory_records=st["memory_records"], seq=st["seq"],
        shards=[oprag_pb2.ShardStats(**{k: s[k] for k in _SHARD_FIELDS}, ann_pending=int(s.get("ann_pending", 0)),
                                     merge_pending=int(s.get("merge_pending", 0)),
                                     segment_unsaved_bytes=int(s.get("segment_unsaved", 0)), seeds_pending=int(s.get("seeds_pending", 0)),
                                     **{f: int(s.get("bytes", {}).get(c, 0)) for f, c in BYTE_FIELDS.items()})
                for s in st["shards"]],
        embedder=st["embedder"], generator=st["generator"], missing_shards=st.get("missing_shards", []),
    )
