"""Composition root: config -> models -> shard pool -> operators -> engines -> servicer -> gRPC
server (health checks, reflection, Prometheus). Start-up checks: :mod:`oprag_server.startup`;
shard supervision: :mod:`oprag_server.supervision`."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from oprag.v1 import oprag_pb2, oprag_pb2_grpc

from . import cpu_latency
from .config import ServerConfig
from .engine.commit import CommitProtocol
from .engine.embedder import EmbedWorker
from .engine.gauges import IndexGauges
from .engine.ingest import IngestPipeline
from .engine.query import QueryEngine
from .engine.ray_embed import start_embed_pool
from .engine.rwlock import RWLock
from .index.analyzer import Analyzer
from .index.bm25 import CorpusStats
from .index.lease import renewing
from .operators.memory import Memory
from .operators.retrieve import Retriever
from .service.auth import TokenAuthInterceptor, load_tokens, server_credentials
from .service.interceptors import StatusInterceptor
from .service.metrics import Metrics
from .service.servicer import OpRAGServicer
from .shards.pool import ShardPool, placement
from .startup import (acquire_storage, announce_ready, check_data_dir, check_security, check_storage, preflight,
                      warm_beside)
from .supervision import (INGEST_HEALTH, QUERY_HEALTH, SERVING, EngineHealth, ShardSupervisor, final_snapshot,
                          keep_lease, on_signals, periodic_snapshot_failed, restart_shard)
from .shards.protocol import ApplyReply, Op, StatsRequest

log = logging.getLogger("oprag")
SERVICE_NAME = oprag_pb2.DESCRIPTOR.services_by_name["OpRAG"].full_name


class Runtime:
    """Everything one server instance owns. Models may be injected (tests use fakes)."""

    def __init__(self, cfg: ServerConfig, encoder: Any, generator: Any | None) -> None:
        self.cfg = cfg
        self.encoder, self.generator = encoder, generator
        self.metrics = Metrics()
        self.pool = ShardPool(cfg.shards, encoder.dim, cfg.data_dir, stem=cfg.bm25.stem, dense=cfg.dense,
                              replicas=cfg.replicas, storage=cfg.storage_uri, **placement(cfg))
        self.corpus_stats = CorpusStats()
        self.analyzer = Analyzer(stem=cfg.bm25.stem)
        self.lock = RWLock()
        self.commits = CommitProtocol(self.pool, self.corpus_stats, self.lock, on_apply=self.mark_dirty,
                                      metrics=self.metrics)
        self._last_gen = 0
        self._dirty = False
        self.gauges = IndexGauges(self.pool, self.metrics)
        self.embed_executor = ThreadPoolExecutor(1, thread_name_prefix="oprag-embed")
        self._bg: list[asyncio.Task] = []
        self.replayed = 0
        # service.tracing.Tracing when --otlp-endpoint is set; None: no tracing object anywhere
        self.tracing: Any = None
        self.embed_pool: Any = None  # Ray embedding actors for bulk ingest (--ray-embed-actors)

    def start_shards(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the commit log, spawn shard processes and wait until each has loaded its
        snapshot and replayed its committed write-ahead log records (blocking)."""
        lease = self.commits.lease = acquire_storage(self.cfg, self.encoder.dim)  # before anything local
        if lease is not None:
            self.pool.fenced = lambda: lease.fenced  # no shard writes to the storage once fenced
        self._recovery_failed = True  # (close() writes no snapshot until every shard holds the commit log's writes:
        # the snapshot of the shards that did start emptied the commit log, a repaired restart lost writes: trial55b #1)
        check_data_dir(self.cfg, self.encoder.dim, self.encoder.name)
        with renewing(lease):  # (the heartbeat goes on while the shards load, seed or download: trial59 F5)
            committed = self.commits.open_log(self.cfg.data_dir / "commits.log", self.cfg.storage_uri)
            ready = self.pool.start(loop, committed=committed)
        self.commits.check_recovered({r.shard: r.applied_seq for r in ready})
        self._recovery_failed = False
        self.corpus_stats.replace_with(CorpusStats.merge_full([r.lexical for r in ready]))
        self.commits.recover(r.applied_seq for r in ready)
        self.replayed = sum(r.replayed for r in ready)
        if self.replayed:  # (saved by the first periodic snapshot: a later start does not replay them again, trial50)
            log.info("recovered %d write-ahead log records", self.replayed)
            self._dirty = True
        self.metrics.shards_up.set(len(ready))
        self.embed_pool = start_embed_pool(self.cfg, self.encoder, self.metrics)

    async def start(self) -> None:
        qexec = None
        if self.cfg.batch.embed_query_thread:
            qexec = self.embed_query_executor = ThreadPoolExecutor(1, thread_name_prefix="oprag-embed-query")
        self.embedder = EmbedWorker(self.encoder, self.embed_executor, self.metrics, batch_size=self.cfg.embed.batch_size,
                                    slice_s=self.cfg.batch.ingest_embed_slice_ms / 1000, query_executor=qexec)
        self.embedder.start()
        self.retriever = Retriever(self.pool, self.corpus_stats, self.analyzer, self.cfg.bm25, self.cfg.retrieval)
        self.retriever.on_widen = self._on_widen
        self.memory = Memory(self.pool, self.cfg.memory, rewriter=self.generator if self.cfg.memory.condense else None,
                             on_write=self.mark_dirty)
        self.query = QueryEngine(
            monitor_fraction=self.cfg.retrieval.monitor_fraction,
            monitor_max_inflight=self.cfg.retrieval.monitor_max_inflight,
            generator=self.generator,
            retriever=self.retriever,
            memory=self.memory,
            lock=self.lock,
            batch=self.cfg.batch,
            gen_cfg=self.cfg.generate,
            embedder=self.embedder,
            metrics=self.metrics,
        )
        self.ingest = IngestPipeline(
            encoder=self.encoder,
            pool=self.pool,
            commit=self.commit,
            chunking=self.cfg.chunking,
            cfg=self.cfg.ingest,
            limits=self.cfg.limits,
            embedder=self.embed_pool or self.embedder,  # only its embed_chunks: ingest vectors
            metrics=self.metrics,
            next_generation=self.next_generation,
            embed_batch=self.cfg.embed.batch_size,
        )
        if self.tracing is not None:  # each finished query -> one trace of its executed steps
            self.query.submit = self.tracing.wrap(self.query.submit)
        self.query.start()
        self._bg.append(asyncio.create_task(self._snapshot_loop(self.cfg.snapshot_interval_s)))
        if self.commits.lease is not None:
            self._bg.append(asyncio.create_task(keep_lease(self.commits.lease, self._reestablish, asyncio.Event())))
        await self.gauges.refresh()
        self.gauges.stale()  # (what a start leaves to do between requests: followed, engine/gauges.py)

    def _on_widen(self, widened: int, uncertified: int) -> None:
        """Count a dense-first batch's widened and uncertified queries (most batches have none:
        no counter's lock is taken for them)."""
        if widened:
            self.metrics.retrieval_widened.inc(widened)
        if uncertified:
            self.metrics.retrieval_uncertified.inc(uncertified)

    @property
    def seq(self) -> int:
        """The last issued sequence number (see :class:`CommitProtocol`)."""
        return self.commits.seq

    @property
    def applied_seq(self) -> int:
        return self.commits.applied_seq

    async def wait_applied(self, seq: int, timeout: float | None) -> None:
        """See :meth:`CommitProtocol.wait_applied`."""
        await self.commits.wait_applied(seq, timeout)

    def next_generation(self) -> int:
        """A document version id: unique and increasing across restarts (nanosecond clock)."""
        self._last_gen = max(time.time_ns(), self._last_gen + 1)
        return self._last_gen

    def mark_dirty(self) -> None:
        """The shards changed (a committed transaction, a memory write): snapshot them on the
        snapshot loop's next round, refresh the index gauges (coalesced: :mod:`.engine.gauges`)."""
        self._dirty = True
        self.gauges.stale()

    async def restart_shard(self, i: int) -> None:
        """Respawn shard ``i`` and re-sum the corpus-global BM25 statistics."""
        await restart_shard(self.pool, i, committed=self.commits.committed_txns, lock=self.lock, stats=self.corpus_stats,
                            check=self.commits.check_recovered, gate=self.commits.gate)

    async def stats(self) -> dict:
        """Corpus and shard statistics of the shards that answer (a dead shard is left out of the
        totals and ``shards``, and listed in ``missing_shards``).

        :returns: ``{"documents", "chunks", "memory_records", "seq", "embedder", "generator", "missing_shards",
            "shards": [{"shard", "documents", "chunks", "memory_records", "applied_seq", "bytes", "ann_pending", "merge_pending", "segment_unsaved", "seeds_pending"}, ...]}``
            (``bytes``: ``{component: bytes}``, :meth:`.shards.chunks.ChunkStore.nbytes`)
            with shards in id order; ``generator`` is ``"none"`` without a generator; ``seq`` the
            last sequence number every shard applied (not one a failed write took: trial16).
        """
        got, missing = await self.pool.gather_partial(Op.STATS, StatsRequest())
        shards = [{"shard": r.shard, "documents": r.documents, "chunks": r.chunks,
                   "memory_records": r.memory_records, "applied_seq": r.applied_seq, "bytes": r.nbytes or {}, "ann_pending": getattr(r, "ann_pending", 0),
                   "merge_pending": getattr(r, "merge_pending", 0), "segment_unsaved": getattr(r, "segment_unsaved", 0),
                   "seeds_pending": getattr(r, "seeds_pending", 0)}
                  for _, r in sorted(got.items())]
        return {
            **{k: sum(s[k] for s in shards) for k in ("documents", "chunks", "memory_records")},
            "seq": self.applied_seq, "shards": shards, "missing_shards": sorted(missing), "embedder": self.encoder.name,
            "generator": self.generator.name if self.generator is not None else "none",
        }

    async def commit(self, txn: str, kind: str, doc_ids: list[str] | None = None) -> tuple[int, list[ApplyReply]]:
        """Two-phase commit on every shard (see :meth:`CommitProtocol.commit`; it marks the shards
        dirty for the snapshot loop, also when the caller left after the commit point)."""
        return await self.commits.commit(txn, kind, doc_ids)

    async def delete(self, doc_ids: list[str]) -> tuple[int, int, int]:
        """:returns: ``(documents deleted, chunks deleted, sequence number)``."""
        return await self.commits.delete(doc_ids)

    async def snapshot(self, skip: tuple[int, ...] = ()) -> None:
        """Snapshot every shard but those in ``skip`` (shards that are down); after a full one the
        commit log is no longer needed for recovery (it is kept when a shard was skipped).

        :raises StorageUnavailable: this server lost the storage's owner lease (the pool refuses:
            it must not replace the new owner's snapshot)."""
        async with self.commits.gate:  # excludes commits; queries go on (CommitProtocol.gate)
            # cleared before, not after: a memory write (a recorded turn, a ClearSession) is not
            # excluded by the gate, and one a shard applies after its snapshot's cut marks the
            # shards dirty again for the next round (cleared after, it waited for the next write)
            self._dirty = False
            try:
                await self.pool.snapshot(skip)  # (ShardPool.SNAPSHOTS_AT_ONCE at a time)
            except BaseException:
                self._dirty = True
                raise
            if not skip:
                self.commits.reset_log()

    async def _reestablish(self) -> None:
        """The storage lost its objects while serving: record the layout, snapshot every shard."""
        check_storage(self.cfg.storage_uri, self.cfg.shards, self.encoder.dim)
        await self.snapshot()
        log.warning("re-established --storage-uri %s from a full snapshot", self.cfg.storage_uri)

    async def _snapshot_loop(self, interval_s: float = 30.0, max_share: float = 0.1, unsaved: int = 64 << 20) -> None:
        # at most max_share of the time (a snapshot blocks commits, 10-20 s at 1M chunks; 0.2 took ~17% of a 1M
        # ingest's wall, ingest8); the log replayed after a crash is then up to 9x a snapshot's time; also when no
        # write came but a shard holds >= `unsaved` bytes of BM25 segment only in memory (an idle merge's: the
        # snapshot maps it from its files, ~0.7 GB per 1M-chunk shard, mem17 follow-up) or a dense index an idle step
        # changed (ShardPool.unsaved); failing: the
        failing, wait = None, interval_s  # last failure's text, logged once per change
        while True:
            await asyncio.sleep(wait)
            t, wait = time.perf_counter(), interval_s
            seg, ann = await self.pool.unsaved() if self.cfg.data_dir is not None and not self._dirty else (0, False)
            if (self._dirty or seg >= unsaved or ann) \
                    and not (self.commits.lease is not None and self.commits.lease.fenced):
                try:
                    await self.snapshot()
                    self.gauges.stale()  # (a snapshot maps merged segments: other bytes, engine/gauges.py)
                    wait = max(interval_s, (time.perf_counter() - t) * (1 / max_share - 1))
                except Exception as exc:  # noqa: BLE001
                    # (the same failure with other byte counts, as ENOSPC's "N requested and M written": trial54 #4)
                    if re.sub(r"\d+", "N", str(exc)) != failing:
                        periodic_snapshot_failed(self.pool, exc, interval_s)
                    failing = re.sub(r"\d+", "N", str(exc))
                    continue
                if failing is not None:
                    log.info("periodic snapshots succeed again")
                failing = None

    async def close(self) -> None:
        self.gauges.cancel()
        for t in self._bg:
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if hasattr(self, "query"):
            await self.query.stop()
            await self.embedder.stop()
        elif getattr(self.generator, "is_engine", False):  # started, but the engine never ran
            await self.generator.aclose()
        if not getattr(self, "_recovery_failed", False):
            await final_snapshot(self.pool, self.snapshot)
        if self.embed_pool is not None:
            self.embed_pool.close()
        await self.pool.shutdown(snapshot=False)
        if self.commits.lease is not None and not self.commits.lease.fenced:
            try:
                self.commits.lease.release()
            except Exception:  # noqa: BLE001 - it expires anyway
                log.exception("releasing the --storage-uri owner lease failed")
        self.embed_executor.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "embed_query_executor", None) is not None:
            self.embed_query_executor.shutdown(wait=False, cancel_futures=True)
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans not yet exported
        cpu_latency.release(getattr(self, "cpu_latency", None))  # --cpu-latency-us (held in serve)


def grpc_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """Channel options of the gRPC server: message size limits both ways, no port sharing."""
    m = cfg.limits.max_message_bytes
    # so_reuseport=0: a second server on a taken port fails instead of sharing it
    return [("grpc.max_receive_message_length", m), ("grpc.max_send_message_length", m), ("grpc.so_reuseport", 0)]


def build_server(cfg: ServerConfig, rt: Runtime) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The gRPC server: OpRAG servicer behind the auth and status interceptors, health,
    reflection, bound to ``cfg.host:cfg.port`` (TLS when configured); not started.

    :returns: the server, its health servicer and the bound port.
    :raises RuntimeError: security settings incomplete, or the port cannot be bound.
    """
    sec = cfg.security
    tokens = load_tokens(sec.tokens_file)
    check_security(cfg, tokens)
    interceptors = [TokenAuthInterceptor(tokens)] if tokens else []
    interceptors.append(StatusInterceptor(rt.metrics, SERVICE_NAME))  # after auth: denied calls are not counted
    if getattr(rt, "tracing", None) is not None:
        from .service.tracing import TraceInterceptor

        interceptors.append(TraceInterceptor(SERVICE_NAME))
    server = grpc.aio.server(options=grpc_options(cfg), interceptors=interceptors)
    oprag_pb2_grpc.add_OpRAGServicer_to_server(OpRAGServicer(rt), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    if sec.tls_cert is not None:
        creds = server_credentials(sec.tls_cert, sec.tls_key, sec.tls_client_ca)
        bound = server.add_secure_port(f"{cfg.host}:{cfg.port}", creds)
    else:
        bound = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the gRPC port {cfg.host}:{cfg.port}: choose another --port")
    return server, health_servicer, bound


async def serve(cfg: ServerConfig, *, encoder: Any = None, generator: Any = None, stop_event: asyncio.Event | None = None,
                models_loaded: bool = False) -> None:
    """Run the service until SIGTERM/SIGINT (or ``stop_event``). Models are loaded from ``cfg``
    unless given (``models_loaded``). Prints ``OPRAG READY <host>:<port>`` on stdout once serving.

    :raises RuntimeError | ValueError | OSError: a start-up check or start step failed (nothing
        is left running: shards are stopped, the server is closed).
    """
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    if not models_loaded:  # start-up checks (models found, ports, data dir); warm-up below
        encoder, generator = preflight(cfg)
    rt = Runtime(cfg, encoder, generator)
    if cfg.otlp_endpoint:
        from .service.tracing import Tracing

        rt.tracing = Tracing.otlp(cfg.otlp_endpoint)
    server = http = http_task = None
    try:  # a failure before serving (e.g. a port taken meanwhile) must not leave shards behind
        shards = loop.run_in_executor(None, rt.start_shards, loop)
        await (shards if models_loaded else warm_beside(encoder, generator, shards))
        await rt.start()
        server, health_servicer, bound = build_server(cfg, rt)
        try:
            rt.metrics.serve(cfg.metrics_port, cfg.metrics_host or cfg.host)
        except OSError as exc:
            raise RuntimeError(f"could not bind the metrics port {cfg.metrics_port}: {exc.strerror}; "
                               "choose another --metrics-port") from exc
        await server.start()
        if cfg.http_port:
            from .service.http import start_http

            http, http_task = await start_http(cfg, rt, load_tokens(cfg.security.tokens_file))
        rt.cpu_latency = cpu_latency.hold(cfg.cpu_latency_us, gauge=rt.metrics.cpu_latency_qos)  # checked in preflight
    except BaseException:
        try:
            if http is not None:
                http.should_exit = True
                await http_task
            if server is not None:
                await server.stop(0)
            await rt.close()
        except Exception:  # noqa: BLE001 - report the original failure, not the clean-up's
            log.exception("clean-up after a failed start")
        raise
    supervisor = ShardSupervisor(rt.pool, rt.restart_shard, health_servicer, ("", SERVICE_NAME), rt.metrics,
                                 fenced=lambda: rt.commits.lease is not None and rt.commits.lease.fenced,
                                 write_error=lambda: rt.commits.write_error, changed=rt.gauges.stale)
    await supervisor.set_health(True)
    await health_servicer.set(QUERY_HEALTH, SERVING)
    await health_servicer.set(INGEST_HEALTH, SERVING)

    stop = stop_event or asyncio.Event()
    on_signals(loop, stop.set)  # (a second SIGTERM/SIGINT during the shutdown: supervision.stop_now)
    watcher = asyncio.create_task(supervisor.run(stop))
    if getattr(generator, "is_engine", False):  # Query follows the engine; Retrieve does not
        engine_watch = asyncio.create_task(EngineHealth(generator, health_servicer).run(stop))
    log.info("serving on %s:%d (metrics :%d, HTTP :%s) with %d shards, %d chunks, ready in %.1f s",
             cfg.host, bound, cfg.metrics_port, cfg.http_port or "off", cfg.shards, rt.corpus_stats.n_docs, time.perf_counter() - t0)
    announce_ready(cfg.host, bound)
    await stop.wait()
    log.info("shutting down (grace %.0f s; a second SIGTERM/SIGINT stops at once)", cfg.shutdown_grace_s)
    watcher.cancel()
    if getattr(generator, "is_engine", False):
        engine_watch.cancel()
    await health_servicer.enter_graceful_shutdown()
    if http is not None:
        http.should_exit = True
    await server.stop(cfg.shutdown_grace_s)
    if http_task is not None:
        await http_task
    await rt.close()
    log.info("stopped")
