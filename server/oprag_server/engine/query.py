"""Query executor: batches concurrent queries, runs each batch's compiled plan one operator at a
time, and overlaps the prep of batch n+1 (memory, embed, retrieve, context) with generation of
batch n.

Two long-lived tasks joined by a bounded queue (capacity 1):

* the *prep* loop asks :class:`BatchPolicy` when to close a batch, then runs the prep steps of
  the batch's plans (:func:`split_plan`), one operator function per step; requests that do not
  generate (retrieval only, or no sources: :mod:`.grounding`) run their rest (promotion) at once;
* the *generate* loop hands prepared batches to the persistent generator worker (one thread
  that owns the model), then runs the remaining steps (promotion) and answers the requests.

Each step runs once per batch, over the requests whose plan lists it, and is recorded on each
of them (:meth:`QueryJob.record`): the trace, ``timings_ms`` and ``oprag_stage_seconds`` all
come from the executed steps under the operator's one name (README: operator table).

With ``overlap=False`` the prep loop waits for each batch's generation before forming the next
(the baseline; with an engine, all of the batch goes once prepared and the next prep starts once
all of it has left; with overlap each request goes as soon as its prompt exists, and up to
``PREP_INFLIGHT`` prep batches run at once). More than ``queue_capacity`` unfinished queries
raise :class:`Overloaded` (:mod:`.admission`, also for the hint a refusal carries).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from ..config import BatchConfig, GenerateConfig
from ..operators.context import build_context, question_fits
from ..operators.group import retrieve_documents
from ..operators.memory import Memory, context_vector, fuse_session, session_rows
from ..operators.retrieve import Retriever
from .admission import RETRY_MIN_S, Admission
from .direct import LONE, DirectPath
from .dispatch import EngineDispatch
from .errors import Overloaded, QueryRejected
from .failures import FailureLog
from .grounding import without_sources
from .job import QueryJob, isolated
from .monitor import PruningMonitor
from .rwlock import RWLock
from .scheduler import (CONTEXT, EMBED, GENERATE, MEMORY, PREP_INFLIGHT, PROMOTE, RETRIEVE, BatchPolicy, PlanStep,
                        batch_steps, compile_plan, split_plan)
from .stops import StopCuts

__all__ = ["Overloaded", "QueryEngine", "QueryJob", "QueryRejected"]

log = logging.getLogger(__name__)


def _alive(j: QueryJob) -> bool:
    """Not cancelled by its client and not yet answered or failed."""
    return not j.cancelled and not (j.future is not None and j.future.done())


class QueryEngine(DirectPath, Admission):
    """Admission, batching and plan execution of queries (see the module docstring)."""

    def __init__(self, *, monitor_fraction: float = 0.0, monitor_max_inflight: int = 2, generator: Any | None,
                 retriever: Retriever, memory: Memory, lock: RWLock, batch: BatchConfig, gen_cfg: GenerateConfig,
                 embedder: Any, metrics: Any) -> None:
        self.generator, self.retriever, self.memory, self.lock, self.cfg = generator, retriever, memory, lock, batch
        self._promote_failures = FailureLog("memory promotion")
        self.gen_cfg, self.embedder, self.metrics = gen_cfg, embedder, metrics
        self.policy = BatchPolicy(batch.max_batch, batch.max_wait_ms / 1000.0)
        self.gen_executor = ThreadPoolExecutor(1, thread_name_prefix="oprag-generate")
        self._waiting: collections.deque[QueryJob] = collections.deque()
        self._arrived = asyncio.Event()  # a request or a free generator: a batch may close
        self._gen_queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._inflight = self._batch_ids = 0
        self._prep_tasks: set[asyncio.Task] = set()
        self._tasks = []  # the two loops
        self.generate_s, self.retrieve_s, self._retrieving = 0.5, RETRY_MIN_S, 0  # Admission's (s, s, count)
        self._generating = 0  # batches handed to the generator and not finished
        self._preparing, self._busy = 0, False  # requests being prepared; one runs in its caller's task (_direct)
        self.monitor = PruningMonitor(retriever, lock, metrics, monitor_fraction, monitor_max_inflight)
        # an engine that batches by itself gets each request as soon as its prompt exists
        self.dispatch = (EngineDispatch(generator, metrics, self._on_text, io_thread=gen_cfg.io_thread)
                         if getattr(generator, "is_engine", False) else None)
        # one function per operator; each takes the jobs of a batch whose plan lists it and may
        # return its own run time in seconds (when the wall time includes waiting, e.g. a lock)
        self._operators: dict[str, Callable[[list[QueryJob]], Awaitable[float | None]]] = {
            MEMORY: self._memory, EMBED: self._embed, RETRIEVE: self._retrieve, CONTEXT: self._context,
            GENERATE: self._generate, PROMOTE: self._promote,
        }

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._prep_loop()), asyncio.create_task(self._gen_loop())]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._prep_tasks, *self.monitor.tasks]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._prep_tasks, return_exceptions=True)
        if self.dispatch is not None:
            await self.dispatch.stop()
        self.gen_executor.shutdown(wait=True, cancel_futures=True)

    inflight = property(lambda self: self._inflight)

    async def submit(self, job: QueryJob) -> QueryJob:
        """Admit (:meth:`Admission._admit`), batch and run one query. :raises Overloaded: too many
        unfinished queries, or too long a wait (``max_queue_delay_ms``); :raises QueryRejected: the question alone
        does not fit a generating request's prompt budget (before any work or event)."""
        if job.generate and self.generator is not None:
            try:
                question_fits(job.question, self.generator, budget_tokens=self.gen_cfg.context_tokens,
                              max_new_tokens=job.max_new_tokens)
            except ValueError as exc:
                raise QueryRejected(str(exc)) from exc
        self._admit(job)
        job.plan = compile_plan(memory=bool(job.session_id and job.use_memory),
                                generate=job.generate and self.generator is not None,
                                embed=job.query_vector is None)
        if job.plan is LONE and job.events is None and self._direct(job):
            return await self._lone(job)
        job.future = asyncio.get_running_loop().create_future()
        plain = not job.runs(GENERATE)  # (retrieval only: frees its slot soon, Admission.retry_after_s)
        self._inflight, self._retrieving = self._inflight + 1, self._retrieving + plain
        direct = self._direct(job)
        if not direct:
            self._waiting.append(job)
            self.metrics.queue_depth.labels(queue="query").set(len(self._waiting))
            self._arrived.set()
        try:
            if direct:  # the batch of one the prep loop would form, run by this task
                await self._prep_batch([job], self._batch_ids)
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.cancelled = True  # the client went away: stop its work, free its slot
            if self.dispatch is not None:
                self.dispatch.cancel(job)
            raise
        finally:
            self._inflight, self._retrieving = self._inflight - 1, self._retrieving - plain
            if direct:  # requests that came meanwhile form the next batch (with none, the prep loop sleeps on)
                self._busy = False
                if self._waiting:
                    self._arrived.set()

    # ------------------------------------------------------------------ prep
    async def _next_batch(self) -> list[QueryJob]:
        while True:
            while self._busy:  # a request runs directly (:meth:`_direct`): batch what comes after it
                self._arrived.clear()
                await self._arrived.wait()
            while self._waiting and self._waiting[0].cancelled:
                self._finish(self._waiting.popleft())
            age = time.perf_counter() - self._waiting[0].enqueued if self._waiting else 0.0
            # an engine forms no generation batches: prep closes at once (with overlap off the
            # batch forms as for the builtin: it is prepared, then generated, as one)
            engine = self.dispatch is not None and self.cfg.overlap
            d = self.policy.decide(len(self._waiting), age, downstream_busy=self._generating > 0 and not engine,
                                   will_generate=not engine and bool(self._waiting) and self._waiting[0].runs(GENERATE))
            if d.take:
                take = d.take
                if engine and self.dispatch.active < len(self._waiting):
                    take = max(1, take // 4)  # the engine holds fewer than wait: a quarter first, so it is fed sooner
                batch = [self._waiting.popleft() for _ in range(take)]
                self._preparing += take
                self.metrics.queue_depth.labels(queue="query").set(len(self._waiting))
                return batch
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), None if d.wait_s == float("inf") else d.wait_s)
            except asyncio.TimeoutError:
                pass

    async def _prep_loop(self) -> None:
        """Takes batches and preps them, ``PREP_INFLIGHT`` at once with an engine and overlap, else 1."""
        slots = asyncio.Semaphore(PREP_INFLIGHT if self.dispatch is not None and self.cfg.overlap else 1)
        while True:
            await slots.acquire()
            batch = await self._next_batch()
            self._batch_ids += 1
            t = asyncio.create_task(self._prep_batch(batch, self._batch_ids))
            self._prep_tasks.add(t)
            t.add_done_callback(lambda t: (slots.release(), self._prep_tasks.discard(t)))

    async def _prep_batch(self, batch: list[QueryJob], batch_id: int) -> None:
        try:
            await isolated(lambda b: self._prep(b, batch_id), self._fail, batch, _alive)
            gen = [j for j in batch if _alive(j) and j.runs(GENERATE)]
            rest = [j for j in batch if j not in gen]
            await self._run(rest, answer=True)  # retrieval only: promotion, then the reply
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("query batch failed")
            for j in batch:
                self._fail(j, exc)
                if self.dispatch is not None:
                    self.dispatch.forget(j)  # its engine request, if the context step started one
            return
        finally:
            self._preparing -= len(batch)
        for j in rest:
            self._finish(j)
        if gen and self.dispatch is not None:
            tasks = [self.dispatch.spawn(j, self._answer) for j in gen]
            if not self.cfg.overlap:  # the engine stage empties before the next prep
                await asyncio.wait(tasks)
        elif gen:
            done = asyncio.get_running_loop().create_future()
            self._generating += 1
            done.add_done_callback(lambda _: self._dec_generating())
            await self._gen_queue.put((gen, done))
            if not self.cfg.overlap:
                await done

    def _queued(self, batch: list[QueryJob], batch_id: int) -> None:
        """A prep batch starts: its size, each new request's batch id and queue time (QueryJob.queued)."""
        t0 = time.perf_counter()
        new = [j for j in batch if j.queued(batch_id, t0)]  # (not a request prepared again alone)
        if new:
            self.metrics.batch_size.labels(stage="prep").observe(len(new))
        for j in new:
            self.metrics.stage_seconds.labels(stage="queue").observe(t0 - j.enqueued)

    async def _prep(self, batch: list[QueryJob], batch_id: int) -> None:
        self._queued(batch, batch_id)
        live = [j for j in batch if not j.cancelled]
        await self._run(live, answer=False)
        for j in live:
            if j.events is not None:
                j.events.put_nowait(("sources", j))

    async def _run(self, jobs: list[QueryJob], *, answer: bool) -> None:
        """Run one phase of the jobs' plans (:func:`split_plan`: prep, or answer) step by step:
        each step once, over the live jobs whose plan lists it; recorded on each of them and once
        per request in ``oprag_stage_seconds{stage=<op>}`` (its count = requests that ran it)."""
        for step in batch_steps([split_plan(j.plan)[answer] for j in jobs]):
            todo = [j for j in jobs if step in j.plan and _alive(j)]
            if todo:
                await self._step(step, todo)

    async def _step(self, step: PlanStep, todo: list[QueryJob]) -> None:
        """Run one step over ``todo``; recorded on each request and in ``oprag_stage_seconds``."""
        t = time.perf_counter()
        run_s = await self._operators[step.op](todo)
        end = time.perf_counter()
        run_s = end - t if run_s is None else run_s
        hist = self.metrics.stage_seconds.labels(stage=step.op)
        for j in (j for j in todo if not j.recorded(step.op)):  # (once: QueryJob.recorded)
            hist.observe(run_s)  # one observation per request (a batch's run time, seen by each of them)
            j.record(step, end, run_s)

    # ------------------------------------------------------------------ operators
    async def _memory(self, jobs: list[QueryJob]) -> None:
        """Session memory lookup (one shard call per shard for the batch): the session context."""
        for j, m in zip(jobs, await self.memory.lookup([j.question for j in jobs], [j.session_id for j in jobs])):
            j.memory = m

    async def _embed(self, jobs: list[QueryJob]) -> None:
        """Query embedding of each question and, in the same call, of a session context that has
        no stored session vector (a condensed rewrite, old records); a context row with one gets
        :func:`~oprag_server.operators.memory.context_vector` (no encoder row)."""
        ctx = [j for j in jobs if j.memory is not None and j.memory.context_text]
        text = [j for j in ctx if j.memory.session_vector is None]
        vecs = await self.embedder.embed_queries([j.question for j in jobs] + [j.memory.context_text for j in text])
        for j, v in zip(jobs, vecs):
            j.vector = v
        for j, v in zip(text, vecs[len(jobs):]):
            j.context_vector = v
        for j in ctx:
            if j.memory.session_vector is not None:
                j.context_vector = context_vector(j.vector, j.memory.session_vector)

    async def _retrieve(self, jobs: list[QueryJob]) -> float:
        """Shard search, global merge and fusion, hit fields, and grouping by document for the
        requests that ask for it (:mod:`~oprag_server.operators.group`); under the index read lock.
        A request with a session context gets a second row, fused with its own
        (:func:`~oprag_server.operators.memory.session_rows`). :returns: run time (s), lock wait excluded."""
        ctx, vecs, texts, specs = session_rows(jobs)
        async with self.lock.read():
            hits, times, infos, docs = await retrieve_documents(self.retriever.retrieve, vecs, texts, specs)
        fusion_hist = self.metrics.stage_seconds.labels(stage="fusion")
        for j, h, info, d in zip(jobs, hits, infos, docs):
            j.hits, j.info, j.documents = h, info, d
            if not j.recorded("retrieve"):  # (once: QueryJob.recorded) ``fusion`` is part of ``retrieve``;
                fusion_hist.observe(times["fusion"])  # ``rerank`` is its old name, kept on the wire
                j.timings_ms["fusion"] = j.timings_ms["rerank"] = times["fusion"] * 1000
        for j, h in zip(ctx, hits[len(jobs):]):
            j.hits = fuse_session(j.hits, h, j.spec.top_k, j.memory, j.question, self.retriever.analyzer.tokens,
                                  lambda ts: self.retriever.stats.query_idf(ts, self.retriever.bm25.epsilon))
        self.monitor.sample([j for j in jobs if not j.recorded("retrieve")])
        return times["retrieve"]

    async def _context(self, jobs: list[QueryJob]) -> None:
        """The prompt of each request; one that does not fit fails alone (:class:`QueryRejected`)."""
        for j in jobs:
            try:
                j.payload = build_context(j.question, j.hits, self.generator, budget_tokens=self.gen_cfg.context_tokens,
                                          max_new_tokens=j.max_new_tokens,
                                          memory_text=j.memory.memory_text if j.memory else "")
            except ValueError as exc:  # this request only: the rest of the batch goes on
                self._fail(j, QueryRejected(str(exc)))
                continue
            without_sources(j, self.gen_cfg.answer_without_sources, self.metrics)  # no sources: no generate
            if self.dispatch is not None and self.cfg.overlap and j.runs(GENERATE):  # to the engine now,
                self.dispatch.handoff(j)  # not when the whole batch is prepared

    def _dec_generating(self) -> None:
        self._generating -= 1
        self._arrived.set()  # a waiting batch may close now

    # ------------------------------------------------------------------ generate
    async def _gen_loop(self) -> None:
        while True:
            t_idle = time.perf_counter()
            batch, done = await self._gen_queue.get()
            idle = time.perf_counter() - t_idle
            self.metrics.generator_seconds.labels(state="idle").inc(idle)
            try:
                await self._run(batch, answer=True)  # generate, then promotion
            except Exception as exc:  # noqa: BLE001
                log.exception("generation batch failed")
                for j in batch:
                    self._fail(j, exc)
            finally:
                for j in batch:
                    self._finish(j)
                if not done.done():
                    done.set_result(None)

    async def _answer(self, job: QueryJob) -> None:
        """Engine backend: one request's answer phase (generate, promote), then its reply."""
        try:
            await self._run([job], answer=True)
        except Exception as exc:  # noqa: BLE001 - this request only
            self._fail(job, exc)
        finally:
            self._finish(job)

    async def _generate(self, jobs: list[QueryJob]) -> float:
        """Batched decoding on the generator worker thread, or one request streamed from the
        engine (:class:`EngineDispatch`); text streams to ``job.events``.

        :returns: its run time in seconds (the wait for the generator is the step's queue time).
        """
        if self.dispatch is not None:
            return await self.dispatch.generate(jobs[0])
        loop = asyncio.get_running_loop()
        self.metrics.batch_size.labels(stage="generate").observe(len(jobs))
        self.metrics.batch_fill.observe(len(jobs) / self.cfg.max_batch)
        t = time.perf_counter()
        for j in jobs:
            self.metrics.stage_seconds.labels(stage="generate_queue").observe(t - j.last_end)
        prompts, max_new = [j.payload.prompt for j in jobs], [j.max_new_tokens for j in jobs]
        cuts = StopCuts([j.stop for j in jobs], lambda row, text: loop.call_soon_threadsafe(self._on_text, jobs[row], text),
                        lambda row: jobs[row].cancelled)  # (generator thread -> event loop)
        results = await loop.run_in_executor(
            self.gen_executor,
            lambda: self.generator.generate(prompts, max_new, on_token=cuts.emit, should_stop=cuts.should_stop),
        )
        dt = time.perf_counter() - t
        self.metrics.generator_seconds.labels(state="busy").inc(dt)
        toks = sum(r.completion_tokens for r in results)
        if dt > 0:
            self.metrics.tokens_per_second.set(toks / dt)
        self._generated(dt)
        for row, (j, r) in enumerate(zip(jobs, results)):
            j.answer, j.finish_reason, held = cuts.result(row, r.text, r.finish_reason)
            if held:  # (after every delta the thread sent: they were queued before the result)
                self._on_text(j, held)
            j.completion_tokens = r.completion_tokens
            self.metrics.generated_tokens.inc(r.completion_tokens)
        return dt

    def _on_text(self, job: QueryJob, delta: str) -> None:
        if not job.ttft_ms:
            job.ttft_ms = (time.perf_counter() - job.enqueued) * 1000
            self.metrics.ttft_seconds.observe(job.ttft_ms / 1000)
        if job.events is not None and delta:
            job.events.put_nowait(("text", delta))

    async def _promote(self, jobs: list[QueryJob]) -> None:
        """Write each turn into its session's memory, "" as an unanswered one's answer (best effort;
        not when its session was cleared after the request arrived)."""
        outs = await asyncio.gather(
            *[self.memory.promote(j.session_id, j.question, j.answer, j.hits, j.resolved_vector, j.resolved_query or j.question,
                                  started=j.started) for j in jobs],
            return_exceptions=True,
        )
        for o in outs:  # (a store refusing writes fails every turn: a few log lines, not one per turn)
            self._promote_failures.failed(o) if isinstance(o, Exception) else self._promote_failures.ok()

    # ------------------------------------------------------------------ completion
    def _finish(self, j: QueryJob) -> None:
        j.timings_ms["total"] = (time.perf_counter() - j.enqueued) * 1000
        self._served(j)
        if j.future is not None and not j.future.done():
            j.future.set_result(j)

    def _fail(self, j: QueryJob, exc: BaseException) -> None:
        if j.future is not None and not j.future.done():
            j.future.set_exception(exc)
