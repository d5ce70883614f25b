"""Generation on an engine that batches by itself (:class:`~oprag_server.models.protocols.EngineGenerator`).

With such a backend the query executor forms no generation batches: each request goes to the
engine as soon as its prompt is built (:meth:`EngineDispatch.spawn`), at most ``max_inflight``
at once (the rest wait for a slot in arrival order), while the prep loop goes on preparing newer
arrivals. The engine's continuous batching merges them into its running batch. While the engine
stage holds fewer requests than wait for prep (:attr:`EngineDispatch.active` < queue) the prep
loop takes only a quarter of the waiting requests (at least one), so the engine gets work after
a short prep instead of after the whole queue's (closed-loop clients whose answers ended together
otherwise stay one cohort that alternates between prep and engine, the engine idle during each
prep).

Admission: :meth:`EngineDispatch.estimated_delay_s` = requests ahead of a new one (waiting for a
slot, in prep, or waiting for prep) / measured engine throughput, where throughput =
``max_inflight`` / EWMA of one request's time in the engine (requests per second with all slots
busy).

Cancellation (client gone, gRPC deadline): :meth:`EngineDispatch.cancel` cancels the request's
task, which closes its HTTP stream so the engine frees the slot; the time from the cancel to the
closed stream is ``oprag_engine_cancel_release_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..models.protocols import EngineUsage

log = logging.getLogger(__name__)


class EngineDispatch:
    """Per-request dispatch to an engine generator.

    :param generator: an :class:`~oprag_server.models.protocols.EngineGenerator`.
    :param metrics: :class:`~oprag_server.service.metrics.Metrics` (``engine_*`` metrics).
    :param on_text: ``on_text(job, delta)``, called in the event loop per text delta.
    """

    def __init__(self, generator: Any, metrics: Any, on_text: Callable[[Any, str], None]) -> None:
        self.gen, self.metrics, self.on_text = generator, metrics, on_text
        self.max_inflight = int(generator.max_inflight)
        self._slots = asyncio.Semaphore(self.max_inflight)
        self.in_engine = 0  # requests streaming from the engine now
        self.waiting = 0  # prepared requests waiting for a slot
        self.request_s_ewma = 2.0  # seconds one request spends in the engine (start value)
        self._tasks: dict[int, asyncio.Task] = {}
        self._cancelled_at: dict[int, float] = {}

    @property
    def active(self) -> int:
        """Requests handed to the engine stage (spawned) and not finished."""
        return len(self._tasks)

    def estimated_delay_s(self, queued: int) -> float:
        """Seconds a new request would wait for an engine slot.

        :param queued: admitted requests not yet handed to the engine stage (waiting for prep or
            in prep; they will also need a slot).
        """
        ahead = max(0, self.waiting + queued + self.in_engine - self.max_inflight + 1)
        return ahead * self.request_s_ewma / self.max_inflight

    def spawn(self, job: Any, run: Callable[[Any], Awaitable[None]]) -> asyncio.Task:
        """Run ``run(job)`` (the answer phase of its plan: generate, promote, reply) as its own task
        (returned)."""
        t = asyncio.create_task(run(job))
        self._tasks[id(job)] = t
        t.add_done_callback(lambda _: (self._tasks.pop(id(job), None), self._cancelled_at.pop(id(job), None)))
        return t

    def cancel(self, job: Any) -> None:
        """The client went away: cancel the job's engine request (closes its HTTP stream)."""
        t = self._tasks.get(id(job))
        if t is not None and not t.done():
            self._cancelled_at[id(job)] = time.perf_counter()
            t.cancel()

    async def stop(self) -> None:
        for t in list(self._tasks.values()):
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self.gen.aclose()

    async def generate(self, job: Any) -> float:
        """Stream one request's answer from the engine into ``job`` (``answer``,
        ``completion_tokens``, ``finish_reason``); usage goes to ``oprag_engine_tokens_total``.

        :returns: seconds in the engine (the wait for a slot is the step's queue time).
        :raises EngineUnavailable | EngineTimeout | EngineRejected: from the engine.
        """
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.in_engine += 1
        self.metrics.engine_inflight.set(self.in_engine)
        t = time.perf_counter()
        usage, pieces = EngineUsage(), []
        stream = self.gen.stream(job.payload.messages, job.max_new_tokens, usage)
        try:
            async for delta in stream:
                pieces.append(delta)
                self.on_text(job, delta)
        finally:
            await stream.aclose()  # closes the HTTP stream (also when this task is cancelled)
            cancelled_at = self._cancelled_at.pop(id(job), None)
            if cancelled_at is not None:
                self.metrics.engine_cancel_release_seconds.observe(time.perf_counter() - cancelled_at)
            self.in_engine -= 1
            self.metrics.engine_inflight.set(self.in_engine)
            self._slots.release()
        dt = time.perf_counter() - t
        self.request_s_ewma = 0.8 * self.request_s_ewma + 0.2 * dt
        job.answer = "".join(pieces)
        job.completion_tokens = usage.completion_tokens or len(pieces)
        job.finish_reason = usage.finish_reason or "stop"
        self.metrics.generated_tokens.inc(job.completion_tokens)
        self.metrics.engine_tokens.labels(kind="prompt").inc(usage.prompt_tokens)
        self.metrics.engine_tokens.labels(kind="cached").inc(usage.cached_tokens)
        self.metrics.engine_tokens.labels(kind="completion").inc(job.completion_tokens)
        return dt
