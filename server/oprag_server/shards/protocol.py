"""The shard protocol: every operation a frontend can ask of a shard, with one typed request and one typed
reply per operation. Both sides import this module (the shard worker and the frontend: ``operators/retrieve.py``,
``operators/memory.py``, ``engine/ingest.py``, ``engine/commit.py``), so a field is named in one place.

A transport carries ``(request_id, Op, request)`` to a shard and ``(request_id, ok, reply or error text)`` back
(see :mod:`oprag_server.shards.transport`). Every type is a ``slots`` dataclass and pickles as its fields, except
``Candidates`` and ``FetchReply``: one buffer and joined strings (:mod:`.packed`). Scores are float64, slots
int64, vectors float32. Imports numpy only.
"""

from __future__ import annotations

import enum
from dataclasses import field

import numpy as np

from .message import message


class Op(enum.Enum):
    """Shard operations. The value is the name used in logs and errors."""

    SEARCH = "search"  # candidate generation: dense top-n (+ BM25 of those) or BM25 top-n
    EXACT_MINMAX = "exact_minmax"  # exact min-max hybrid: ranges, rank lists, the chunks that can be top-k
    EXACT_LISTS = "exact_lists"  # exact rank fusion: local dense and BM25 top-n lists, one round
    FETCH = "fetch"  # stored fields of hit slots
    FIELDS = "fields"  # the fields a SEARCH sent with ``fields_later`` left out (asked right behind it)
    REUSE = "reuse"  # stored vectors of documents by content hash (re-ingest embeds only changes)
    STAGE = "stage"  # hold a bulk batch of an ingest stream
    PREPARE = "prepare"  # two-phase commit, phase 1: write-ahead log (fsync), do not apply
    APPLY = "apply"  # two-phase commit, phase 2: apply a prepared transaction
    ABORT = "abort"  # drop a transaction's staged batches or prepared record
    PROMOTE = "promote"  # memory: append one turn record of a session
    MEMORY_LOOKUP = "memory_lookup"  # memory: recent turns of sessions
    MEMORY_CLEAR = "memory_clear"  # memory: drop a session's records
    STATS = "stats"  # counts (+ full BM25 statistics on request)
    SNAPSHOT = "snapshot"  # write a snapshot, truncate the write-ahead log
    SHUTDOWN = "shutdown"  # optionally snapshot, then exit the run loop


# ---------------------------------------------------------------------------- shared parts
@message
class QueryBatch:
    """B queries as one shard sees them.

    :param q: float32[B, D] L2-normalised query vectors.
    :param terms: B analysed token lists.
    :param idf: B float64[T_i] idf arrays aligned with ``terms`` (corpus-global, from the frontend).
    :param avgdl: corpus-global average document length (tokens). :param k1: BM25 k1; :param b: BM25 b.
    :param filters: None, or B filter lists of ``(key, values)`` (set membership, all must hold).
    """

    q: np.ndarray
    terms: list[list[str]]
    idf: list[np.ndarray]
    avgdl: float
    k1: float
    b: float
    filters: list | None = None


@message
class Candidates:
    """One query's candidates on one shard, as parallel arrays of length M: ``slots`` int64 (shard-local),
    ``chunk_ids`` (a list, or a :class:`.packed.PackedStrs` once pickled), ``dense`` float64 inner products,
    ``lexical`` float64 BM25 scores."""

    slots: np.ndarray
    chunk_ids: list[str]
    dense: np.ndarray
    lexical: np.ndarray


# ---------------------------------------------------------------------------- search
@message
class FieldsRequest:  # the fields of the SEARCH sent with ``fields_later`` = ``token`` (Op.FIELDS)
    token: int


@message
class FieldsReply:  # per query the FetchReply that search's reply would have had; None: not held (fetch)
    fields: list | None


@message
class FetchRequest:
    slots: list[int]  # M slots (a list: M is top-k sized, and a list pickles faster than an array)


@message
class FetchReply:
    """Stored fields aligned with the slots; ``found[i]`` False: deleted (strings empty)."""

    found: list[bool]
    doc_ids: list[str]
    titles: list[str]
    texts: list[str]
    metadata: list[str]
    slots: list[int] | None = None  # the slots (set when carried by a search or fuse reply)


@message
class SearchRequest:
    """``mode`` in {"hybrid", "dense", "lexical"}; ``n`` local candidates per query; ``fetch_k`` > 0: the reply carries
    the fields of the candidates that can be in a top-k (:func:`~oprag_server.index.fusion.skyband`): usually no FETCH
    round trip follows; ``m`` > 0 (hybrid): also the exact BM25 top-m (the threshold bound, operators/retrieve.py);
    ``weights``: per query ``(dense, lexical)`` of its min-max fusion or None (fewer fields carried); ``fields_later``
    > 0: no fields in the reply; the FIELDS request with this token gets them."""

    batch: QueryBatch
    mode: str
    n: int
    ef_search: int = 0  # approximate dense search knobs (0 = the index's default)
    nprobe: int = 0
    fetch_k: int = 0
    m: int = 0
    weights: list | None = None
    fields_later: int = 0


@message
class SearchReply:
    """Per query i: ``candidates[i]``; ``eligible[i]`` chunks eligible here; ``dense_min[i]`` the dense minimum
    estimated from a fixed vector sample (+inf when not computed: lexical mode or an empty shard; exact over the
    eligible rows with a flat index). Per-query scalars are lists. ``m`` > 0: ``lexical[i]`` the BM25 top-m of the
    eligible chunks with a BM25 score != 0 by (BM25 desc, canonical dense desc, chunk id asc), ``listed[i]`` how
    many there are, ``tied[i]`` whether unlisted ones share the list's last score; ``lexical_min[i]`` the lowest
    BM25 score of the eligible chunks (0.0 when some scores 0: exact mode's; not known from a shorter list)."""

    candidates: list[Candidates]
    eligible: list[int]
    dense_min: list[float]
    dense_index: str = "flat"  # the shard's dense index kind
    knobs: dict | None = None  # {"ef_search" | "nprobe": value used}, None when none was
    fields: list[FetchReply] | None = None  # fetch_k > 0: per query, fields of some candidates
    lexical: list[Candidates] | None = None
    listed: list[int] | None = None
    lexical_min: list[float] | None = None
    tied: list[bool] | None = None


@message
class ExactMinmaxRequest:
    """Exact min-max hybrid (one round): per query ``k[i]`` results, the fusion's ``weights[i]``; ``n``-long rank lists."""

    batch: QueryBatch
    k: list[int]
    n: int
    weights: list[tuple[float, float]]


@message
class ExactMinmaxReply:
    """Per query (lists of length B): chunks ``eligible``; the local score ranges ``dense_min``, ``dense_max``
    (canonical), ``lexical_min``, ``lexical_max`` (0.0 when none eligible); ``band``: every local chunk that can be
    in the top-k whatever the corpus-wide ranges, with canonical dense scores (``ExactMixin._band``); the local
    top-n dense and BM25 (!= 0 only) lists (for ranks); ``fields``: stored fields of the band's top-k fused with the
    local ranges."""

    eligible: list[int]
    dense_min: list[float]
    dense_max: list[float]
    lexical_min: list[float]
    lexical_max: list[float]
    band: list[Candidates]
    dense_lists: list[Candidates]
    lexical_lists: list[Candidates]
    fields: list[FetchReply] | None = None


@message
class ExactListsRequest:
    batch: QueryBatch
    n: int


@message
class ExactListsReply:
    """Per query: ``eligible`` chunks; local top-n dense and BM25 (> 0 only) lists."""

    eligible: list[int]
    dense_lists: list[Candidates]
    lexical_lists: list[Candidates]


# ---------------------------------------------------------------------------- writes
@message
class ReuseRequest:
    """Stored vectors of the documents ``doc_ids`` (this shard owns them), and of any chunk here whose content hash is
    in ``content_hashes`` (identical text, identical vector)."""

    doc_ids: list[str]
    content_hashes: list[str] = field(default_factory=list)


@message
class ReuseReply:
    """``{doc_id: {content_hash: float32[D] vector}}`` for each stored document asked for."""

    vectors: dict[str, dict[str, np.ndarray]]
    by_hash: dict[str, np.ndarray] = field(default_factory=dict)  # content hash -> float32[D]


@message
class StageRequest:
    txn: str
    ipc: bytes  # Arrow IPC stream of one batch (schema records.chunk_schema)


@message
class StageReply:
    staged: int  # rows staged under the transaction so far


@message
class PrepareRequest:
    """``kind`` "upsert" (the batches staged under ``txn``) or "delete" (``doc_ids``)."""

    txn: str
    seq: int
    kind: str
    doc_ids: list[str] = field(default_factory=list)


@message
class PrepareReply:
    prepared: bool = True


@message
class ApplyRequest:
    txn: str


@message
class ApplyReply:
    """What applying a transaction changed on one shard.

    :param doc_ids: documents written (upsert), sorted.
    :param added: chunks added; :param removed: chunks removed (replaced or deleted).
    :param replaced_docs: stored documents replaced by a new version (upsert).
    :param deleted_docs: documents deleted (delete).
    :param delta: BM25 statistics delta ``(n, total length, {term: df})`` for the frontend.
    """

    doc_ids: list[str] = field(default_factory=list)
    added: int = 0
    removed: int = 0
    replaced_docs: int = 0
    deleted_docs: int = 0
    delta: tuple = (0, 0, {})


@message
class AbortRequest:
    txn: str


@message
class AbortReply:
    dropped: int  # staged rows dropped


# ---------------------------------------------------------------------------- memory
@message
class PromoteRequest:
    """A turn record (``vector`` f32[D]), bounds ``max_turns``/session, ``max_total``/shard, idle ``ttl_s`` (0: none)."""

    session_id: str
    question: str
    summary: str
    chunk_ids: list[str]
    titles: list[str]
    vector: np.ndarray
    max_turns: int
    max_total: int = 0
    ttl_s: float = 0.0
    resolved: str = ""  # the retrieval text the turn was answered with (memory-resolved)
    doc_ids: list[str] = field(default_factory=list)  # the turn's subject: its sources' documents
    terms: list[str] = field(default_factory=list)  # salient analysed terms of the turn's subject
    started: float = 0.0  # when its request arrived (frontend time.time() s; 0: unknown, always recorded)


@message
class PromoteReply:
    records: int  # the session's records after the write


@message
class MemoryLookupRequest:
    session_ids: list[str]
    k: int
    ttl_s: float = 0.0


@message
class MemoryTurn:
    turn: int
    question: str
    summary: str
    chunk_ids: list[str]
    titles: list[str]
    resolved: str = ""
    doc_ids: list[str] = field(default_factory=list)
    terms: list[str] = field(default_factory=list)
    vector: np.ndarray | None = None  # float32[D]: the vector the turn was retrieved with (its resolved query)


@message
class MemoryLookupReply:
    """Per session asked for: its most recent turns, newest first."""

    turns: list[list[MemoryTurn]]


@message
class MemoryClearRequest:
    session_id: str
    at: float = 0.0  # when the clear was asked (frontend time.time() s; 0: the shard's clock)


@message
class MemoryClearReply:
    removed: int


# ---------------------------------------------------------------------------- admin
@message
class StatsRequest:
    lexical: bool = False  # also the full BM25 statistics (whole vocabulary)


@message
class StatsReply:
    """Counts of one shard; ``lexical`` ``(N, total length, {term: df})`` when asked for;
    ``replayed`` write-ahead log records (READY message only); ``nbytes`` {component: bytes}."""

    shard: int
    documents: int
    chunks: int
    memory_records: int
    applied_seq: int
    lexical: tuple | None = None
    replayed: int = 0
    nbytes: dict | None = None
    ann_pending: int = 0  # HNSW vectors not in the graph yet (deferred inserts), + live ones a background rebuild holds
    merge_pending: int = 0  # BM25 delta postings a merge folds or an idle merge will (PostingsIndex.merge_pending)
    segment_unsaved: int = 0  # bytes of BM25 segment in anonymous memory no snapshot holds (unsaved_nbytes)
    seeds_pending: int = 0  # HNSW vectors a thread is making dense-minimum seeds for (low_seeds_state.pending)
    ann_unsaved: int = 0  # `ann` bytes an idle step changed (compaction, renumbering, seeds) that no snapshot holds


@message
class SnapshotRequest:  # (no field)
    pass


@message
class SnapshotReply:
    written: bool
    chunks: int = 0


@message
class ShutdownRequest:
    snapshot: bool = True


@message
class ShutdownReply:
    snapshot: SnapshotReply | None = None


#: The request and reply type of every op (the worker checks requests against it).
TYPES: dict[Op, tuple[type, type]] = {
    Op.SEARCH: (SearchRequest, SearchReply),
    Op.EXACT_MINMAX: (ExactMinmaxRequest, ExactMinmaxReply),
    Op.EXACT_LISTS: (ExactListsRequest, ExactListsReply),
    Op.FETCH: (FetchRequest, FetchReply),
    Op.FIELDS: (FieldsRequest, FieldsReply),
    Op.REUSE: (ReuseRequest, ReuseReply),
    Op.STAGE: (StageRequest, StageReply),
    Op.PREPARE: (PrepareRequest, PrepareReply),
    Op.APPLY: (ApplyRequest, ApplyReply),
    Op.ABORT: (AbortRequest, AbortReply),
    Op.PROMOTE: (PromoteRequest, PromoteReply),
    Op.MEMORY_LOOKUP: (MemoryLookupRequest, MemoryLookupReply),
    Op.MEMORY_CLEAR: (MemoryClearRequest, MemoryClearReply),
    Op.STATS: (StatsRequest, StatsReply),
    Op.SNAPSHOT: (SnapshotRequest, SnapshotReply),
    Op.SHUTDOWN: (ShutdownRequest, ShutdownReply),
}


class UnknownOp(ValueError):
    """A request named an op this shard does not serve (or carried the wrong request type)."""


from . import packed  # noqa: E402,F401 - installs the compact pickled form of Candidates and FetchReply
