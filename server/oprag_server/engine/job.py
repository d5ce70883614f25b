"""One query request on its way through the query executor (:mod:`oprag_server.engine.query`).

A :class:`QueryJob` holds three groups of fields:

* the **request**, set by the servicer and read-only afterwards;
* the **per-operator outputs**, each written by one operator of the plan;
* **timing and trace**, written by the executor as the plan's steps run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..domain import ContextPayload, DocumentHit, Hit, MemoryContext, RetrieveSpec
from .scheduler import PlanStep


@dataclass(frozen=True)
class StageRecord:
    """One executed plan step of one request (the wire's ``StageTrace``).

    :param queue_ms: ms between the end of the request's previous step (or its admission) and
        the start of this one: waiting for a batch, for the index lock, for the generator.
    :param run_ms: ms the step ran, for the whole batch it was part of.
    """

    op: str
    domain: str
    batch_id: int
    queue_ms: float
    run_ms: float


@dataclass
class QueryJob:
    # ---------------------------------------------------------------- request
    question: str
    spec: RetrieveSpec
    session_id: str = ""
    use_memory: bool = True  # False: the request disabled memory (no lookup, no promotion)
    generate: bool = True  # False: retrieval only (Retrieve RPC, or no generator loaded)
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # the answer ends before the first of these (engine.stops)
    request_id: str = ""
    query_vector: np.ndarray | None = None  # float32[D] given by the client: no embedding
    events: asyncio.Queue | None = None  # QueryStream: ("sources", job) / ("text", str), then the future resolves

    # ---------------------------------------------------------------- executor state
    future: asyncio.Future | None = None  # resolves to this job, or to the error that failed it
    cancelled: bool = False  # the client went away: skip the remaining steps
    plan: tuple[PlanStep, ...] = ()  # compiled at admission (scheduler.compile_plan)
    batch_id: int = 0

    # ---------------------------------------------------------------- per-operator outputs
    memory: MemoryContext | None = None  # memory: retrieval text and earlier turns
    vector: np.ndarray | None = None  # embed: float32[D], L2-normalised (or query_vector)
    context_vector: np.ndarray | None = None  # embed: float32[D] of memory.context_text (None: no context row)
    hits: list[Hit] = field(default_factory=list)  # retrieve: ranked, at most spec.top_k (grouped: documents' chunks)
    documents: list[DocumentHit] | None = None  # retrieve, with spec.group_by_document: ranked documents
    info: Any = None  # retrieve: RetrievalInfo
    payload: ContextPayload | None = None  # context: prompt and its numbered sources
    answer: str = ""  # generate
    completion_tokens: int = 0  # generate
    finish_reason: str = ""  # generate ("no_generator" from the start when the server has none)

    # ---------------------------------------------------------------- timing and trace
    enqueued: float = field(default_factory=time.perf_counter)  # admission, perf_counter seconds
    started: float = field(default_factory=time.time)  # arrival, time.time() s (a later ClearSession drops its turn)
    timings_ms: dict[str, float] = field(default_factory=dict)  # wire timings_ms (README: timings)
    ttft_ms: float = 0.0  # admission to first generated token
    stages: list[StageRecord] = field(default_factory=list)  # executed steps, in order
    last_end: float = 0.0  # perf_counter end of the latest executed step (admission before the first)

    def __post_init__(self) -> None:
        self.last_end = self.last_end or self.enqueued
        if self.query_vector is not None:
            self.vector = self.query_vector

    def runs(self, op: str) -> bool:
        """Whether this job's plan has the operator ``op``."""
        return any(s.op == op for s in self.plan)

    @property
    def retrieval_text(self) -> str:
        """What is embedded and BM25-scored for the question's own row."""
        return self.memory.retrieval_text if self.memory is not None else self.question

    @property
    def resolved_query(self) -> str:
        """The session context when memory changed the retrieval, else ""."""
        return self.memory.context_text if self.memory is not None and self.memory.used else ""

    @property
    def resolved_vector(self) -> np.ndarray | None:
        """float32[D] the turn was retrieved with: the context row's vector when memory changed
        the retrieval, else the question's (what its memory record stores)."""
        return self.context_vector if self.resolved_query and self.context_vector is not None else self.vector

    def queued(self, batch_id: int, t0: float) -> bool:
        """Its prep batch ``batch_id`` starts at ``t0`` (perf_counter seconds): note the batch id
        and ``timings_ms["queue"]``. :returns: False (nothing noted) when it was noted before (a
        request prepared again alone after its batch failed, :func:`isolated`)."""
        if "queue" in self.timings_ms:
            return False
        self.batch_id = batch_id
        self.timings_ms["queue"] = (t0 - self.enqueued) * 1000
        return True

    def recorded(self, op: str) -> bool:
        """Whether a step of operator ``op`` was recorded for this job already (a request whose
        prep batch failed is prepared again alone, :func:`isolated`: its steps are recorded once,
        at their first run)."""
        return any(s.op == op for s in self.stages)

    def record(self, step: PlanStep, end: float, run_s: float) -> None:
        """Note that ``step`` ran for this job for ``run_s`` seconds, ending at ``end``
        (perf_counter seconds): one trace entry and the ``timings_ms[step.op]`` key."""
        queue_s = max(0.0, end - run_s - self.last_end)
        self.stages.append(StageRecord(step.op, step.domain, self.batch_id, queue_s * 1000, run_s * 1000))
        self.timings_ms[step.op] = run_s * 1000
        self.last_end = end

    def trace(self) -> list[dict]:
        """The executed plan: per step ``{op, domain, batch_id, queue_ms, run_ms}``."""
        return [asdict(r) for r in self.stages]


async def isolated(run: Callable[[list[QueryJob]], Awaitable[None]], fail: Callable[[QueryJob, BaseException], None],
                   jobs: list[QueryJob], alive: Callable[[QueryJob], bool]) -> None:
    """``run(jobs)``; when it fails with two or more of ``jobs`` ``alive``, ``run([j])`` again for
    each of them alone, and ``fail(j, exc)`` for one that fails alone: a request that a batch
    step cannot serve fails by itself, not the requests batched with it (trial16: a hybrid RRF
    request whose filter matched nothing failed its whole batch with INTERNAL). Only for steps
    that change nothing stored (the prep: memory lookup, embedding, retrieval, the prompt).
    ``run`` records a request's queue time and steps once (:meth:`QueryJob.recorded`): the
    second run's time shows as the queue time of the request's next new step.

    :raises Exception: what ``run(jobs)`` raised, when fewer than two jobs were alive."""
    try:
        await run(jobs)
    except Exception:  # noqa: BLE001 - retried one by one below
        if sum(1 for j in jobs if alive(j)) < 2:
            raise
        logging.getLogger("oprag").exception("query batch failed in prep; its requests are prepared again one by one")
        for j in jobs:
            if alive(j):
                try:
                    await run([j])
                except Exception as exc:  # noqa: BLE001 - this request's own failure
                    fail(j, exc)
