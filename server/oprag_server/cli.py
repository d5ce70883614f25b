"""``oprag serve`` / ``python -m oprag_server`` / ``oprag-server``: run the service.

Every option's default is read from the config dataclasses (:mod:`oprag_server.config`), so
the CLI, the servicer and the tests share one set of numbers. An option's ``dest`` is
``"<section>.<field>"`` (``ServerConfig`` field, or field of the sub-config ``section``);
:func:`config_from_args` builds the :class:`ServerConfig` from those alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .config import DenseConfig, ServerConfig

# (flag, section ("" = ServerConfig itself), field, help); the type comes from the default.
_OPTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("--host", "", "host", "address of the gRPC port"),
    ("--port", "", "port", "gRPC port (0 = any free port)"),
    ("--metrics-host", "", "metrics_host", "address of /metrics (default: --host)"),
    ("--metrics-port", "", "metrics_port", "Prometheus /metrics port"),
    ("--http-port", "", "http_port", "OpenAI-compatible HTTP API port (same host, tokens and TLS as gRPC); 0 = off"),
    ("--otlp-endpoint", "", "otlp_endpoint",
     "export each request's executed plan as OpenTelemetry spans to this OTLP/gRPC endpoint (extra 'otel')"),
    ("--data-dir", "", "data_dir", "shard snapshots and write-ahead logs"),
    ("--storage-uri", "", "storage_uri",
     "also keep shard snapshots and write-ahead logs as objects here (s3://bucket/prefix, gs://bucket/prefix, "
     "file:///abs/path; pyarrow.fs): a shard starting on a node with an empty --data-dir recovers from it"),
    ("--storage-takeover", "", "storage_takeover",
     "start even though another server holds the --storage-uri owner lease (that server is fenced: it refuses "
     "writes from its next renewal on)"),
    ("--shards", "", "shards", "shard processes"),
    ("--replicas", "", "replicas",
     "processes per shard: writes go to every live replica, reads to the least busy; with 2+ one replica down "
     "fails no request"),
    ("--shard-workers", "", "shard_workers",
     "'process': each shard in a process of its own (a shard that dies is restarted alone); 'thread': shards "
     "on threads of the server process (no pickling or pipes: lower latency for small deployments; a shard "
     "fault ends the whole server; no --replicas or --ray-address); 'inline': shard 0 in the server process, "
     "its one-query searches run on the request's own thread while the other shards' processes search theirs "
     "(the lowest c = 1 latency of small deployments in bench/RESULTS.md; as 'thread' for faults)"),
    ("--event-loop", "", "event_loop",
     "the frontend's event loop: 'asyncio' (the standard library's) or 'uvloop' (libuv, extra 'uvloop': the same "
     "replies, ~0.3 ms less frontend CPU per Retrieve in bench/RESULTS.md)"),
    ("--cpu-latency-us", "", "cpu_latency_us",
     "hold a Linux CPU latency QoS request of this many microseconds while serving (/dev/cpu_dma_latency; needs "
     "root or write access to it): idle CPUs then wake within it (0: they poll instead of halting), which cut the "
     "12K-chunk Retrieve p50 on a 2-CPU VM in bench/RESULTS.md; idle CPUs spin meanwhile, machine-wide. -1 = off"),
    ("--embedder", "embed", "model", "'minilm' or a local encoder directory"),
    ("--generator", "generate", "model",
     "'smollm2' (= 'builtin'), a local HF causal LM directory, 'none', 'openai' (an OpenAI-compatible engine), "
     "or 'transformers-serve' (a managed local engine; extra 'engine')"),
    ("--generator-url", "generate", "url", "OpenAI-compatible engine base URL, e.g. http://HOST:PORT/v1"),
    ("--generator-model", "generate", "engine_model", "the engine's model name (a local directory: exact token counts)"),
    ("--generator-api-key-file", "generate", "api_key_file", "engine API key file (else env OPRAG_GENERATOR_API_KEY)"),
    ("--generator-tls-verify", "generate", "tls_verify", "'true', 'false' or a CA bundle path for https engines"),
    ("--generator-timeout-s", "generate", "timeout_s", "per-request engine limit (DEADLINE_EXCEEDED beyond)"),
    ("--generator-max-inflight", "generate", "max_inflight", "requests given to the engine at once"),
    ("--generator-continuous-batching", "generate", "continuous_batching",
     "transformers-serve: run the engine with --continuous-batching"),
    ("--generator-start-timeout-s", "generate", "engine_start_timeout_s", "transformers-serve: wait for /health"),
    ("--no-generator-io-thread", "generate", "io_thread",
     "baseline: the engine's HTTP streams on the frontend's event loop instead of their own thread"),
    ("--embed-compile", "embed", "compile", "run the embedder through torch.compile with fixed bucket shapes"),
    ("--chunk-size", "chunking", "size", "largest chunk in embedder tokens incl. special tokens (capped at its window)"),
    ("--chunk-overlap", "chunking", "overlap", "tokens consecutive chunks may share, at most"),
    ("--candidates", "retrieval", "candidates", "retrieval window N: the dense list of rrf and of grouped "
     "requests, and the window of each hit's dense/lexical rank"),
    ("--hybrid-candidates", "retrieval", "hybrid_candidates",
     "flat index: first-round dense top-N of a min-max hybrid request that leaves candidates 0: max(this, 4 * top_k); the bound "
     "certifies its top-k whatever N and widens x4 when it cannot (0: --candidates)"),
    ("--dense-index", "dense", "kind", "dense index of each shard: flat (exact scan), hnsw or ivf (approximate "
     "candidates; scores stay exact; full_hybrid always scans every chunk)"),
    ("--hnsw-m", "dense", "hnsw_m", "HNSW graph degree M, 2 to 512"),
    ("--ef-construction", "dense", "ef_construction", "HNSW build beam width"),
    ("--ef-search", "dense", "ef_search", "default HNSW search beam (a request's ef_search overrides it)"),
    ("--hybrid-ef-search", "dense", "hybrid_ef_search", "HNSW beam of a hybrid request that leaves ef_search 0, on a "
     "shard where a query term occurs, when below --ef-search (0: --ef-search; a shard where no query term occurs "
     "keeps --ef-search)"),
    ("--nprobe", "dense", "nprobe", "default IVF lists visited per query (a request's nprobe overrides it)"),
    ("--ivf-train-min", "dense", "train_min", "vectors a shard holds before its IVF is trained (exact before; at least 39)"),
    ("--ann-tail", "dense", "ann_tail", "HNSW: acknowledged vectors a shard may hold outside the graph (found by an "
     "exact scan meanwhile; inserted between requests); past it an ingest inserts them itself. 0: at every ingest"),
    ("--ann-check", "dense", "ann_check", "HNSW / IVF: sampled chunks per shard a dense list is checked against; a "
     "list that one of them proves incomplete is searched again with a 4x beam (up to 8192) or 4x the lists "
     "(up to all), then exactly (0: no check)"),
    ("--hnsw-layout-min", "dense", "layout_min", "HNSW: vectors a shard's graph holds before its nodes are renumbered "
     "for memory locality, between requests once writes are quiet, again each time the graph doubled and after a "
     "compaction (0: never)"),
    ("--lexical-candidates", "retrieval", "lexical_candidates",
     "BM25 top-M per shard beside the dense top-N in dense-first hybrid (0: max(4 * top_k, 64))"),
    ("--widen-rounds", "retrieval", "widen_rounds",
     "dense-first hybrid: times N and M grow x4 when the threshold bound does not certify the top-k"),
    ("--monitor-fraction", "retrieval", "monitor_fraction",
     "share of dense-first queries re-run in exact mode to export pruning Recall@k"),
    ("--max-batch", "batch", "max_batch", "queries per scheduler batch"),
    ("--max-wait-ms", "batch", "max_wait_ms", "how long a batch waits for company"),
    ("--queue-capacity", "batch", "queue_capacity", "unfinished queries admitted"),
    ("--max-queue-delay-ms", "batch", "max_queue_delay_ms",
     "refuse queries (RESOURCE_EXHAUSTED) when the estimated queueing delay exceeds this; 0 = off"),
    ("--ingest-embed-slice-ms", "batch", "ingest_embed_slice_ms",
     "with --no-embed-query-thread: while queries are active, ingest embedding runs in slices of about this long"),
    ("--no-embed-query-thread", "batch", "embed_query_thread",
     "query embeddings wait for the ingest batch in flight instead of running beside it"),
    ("--no-overlap", "batch", "overlap", "run the stages of a batch strictly in sequence"),
    ("--ingest-barriers", "ingest", "barriers", "baseline: each ingest stage finishes before the next starts"),
    ("--upsert-batch", "ingest", "upsert_batch", "chunks per coalesced bulk write to a shard"),
    ("--max-ingest-streams", "ingest", "max_concurrent_streams",
     "Ingest streams run at once (each holds a slot from its first message to its commit); further ones wait"),
    ("--ingest-slot-wait-s", "ingest", "slot_wait_s",
     "seconds a further Ingest stream waits for a slot (at most until shortly before its deadline), then it is "
     "refused RESOURCE_EXHAUSTED, nothing stored; 0: refused at once"),
    ("--ingest-idle-s", "ingest", "idle_s",
     "an Ingest stream that sends no message for this many seconds is aborted (ABORTED, nothing of it stored) and "
     "frees its slot; 0: no limit"),
    ("--context-tokens", "generate", "context_tokens", "prompt + answer tokens (prompt budget = this minus max_new_tokens)"),
    ("--max-new-tokens", "generate", "default_max_new_tokens", "default new tokens per answer"),
    ("--answer-without-sources", "generate", "answer_without_sources",
     "'refuse': a query whose prompt has no sources (empty store, nothing retrieved, a filter matching nothing) "
     "is not generated: empty answer, finish_reason 'no_sources'; 'generate': the generator answers without "
     "evidence (the former behaviour)"),
    ("--memory-condense", "memory", "condense",
     "with an engine generator (openai, transformers-serve; with another the start is refused): one short "
     "generation rewrites a session's follow-up into a standalone question, which becomes its session-context "
     "retrieval row"),
    ("--memory-condense-tokens", "memory", "condense_tokens", "new tokens of the condense generation"),
    ("--memory-condense-timeout-s", "memory", "condense_timeout_s",
     "past this the follow-up keeps the default session context (the engine's answer is dropped)"),
    ("--memory-encode-context", "memory", "encode_context",
     "embed the session-context text as a second encoder row instead of reusing the stored turn vectors"),
    ("--memory-max-turns", "memory", "max_turns_per_session", "turns a session keeps; recording one more drops its oldest"),
    ("--memory-ttl-s", "memory", "ttl_s",
     "seconds a session may stay idle (no turn recorded) before its turns are no longer looked up; they are dropped at "
     "the shard's next recorded turn, its own or another session's (0: never; otherwise at least 1)"),
    ("--memory-max-records", "memory", "max_records_total",
     "memory records a shard holds at most; past it the least recently active other sessions lose their oldest turns "
     "first, then the writing session its older ones (its new turn stays)"),
    ("--stem", "bm25", "stem", "English stemming in the BM25 analyzer (snowballstemmer)"),
    ("--tls-cert", "security", "tls_cert", "PEM certificate: serve gRPC over TLS"),
    ("--tls-key", "security", "tls_key", "PEM private key of --tls-cert"),
    ("--tls-client-ca", "security", "tls_client_ca", "require client certificates signed by this CA"),
    ("--tokens-file", "security", "tokens_file",
     "bearer tokens, one per line (also OPRAG_TOKENS=tok1,tok2); then every RPC but health needs one"),
    ("--ray-address", "ray", "address",
     "place shards as Ray actors: 'local', 'auto' or a cluster address (extra 'ray'); default: local processes"),
    ("--ray-strategy", "ray", "strategy", "placement group strategy of the shard bundles"),
    ("--ray-max-restarts", "ray", "max_restarts", "Ray restarts of a shard actor (-1 = unlimited)"),
    ("--ray-shard-cpus", "ray", "shard_cpus", "CPUs reserved per shard actor"),
    ("--ray-channel", "ray", "channel", "'direct': a TCP connection to each shard actor; 'actor': Ray actor calls"),
    ("--ray-embed-actors", "ray", "embed_actors",
     "embedding workers for bulk ingest as Ray actors: -1 = one per node, 0 = embed in the frontend"),
    ("--ray-embed-cpus", "ray", "embed_cpus", "CPUs reserved per embedding actor"),
    ("--ray-embed-gpus", "ray", "embed_gpus",
     "'auto': one embedding actor per GPU the Ray cluster reports (encoder on cuda, bfloat16), CPU actors when "
     "there is none; 0 = CPU actors only; N = N actors with one GPU each"),
    ("--shutdown-grace", "", "shutdown_grace_s", "seconds SIGTERM waits for in-flight requests"),
    ("--snapshot-interval-s", "", "snapshot_interval_s",
     "seconds between checks of the periodic snapshot (taken when a write came since the last one; at least 9x "
     "the last snapshot's time apart)"),
)
_PATH_FIELDS = {"data_dir", "tls_cert", "tls_key", "tls_client_ca", "tokens_file", "api_key_file"}


def _field(section: str, name: str) -> dataclasses.Field:
    """The dataclass field ``name`` of ``ServerConfig`` (section "") or of its sub-config ``section``."""
    cls = ServerConfig
    if section:
        cls = dataclasses.fields(ServerConfig)[[f.name for f in dataclasses.fields(ServerConfig)].index(section)]
        cls = cls.default_factory
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def field_default(section: str, name: str) -> Any:
    """The declared default of a config field (see :func:`_field`)."""
    f = _field(section, name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _add_option(p: argparse.ArgumentParser, flag: str, section: str, name: str, help_: str) -> None:
    """Add one option; a flag or an optional value leaves the namespace without it when not
    given (``argparse.SUPPRESS``), so the config field keeps its own default."""
    default, kw = field_default(section, name), {"dest": f"{section}.{name}", "help": help_}
    if isinstance(default, bool):  # --x sets a False default; --no-x clears a True one
        action = "store_false" if flag.startswith("--no-") else "store_true"
        assert default == (action == "store_false"), flag
        p.add_argument(flag, action=action, default=argparse.SUPPRESS, **kw)
        return
    kw["metavar"] = flag[2:].upper().replace("-", "_")
    kw["type"] = Path if name in _PATH_FIELDS else str if default is None else type(default)
    # an optional value (metrics_host, TLS files) without a default is left out when not given
    p.add_argument(flag, default=argparse.SUPPRESS if default is None else default, **kw)


def build_parser(prog: str = "oprag serve") -> argparse.ArgumentParser:
    """The ``serve`` options (defaults from the config dataclasses, shown in ``--help``)."""
    p = argparse.ArgumentParser(prog=prog, description="Run the OpRAG service.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag, section, name, help_ in _OPTIONS:
        _add_option(p, flag, section, name, help_)
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="logging level of the server (case-insensitive)")
    return p


#: the --dense-index kinds each index option applies to
ANN_OPTIONS = {"hnsw_m": ("hnsw",), "ef_construction": ("hnsw",), "ef_search": ("hnsw",), "hybrid_ef_search": ("hnsw",),
               "ann_tail": ("hnsw",), "layout_min": ("hnsw",), "nprobe": ("ivf",), "train_min": ("ivf",), "ann_check": ("hnsw", "ivf")}


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    """:class:`ServerConfig` from parsed options: fields without an option keep their defaults.

    :raises ValueError: a value out of range (from the dataclasses' checks).
    """
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for dest, value in vars(a).items():
        if "." not in dest:
            continue
        section, name = dest.split(".", 1)
        (sections.setdefault(section, {}) if section else top)[name] = value
    from .index.ann import IVF_TRAIN_FLOOR  # noqa: PLC0415

    train_min = sections.get("dense", {}).get("train_min")  # (before the dataclass's own ">= 1": trial37 #6)
    if train_min is not None and train_min < IVF_TRAIN_FLOOR:  # (below it FAISS printed a warning at every training)
        raise ValueError(f"--ivf-train-min must be at least {IVF_TRAIN_FLOOR}, got {train_min}: FAISS's k-means "
                         f"wants {IVF_TRAIN_FLOOR} training vectors per IVF list (a shard searches exactly until then)")
    for section, kw in [*sections.items(), ("", None)]:  # (each section's dataclass, then ServerConfig itself)
        try:
            if section:
                top[section] = _field("", section).default_factory(**kw)
            else:
                cfg = ServerConfig(**top)
        except ValueError as exc:  # the dataclass names its field: name the option instead
            msg = str(exc)  # (the field's name, or the flag's words: "dense index must ..."): said as the flag, as
            hit = next(((f, w) for f, sec, name, _ in _OPTIONS if sec == section for w in (name, f[2:].replace("-", " "))
                        if msg.startswith(f"{w} ")), None)  # "--chunk-size must be at least 1" (trial38b #6, trial39)
            raise ValueError(msg if hit is None else hit[0] + msg[len(hit[1]):].replace(f" ({hit[0]})", "")) from None
    unused = [(f, name) for f, sec, name, _ in _OPTIONS if sec == "dense" and name in ANN_OPTIONS  # trial37 #7
              and getattr(cfg.dense, name) != getattr(DenseConfig, name) and cfg.dense.kind not in ANN_OPTIONS[name]]
    if unused:
        logging.getLogger("oprag").warning("not used with --dense-index %s: %s", cfg.dense.kind, "; ".join(
            f"{f} (applies to {' / '.join(ANN_OPTIONS[name])})" for f, name in unused))
    d = cfg.dense
    if d.kind == "hnsw" and d.hybrid_ef_search >= d.ef_search and d.hybrid_ef_search != DenseConfig.hybrid_ef_search:
        # (trial46 #3: a value given and ignored, silently)
        logging.getLogger("oprag").warning("--hybrid-ef-search %d is not below --ef-search %d: hybrid requests search "
                                           "with --ef-search (%d)", d.hybrid_ef_search, d.ef_search, d.ef_search)
    if cfg.cpu_latency_us != -1:  # its range (ValueError); app.serve checks it again when it holds the request
        from .cpu_latency import CpuLatencyRequest  # noqa: PLC0415

        CpuLatencyRequest(cfg.cpu_latency_us)
    return cfg


def check_hosts(cfg: ServerConfig) -> None:
    """Before anything loads: ``--host`` / ``--metrics-host`` must be addresses of this machine (the
    port check said "port ... is not available ...: choose another port" for a bad host).

    :raises ValueError: naming the flag and what the system said."""
    import socket

    for flag, host in (("--host", cfg.host), ("--metrics-host", cfg.metrics_host)):
        if not host:
            continue
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
        except OSError as exc:
            raise ValueError(f"{flag} {host} is not an address of this machine ({exc.strerror or exc}): give one "
                             "of its addresses, e.g. 127.0.0.1, or 0.0.0.0 for all") from None


async def _serve(cfg: ServerConfig) -> None:
    """:func:`.app.serve` on the running loop, whose class is logged (``--event-loop``)."""
    import asyncio
    import logging

    from .app import serve

    loop = type(asyncio.get_running_loop())
    logging.getLogger("oprag_server.cli").info("frontend event loop: %s.%s", loop.__module__, loop.__qualname__)
    await serve(cfg)


def main(argv: list[str] | None = None, prog: str = "oprag serve") -> int:
    """Parse ``argv``, serve until SIGTERM/SIGINT. :returns: 0, or 2 when the start failed
    (the reason on stderr)."""
    import asyncio
    import logging

    a = build_parser(prog).parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # (faiss logs each CPU-feature build it tries and lacks, "No module named 'faiss.swigfaiss_avx512'", at INFO:
    # harmless, but read as an error in a server log, trial34)
    logging.getLogger("faiss.loader").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        cfg = config_from_args(a)
        check_hosts(cfg)
        if cfg.event_loop == "uvloop":
            try:
                import uvloop
            except ImportError:
                raise RuntimeError("--event-loop uvloop needs the uvloop package: pip install 'oprag[uvloop]' "
                                   "(or leave --event-loop at asyncio)") from None
            uvloop.run(_serve(cfg))
        else:
            asyncio.run(_serve(cfg))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"oprag: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def script() -> int:
    """The ``oprag-server`` console script."""
    return main(prog="oprag-server")
