"""Shared domain types of the query path: one home for what several layers pass around.

Nothing here imports another OpRAG module, so every layer (index, shards, operators, engine,
service) may import it. The wire contract (``oprag.v1``) is converted to and from these types
in ``service/convert.py`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Retrieval modes, by their wire-independent names (the one mode table of the server).
#: ``hybrid`` dense-first, ``dense``, ``lexical``, ``full_hybrid`` exact.
MODES: tuple[str, ...] = ("hybrid", "dense", "lexical", "full_hybrid")
#: Modes that fuse two ranked lists.
FUSED_MODES: frozenset[str] = frozenset({"hybrid", "full_hybrid"})
#: Fusion methods: weighted min-max and reciprocal rank fusion.
FUSIONS: tuple[str, ...] = ("minmax", "rrf")

#: The dense-first window N when neither the request nor the server configuration sets one.
DEFAULT_CANDIDATES = 256
DEFAULT_TOP_K = 5
DEFAULT_RRF_K = 60


@dataclass(frozen=True)
class RetrieveSpec:
    """What one query asks of the retrieve operator.

    :param mode: one of :data:`MODES`.
    :param fusion: ``"minmax"`` (weighted sum of min-max normalised scores) or ``"rrf"``
        (reciprocal rank fusion, Cormack et al. 2009: ``sum_l w_l / (rrf_k + rank_l)`` over the
        lists the chunk appears in).
    :param candidates: the retrieval window N: dense candidates in ``hybrid`` mode, and the
        length of each ranked list that ranks and RRF are computed over.
    :param filters: ``((key, (value, ...)), ...)``: metadata[key] must be one of the values,
        for every filter; values are typed (str, int, float, bool) and compare as
        :func:`oprag_server.metadata.match_key` says.
    :param group_by_document: document-level retrieval: ``top_k`` counts documents, each
        scored by its best chunk (MaxP); see :mod:`oprag_server.operators.group`.
    :param chunks_per_document: with ``group_by_document``, the best chunks kept per document.
    """

    mode: str = "hybrid"
    top_k: int = DEFAULT_TOP_K
    candidates: int = DEFAULT_CANDIDATES
    dense_weight: float = 0.5
    lexical_weight: float = 0.5
    fusion: str = "minmax"
    rrf_k: int = DEFAULT_RRF_K
    filters: tuple = ()
    group_by_document: bool = False
    chunks_per_document: int = 1
    ef_search: int = 0  # HNSW search beam (0 = the index's default)
    nprobe: int = 0  # IVF lists visited (0 = the index's default)


@dataclass
class Hit:
    """One ranked chunk. Scores are float: ``dense_score`` the inner product of L2-normalised
    vectors, ``lexical_score`` BM25Okapi (rank_bm25 0.2.2), ``score`` the fused score. Ranks are
    1-based positions in each list of the window (0 = not in that list)."""

    chunk_id: str
    doc_id: str
    title: str
    text: str
    score: float
    dense_score: float
    lexical_score: float
    shard: int
    metadata: dict[str, str | int | float | bool] = field(default_factory=dict)  # typed (README)
    dense_rank: int = 0
    lexical_rank: int = 0


@dataclass
class DocumentHit:
    """One ranked document of a document-level retrieval: ``score`` is the score of its best
    chunk (MaxP), ``title`` that chunk's title, ``hits`` its best chunks of the retrieval window
    in rank order (at most ``chunks_per_document``; ``hits[0]`` is the best)."""

    doc_id: str
    title: str
    score: float
    hits: list[Hit] = field(default_factory=list)


@dataclass
class RetrievalInfo:
    """What the retriever did for one query (reported in responses)."""

    mode: str
    fusion: str
    dense_weight: float
    lexical_weight: float
    rrf_k: int
    candidates: int
    # the live chunks eligible for the query (not deleted, passing the filters), summed over the
    # shards that answered: not how many were scored, as an approximate index (hnsw, ivf) scores
    # only some of them (see ef_search / nprobe); operators/group.py bounds its window by it
    chunks_searched: int = 0
    missing_shards: list[int] = field(default_factory=list)  # non-empty = partial result
    dense_index: str = ""  # flat | hnsw | ivf ("" = not reported)
    ef_search: int = 0  # the HNSW beam used (largest over shards; 0 = none)
    nprobe: int = 0  # the IVF lists visited (largest over shards; 0 = none)
    # dense-first hybrid, min-max (operators/hybrid.py): the BM25 list length per shard of the
    # last round, whether the threshold bound certified the top-k, and the widening rounds
    lexical_candidates: int = 0
    certified: bool = False
    widen_rounds: int = 0

    @property
    def exact(self) -> bool:
        """The hits are the mode's exact ranking (``RetrievalInfo.exact`` in the proto): every shard answered, and
        FULL_HYBRID or LEXICAL, or no shard searched an approximate index (``ef_search`` and ``nprobe`` 0) and DENSE,
        or HYBRID with the bound's ``certified`` (trial41: certified IVF replies differed from FULL_HYBRID's)."""
        approx = bool(self.ef_search or self.nprobe)
        return not self.missing_shards and (self.mode in ("full_hybrid", "lexical") or not approx and (
            self.mode == "dense" or self.mode == "hybrid" and bool(self.certified)))


@dataclass
class MemoryContext:
    """What the memory operator contributed to one query."""

    retrieval_text: str  # the text that is embedded and analysed for retrieval
    memory_text: str  # prior-turn text shown to the caller (and the prompt), "" if none
    turns: int
    context_text: str = ""  # the question with the session's subject: a second retrieval row ("" = none)
    used: bool = False  # memory changed the retrieval (the fused ranking differs from the question's)
    session_vector: object = None  # float32[D] unit: the session's stored turn vectors, decayed (None = embed context_text)


@dataclass
class SourceRef:
    """Provenance of one source placed in a prompt (``[number]`` in the prompt text)."""

    number: int
    chunk_id: str
    doc_id: str
    title: str
    tokens: int
    truncated: bool


@dataclass
class ContextPayload:
    """:param prompt: the full model input (chat template applied).
    :param prompt_tokens: tokens of ``prompt`` (<= the budget).
    :param sources: provenance of every source placed, in prompt order.
    :param messages: the same prompt as OpenAI chat turns (system, user), sent to an engine."""

    prompt: str
    prompt_tokens: int
    sources: list[SourceRef] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)  # the same prompt as chat turns (engines)
