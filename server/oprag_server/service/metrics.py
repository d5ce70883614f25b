"""Prometheus metrics of one server instance (own registry, served on ``--metrics-port``).

Names follow Prometheus conventions: seconds for durations, ``_total`` for counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..engine.scheduler import QUERY_OPERATORS

# ``stage`` labels of oprag_stage_seconds (README: operator table and metrics). Query path: the
# operators' own names (engine.scheduler.QUERY_OPERATORS), ``fusion`` (the frontend part of
# ``retrieve``), ``queue`` (admission to batch start) and ``generate_queue`` (prep end to generation
# start). Ingest: ``transform``, ``embed`` (per forward pass), ``upsert``. Start-up: ``shard_recovery``.
STAGES = ("queue", "generate_queue", *(s.op for s in QUERY_OPERATORS), "fusion", "transform", "upsert")
#: the codes ``oprag_requests_total`` is exported with from the start (0) for every gRPC method of
#: the service (what :func:`.interceptors.status_for` and a caller leaving give); any other code
#: appears at its first use
GRPC_CODES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE", "INTERNAL")
#: the values of the other labels known in advance, exported as 0 from the start (README: Metrics)
KNOWN_LABELS = {
    "queue_depth": [{"queue": q} for q in ("query", "embed_ingest")],
    "rejected_overload": [{"queue": q} for q in ("query", "query_latency", "ingest")],
    "generator_seconds": [{"state": s} for s in ("busy", "idle")],
    "embed_tokens": [{"kind": k} for k in ("real", "padded")],
    "answers_without_sources": [{"action": a} for a in ("refused", "generated")],
    "engine_tokens": [{"kind": k} for k in ("prompt", "cached", "completion")],
    "writes_after_caller_left": [{"kind": k, "outcome": o} for k in ("upsert", "delete") for o in ("applied", "aborted")],
    # labelled histograms (0 count, 0 sum, every bucket 0); oprag_stage_seconds: STAGES and shard_recovery;
    # oprag_request_seconds: with oprag_requests_total (init_requests); the event-loop lag: the engine dispatcher's
    "batch_size": [{"stage": s} for s in ("prep", "generate", "embed_ingest")],
    "stage_seconds": [{"stage": s} for s in (*STAGES, "shard_recovery")],
}
_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _memo_labels(metric):
    """``metric.labels(...)`` answered from a dict after the first call with the same label
    values (prometheus_client validates and locks on every call: ~4 us, several per request).
    Only for metrics whose children are never removed."""
    cache: dict = {}
    make = metric.labels

    def labels(*values, **kw):
        key = (values, *kw.items())
        child = cache.get(key)
        if child is None:
            child = cache[key] = make(*values, **kw)
        return child

    metric.labels = labels
    return metric


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.stage_seconds = Histogram(
            "oprag_stage_seconds", "Time spent in one operator stage per batch or request", ["stage"],
            buckets=_LAT_BUCKETS, registry=r,
        )
        self.request_seconds = Histogram(
            "oprag_request_seconds", "End-to-end RPC latency", ["method"], buckets=_LAT_BUCKETS, registry=r
        )
        self.requests = Counter("oprag_requests_total", "RPCs by method and gRPC status code", ["method", "code"], registry=r)
        self.queue_depth = Gauge("oprag_queue_depth", "Items waiting in a bounded queue", ["queue"], registry=r)
        self.batch_size = Histogram(
            "oprag_batch_size", "Requests per scheduler batch", ["stage"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.batch_fill = Histogram(
            "oprag_batch_fill_ratio", "Generation batch size / max batch size", buckets=(0.125, 0.25, 0.5, 0.75, 1.0),
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "oprag_ttft_seconds", "Time to first generated token, from admission", buckets=_LAT_BUCKETS, registry=r
        )
        self.generator_seconds = Counter(
            "oprag_generator_seconds_total", "Generator worker time by state (busy decoding, idle waiting for a batch)",
            ["state"], registry=r,
        )
        self.tokens_per_second = Gauge("oprag_generate_tokens_per_second", "Tokens/s of the last generation batch",
                                       registry=r)
        self.documents_ingested = Counter("oprag_documents_ingested_total", "Documents written", registry=r)
        self.chunks_ingested = Counter("oprag_chunks_ingested_total", "Chunks written", registry=r)
        self.documents_rejected = Counter("oprag_documents_rejected_total", "Documents rejected at ingest", registry=r)
        self.chunks_split = Counter(
            "oprag_chunks_split_total", "Chunks split again because they exceeded the embedder's token limit", registry=r
        )
        self.chunks_reused = Counter(
            "oprag_chunks_reused_total", "Chunks of re-ingested documents whose unchanged text reused the stored vector",
            registry=r,
        )
        self.streams_aborted = Counter(
            "oprag_ingest_streams_aborted_total",
            "Ingest streams cancelled, failed or ended without their final message (nothing stored)", registry=r,
        )
        self.writes_after_caller_left = Counter(
            "oprag_writes_after_caller_left_total", "Writes (kind: upsert = an ingest stream, delete = a Delete) "
            "whose caller was cancelled or whose deadline passed while they committed (an ingest stream: from the arrival "
            "of its final message on), by outcome: applied (committed "
            "whole, though the caller saw DEADLINE_EXCEEDED or CANCELLED) or aborted (nothing stored)",
            ["kind", "outcome"], registry=r)
        self.embed_tokens = Counter(
            "oprag_embed_tokens_total", "Tokens through the ingest embedder: real, and padded (real + padding)",
            ["kind"], registry=r,
        )
        self.rejected_overload = Counter(
            "oprag_overload_rejections_total", "Requests refused with RESOURCE_EXHAUSTED", ["queue"], registry=r
        )
        self.generated_tokens = Counter("oprag_generated_tokens_total", "Tokens generated", registry=r)
        self.answers_without_sources = Counter(
            "oprag_answers_without_sources_total", "Query requests whose prompt had no sources: refused (not "
            "generated, finish_reason no_sources) or generated (--answer-without-sources generate)", ["action"],
            registry=r)
        self.chunks = Gauge("oprag_chunks", "Live chunks in the index", registry=r)
        self.cpu_latency_qos = Gauge(
            "oprag_cpu_latency_qos_us", "The machine's effective CPU latency QoS target in microseconds while this "
            "server holds a request (--cpu-latency-us); -1 when it holds none", registry=r)
        self.cpu_latency_qos.set(-1)
        self.documents = Gauge("oprag_documents", "Live documents in the index", registry=r)
        self.memory_records = Gauge("oprag_memory_records", "Conversational memory records held by the shards",
                                    registry=r)
        self.shard_bytes = Gauge(
            "oprag_shard_bytes", "Bytes a shard holds by component (postings, terms, vectors, ann, chunks; "
            "estimates, see ShardStats)", ["shard", "component"], registry=r)
        self.shard_pending = Gauge(
            "oprag_shard_pending", "Background work a shard has left (work: ann = vectors waiting for their HNSW graph "
            "insert, merge = BM25 postings a merge will fold, seeds = the graph size whose dense-minimum seeds are due; "
            "0 when settled: the Stats fields ann_pending, merge_pending, seeds_pending)", ["shard", "work"], registry=r)
        self.shards_up = Gauge("oprag_shards_up", "Shards serving (with --replicas: with a live replica)", registry=r)
        self.shard_replica_up = Gauge(
            "oprag_shard_replica_up", "1 while replica `replica` of shard `shard` serves (its process or Ray actor "
            "alive and caught up), else 0; replica 0 only without --replicas", ["shard", "replica"], registry=r)
        self.shard_restarts = Counter("oprag_shard_restarts_total", "Shard processes restarted after dying",
                                      registry=r)
        self.pruning_recall = Histogram(
            "oprag_pruning_recall",
            "Recall@k of sampled dense-first (hybrid) queries against exact (full_hybrid) mode, re-run off the request path",
            buckets=(0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0), registry=r,
        )
        self.retrieval_widened = Counter(
            "oprag_retrieval_widened_total", "Dense-first (hybrid) queries asked again with wider candidate lists "
            "because the threshold bound did not certify their top-k", registry=r)
        self.retrieval_uncertified = Counter(
            "oprag_retrieval_uncertified_total", "Dense-first (hybrid) queries whose top-k the threshold bound did not "
            "certify after every widening round", registry=r)
        self.pruning_checks_skipped = Counter(
            "oprag_pruning_checks_skipped_total", "Sampled queries not re-run because the monitor was busy", registry=r
        )
        self.engine_inflight = Gauge("oprag_engine_inflight", "Requests streaming from the inference engine now",
                                     registry=r)
        self.engine_tokens = Counter(
            "oprag_engine_tokens_total", "Tokens the inference engine reported: prompt, cached (prefix cache hits, "
            "usage.prompt_tokens_details.cached_tokens), completion", ["kind"], registry=r)
        self.engine_cancel_release_seconds = Histogram(
            "oprag_engine_cancel_release_seconds", "Cancel of a request to its engine HTTP stream closed",
            buckets=_LAT_BUCKETS, registry=r)
        self.event_loop_lag_seconds = Histogram(
            "oprag_event_loop_lag_seconds", "How late a 20 ms timer fires on an event loop (frontend: gRPC, prep; "
            "engine: the engine's HTTP streams): how long ready work waits for the loop", ["loop"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=r)
        for name, combos in KNOWN_LABELS.items():  # (children created: exported as 0 before any use)
            for labels in combos:
                getattr(self, name).labels(**labels)
        # the per-request ones (hot path); shard_bytes is not among them (its children are replaced)
        for m in (self.stage_seconds, self.request_seconds, self.requests, self.queue_depth, self.batch_size,
                  self.rejected_overload, self.generator_seconds):
            _memo_labels(m)

    def init_requests(self, methods, codes) -> None:
        """Export ``oprag_requests_total{method, code}`` as 0 for every ``method`` x ``code``
        (strings), and ``oprag_request_seconds{method}`` with a 0 count for every ``method``,
        from now on, instead of from its first request."""
        for m in methods:
            self.request_seconds.labels(method=m)
            for c in codes:
                self.requests.labels(method=m, code=c)

    def serve(self, port: int, host: str) -> None:
        """Start the ``/metrics`` HTTP endpoint (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)
