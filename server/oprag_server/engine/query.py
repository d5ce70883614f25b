"""Query executor: batches concurrent queries and overlaps CPU work for batch n+1 (memory,
embed, retrieve, reason) with generation of batch n.

Two long-lived tasks joined by a bounded queue (capacity 1):

* the *prep* loop asks :class:`BatchPolicy` when to close a batch, then runs memory lookup,
  embedding, retrieval and context building for the whole batch;
* the *generate* loop hands prepared batches to the persistent generator worker (one thread
  that owns the model) and answers the requests.

With ``overlap=False`` the prep loop waits for each batch's generation before forming the next
one (stages strictly in sequence), which is the baseline the overlap is measured against.
Admission is bounded: more than ``queue_capacity`` unfinished queries raise :class:`Overloaded`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import BatchConfig, GenerateConfig
from ..domain import ContextPayload, Hit, MemoryContext, RetrieveSpec
from ..operators.memory import Memory
from ..operators.reason import build_context
from ..operators.retrieve import Retriever
from .rwlock import RWLock
from .scheduler import BatchPolicy, compile_plan

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """A bounded queue is full; the caller should retry after ``retry_after_s``."""

    def __init__(self, queue: str, retry_after_s: float) -> None:
        super().__init__(f"the {queue} queue is full; retry after {retry_after_s:.2f} s")
        self.queue = queue
        self.retry_after_s = retry_after_s


class QueryRejected(ValueError):
    """One request cannot be served as asked (for example its question does not fit the
    prompt budget); only that request fails."""


@dataclass
class QueryJob:
    question: str
    spec: RetrieveSpec
    session_id: str = ""
    use_memory: bool = True
    generate: bool = True
    max_new_tokens: int = 64
    request_id: str = ""
    query_vector: np.ndarray | None = None  # float32[D] given by the client: skip embedding
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None
    cancelled: bool = False
    # filled in by the executor
    memory: MemoryContext | None = None
    vector: np.ndarray | None = None
    hits: list[Hit] = field(default_factory=list)
    info: Any = None
    payload: ContextPayload | None = None
    answer: str = ""
    completion_tokens: int = 0
    finish_reason: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)
    batch_id: int = 0
    plan: tuple = ()
    events: asyncio.Queue | None = None  # QueryStream: ("sources", job) / ("text", str), then the future resolves
    ttft_ms: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter stamps for the trace

    def trace(self) -> list[dict]:
        """The executed plan: per operator its resource domain, batch, queue wait and run time."""
        t, m = self.timings_ms, self.marks
        gen_queue = max(0.0, (m.get("gen_start", 0.0) - m.get("prep_end", 0.0)) * 1000) if "gen_start" in m else 0.0
        run = {"memory": t.get("memory", 0.0), "embed": t.get("embed", 0.0),
               "retrieve": t.get("retrieve", 0.0) + t.get("rerank", 0.0), "reason": t.get("context", 0.0),
               "generate": t.get("generate", 0.0), "upsert": t.get("promote", 0.0)}
        out = []
        for i, step in enumerate(self.plan):
            q = t.get("queue", 0.0) if i == 0 else (gen_queue if step.op == "generate" else 0.0)
            out.append({"op": step.op, "domain": step.domain, "batch_id": self.batch_id, "queue_ms": q,
                        "run_ms": run.get(step.op, 0.0)})
        return out


class QueryEngine:
    def __init__(
        self,
        *,
        monitor_fraction: float = 0.0,
        monitor_max_inflight: int = 2,
        encoder: Any,
        generator: Any | None,
        retriever: Retriever,
        memory: Memory,
        lock: RWLock,
        batch: BatchConfig,
        gen_cfg: GenerateConfig,
        embedder: Any,
        metrics: Any,
    ) -> None:
        self.encoder = encoder
        self.generator = generator
        self.retriever = retriever
        self.memory = memory
        self.lock = lock
        self.cfg = batch
        self.gen_cfg = gen_cfg
        self.policy = BatchPolicy(batch.max_batch, batch.max_wait_ms / 1000.0)
        self.embedder = embedder
        self.gen_executor = ThreadPoolExecutor(1, thread_name_prefix="oprag-generate")
        self.metrics = metrics
        self._waiting: collections.deque[QueryJob] = collections.deque()
        self._arrived = asyncio.Event()
        self._gen_queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._inflight = 0
        self._batch_ids = 0
        self._tasks: list[asyncio.Task] = []
        self._gen_time_ewma = 0.5
        self._generating = 0  # batches handed to the generator and not finished
        self.monitor_fraction = monitor_fraction
        self.monitor_max_inflight = monitor_max_inflight
        self._monitor_credit = 0.0
        self._monitor_tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._prep_loop()), asyncio.create_task(self._gen_loop())]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._monitor_tasks]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.gen_executor.shutdown(wait=True, cancel_futures=True)

    @property
    def inflight(self) -> int:
        return self._inflight

    def estimated_delay_s(self) -> float:
        """Queueing delay a new query would see: batches ahead of it x recent batch time (s)."""
        batches_ahead = self._inflight // self.cfg.max_batch
        return batches_ahead * self._gen_time_ewma

    async def submit(self, job: QueryJob) -> QueryJob:
        """Admit, batch and run one query. :raises Overloaded: too many unfinished queries."""
        if self._inflight >= self.cfg.queue_capacity:
            self.metrics.rejected_overload.labels(queue="query").inc()
            raise Overloaded("query", retry_after_s=max(0.05, self._gen_time_ewma))
        if self.cfg.max_queue_delay_ms > 0 and job.generate:
            est = self.estimated_delay_s()
            if est * 1000 > self.cfg.max_queue_delay_ms:
                self.metrics.rejected_overload.labels(queue="query_latency").inc()
                raise Overloaded("query", retry_after_s=est)
        job.future = asyncio.get_running_loop().create_future()
        job.plan = compile_plan(memory=bool(job.session_id and job.use_memory), generate=job.generate)
        self._inflight += 1
        self._waiting.append(job)
        self.metrics.queue_depth.labels(queue="query").set(len(self._waiting))
        self._arrived.set()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.cancelled = True  # the client went away: stop its work, free its slot
            raise
        finally:
            self._inflight -= 1

    # ------------------------------------------------------------------ prep
    async def _next_batch(self) -> list[QueryJob]:
        while True:
            while self._waiting and self._waiting[0].cancelled:
                self._finish(self._waiting.popleft())
            age = time.perf_counter() - self._waiting[0].enqueued if self._waiting else 0.0
            d = self.policy.decide(len(self._waiting), age, downstream_busy=self._generating > 0,
                                   will_generate=bool(self._waiting) and self._waiting[0].generate
                                   and self.generator is not None)
            if d.take:
                batch = [self._waiting.popleft() for _ in range(d.take)]
                self.metrics.queue_depth.labels(queue="query").set(len(self._waiting))
                return batch
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), None if d.wait_s == float("inf") else d.wait_s)
            except asyncio.TimeoutError:
                pass

    async def _prep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            self._batch_ids += 1
            try:
                await self._prep(batch, self._batch_ids, loop)
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("query batch failed")
                for j in batch:
                    self._fail(j, exc)
                continue
            gen = [j for j in batch if j.generate and j.payload is not None and not j.cancelled and j.future
                   and not j.future.done()]
            for j in batch:
                if j not in gen and not (j.future and j.future.done()):
                    await self._promote_retrieval_only(j)
                    self._finish(j)
            if gen:
                done = loop.create_future()
                self._generating += 1
                done.add_done_callback(lambda _: self._dec_generating())
                await self._gen_queue.put((gen, done))
                if not self.cfg.overlap:
                    await done

    async def _prep(self, batch: list[QueryJob], batch_id: int, loop) -> None:
        t0 = time.perf_counter()
        self.metrics.batch_size.labels(stage="prep").observe(len(batch))
        for j in batch:
            j.batch_id = batch_id
            j.timings_ms["queue"] = (t0 - j.enqueued) * 1000
            self.metrics.stage_seconds.labels(stage="queue").observe(t0 - j.enqueued)
        live = [j for j in batch if not j.cancelled]
        if not live:
            return
        # memory (one shard call per shard for the whole batch)
        t = time.perf_counter()
        mem = await self.memory.lookup(
            [j.question for j in live], [j.session_id if j.use_memory else "" for j in live]
        )
        self._stage(live, "memory", t)
        for j, m in zip(live, mem):
            j.memory = m
        # embed (jobs that brought their own query vector skip it)
        t = time.perf_counter()
        texts = [j.memory.retrieval_text for j in live]
        todo = [i for i, j in enumerate(live) if j.query_vector is None]
        if todo:
            emb = await self.embedder.embed_queries([texts[i] for i in todo])
            for i, v in zip(todo, emb):
                live[i].vector = v
        for j in live:
            if j.query_vector is not None:
                j.vector = j.query_vector
        self._stage(live, "embed", t)
        vecs = np.stack([j.vector for j in live]).astype(np.float32, copy=False)
        # retrieve (+ frontend rerank/fusion)
        t = time.perf_counter()
        async with self.lock.read():
            hits, times, infos = await self.retriever.retrieve(vecs, texts, [j.spec for j in live])
        self._stage(live, "retrieve", t, override=times.get("retrieve"))
        for j in live:
            j.timings_ms["rerank"] = times.get("rerank", 0.0) * 1000
        self.metrics.stage_seconds.labels(stage="rerank").observe(times.get("rerank", 0.0))
        for j, h, info in zip(live, hits, infos):
            j.hits = h
            j.info = info
        self._sample_for_monitor(live)
        # reason
        t = time.perf_counter()
        for j in live:
            if j.generate and self.generator is not None:
                try:
                    j.payload = build_context(
                        j.question,
                        j.hits,
                        self.generator,
                        budget_tokens=self.gen_cfg.context_tokens,
                        max_new_tokens=j.max_new_tokens,
                        memory_text=j.memory.memory_text if j.memory else "",
                    )
                except ValueError as exc:  # this request only: the rest of the batch goes on
                    self._fail(j, QueryRejected(str(exc)))
        if any(j.generate for j in live):
            self._stage(live, "context", t)
        now = time.perf_counter()
        for j in live:
            j.marks["prep_end"] = now
            if j.events is not None:
                j.events.put_nowait(("sources", j))

    def _dec_generating(self) -> None:
        self._generating -= 1
        self._arrived.set()  # a waiting batch may close now

    # ------------------------------------------------------------------ pruning-loss monitor
    def _sample_for_monitor(self, jobs: list[QueryJob]) -> None:
        """Pick every (1/fraction)-th dense-first query (deterministic) for an exact re-run."""
        if self.monitor_fraction <= 0:
            return
        picked = []
        for j in jobs:
            if j.spec.mode != "hybrid" or not j.hits:
                continue
            self._monitor_credit += self.monitor_fraction
            if self._monitor_credit >= 1.0:
                self._monitor_credit -= 1.0
                picked.append(j)
        if not picked:
            return
        if len(self._monitor_tasks) >= self.monitor_max_inflight:
            self.metrics.pruning_checks_skipped.inc(len(picked))
            return
        t = asyncio.create_task(self._monitor(picked))
        self._monitor_tasks.add(t)
        t.add_done_callback(self._monitor_tasks.discard)

    async def _monitor(self, jobs: list[QueryJob]) -> None:
        try:
            specs = [dataclasses.replace(j.spec, mode="full_hybrid") for j in jobs]
            vecs = np.stack([j.vector for j in jobs]).astype(np.float32, copy=False)
            texts = [j.memory.retrieval_text if j.memory else j.question for j in jobs]
            async with self.lock.read():
                exact, _, _ = await self.retriever.retrieve(vecs, texts, specs)
            for j, ex in zip(jobs, exact):
                if ex:
                    want = {h.chunk_id for h in ex}
                    got = {h.chunk_id for h in j.hits[: len(ex)]}
                    self.metrics.pruning_recall.observe(len(want & got) / len(want))
        except Exception:  # noqa: BLE001 - the monitor never affects serving
            log.exception("pruning-loss monitor failed")

    def _stage(self, jobs: list[QueryJob], name: str, t0: float, override: float | None = None) -> None:
        dt = override if override is not None else time.perf_counter() - t0
        self.metrics.stage_seconds.labels(stage=name).observe(dt)
        for j in jobs:
            j.timings_ms[name] = dt * 1000

    # ------------------------------------------------------------------ generate
    async def _gen_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t_idle = time.perf_counter()
            batch, done = await self._gen_queue.get()
            idle = time.perf_counter() - t_idle
            self.metrics.generator_seconds.labels(state="idle").inc(idle)
            try:
                await self._generate(batch, loop)
            except Exception as exc:  # noqa: BLE001
                log.exception("generation batch failed")
                for j in batch:
                    self._fail(j, exc)
            finally:
                if not done.done():
                    done.set_result(None)

    async def _generate(self, batch: list[QueryJob], loop) -> None:
        live = [j for j in batch if not j.cancelled]
        if not live:
            for j in batch:
                self._finish(j)
            return
        self.metrics.batch_size.labels(stage="generate").observe(len(live))
        self.metrics.batch_fill.observe(len(live) / self.cfg.max_batch)
        t = time.perf_counter()
        for j in live:
            j.marks["gen_start"] = t
            self.metrics.stage_seconds.labels(stage="generate_queue").observe(t - j.marks.get("prep_end", t))
        prompts = [j.payload.prompt for j in live]
        max_new = [j.max_new_tokens for j in live]

        def emit(row: int, delta: str) -> None:  # generator thread -> event loop
            loop.call_soon_threadsafe(self._on_text, live[row], delta)

        results = await loop.run_in_executor(
            self.gen_executor,
            lambda: self.generator.generate(prompts, max_new, on_token=emit, should_stop=lambda row: live[row].cancelled),
        )
        dt = time.perf_counter() - t
        self.metrics.generator_seconds.labels(state="busy").inc(dt)
        toks = sum(r.completion_tokens for r in results)
        if dt > 0:
            self.metrics.tokens_per_second.set(toks / dt)
        self._gen_time_ewma = 0.8 * self._gen_time_ewma + 0.2 * dt
        self._stage(live, "generate", t)
        for j, r in zip(live, results):
            j.answer = r.text
            j.completion_tokens = r.completion_tokens
            j.finish_reason = r.finish_reason
            self.metrics.generated_tokens.inc(r.completion_tokens)
        t = time.perf_counter()
        await self._promote(live)
        self._stage(live, "promote", t)
        for j in batch:
            self._finish(j)

    def _on_text(self, job: QueryJob, delta: str) -> None:
        if not job.ttft_ms:
            job.ttft_ms = (time.perf_counter() - job.enqueued) * 1000
            self.metrics.ttft_seconds.observe(job.ttft_ms / 1000)
        if job.events is not None and delta:
            job.events.put_nowait(("text", delta))

    async def _promote(self, jobs: list[QueryJob]) -> None:
        todo = [j for j in jobs if j.session_id and j.use_memory and not j.cancelled and j.vector is not None]
        outs = await asyncio.gather(
            *[
                self.memory.promote(
                    j.session_id, j.question, j.answer, [h.chunk_id for h in j.hits], [h.title for h in j.hits], j.vector
                )
                for j in todo
            ],
            return_exceptions=True,
        )
        for o in outs:  # memory promotion is best effort: a down shard must not fail the answer
            if isinstance(o, Exception):
                log.warning("memory promotion failed: %s", o)

    async def _promote_retrieval_only(self, j: QueryJob) -> None:
        if not j.generate:
            await self._promote([j])

    # ------------------------------------------------------------------ completion
    def _finish(self, j: QueryJob) -> None:
        j.timings_ms["total"] = (time.perf_counter() - j.enqueued) * 1000
        if j.future is not None and not j.future.done():
            j.future.set_result(j)

    def _fail(self, j: QueryJob, exc: BaseException) -> None:
        if j.future is not None and not j.future.done():
            j.future.set_exception(exc)
