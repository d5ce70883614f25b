"""Generation on an engine that batches by itself (:class:`~oprag_server.models.protocols.EngineGenerator`).

With such a backend the query executor forms no generation batches: each request goes to the
engine as soon as its prompt is built, at most ``max_inflight`` at once (the rest wait for a
slot in arrival order), while the prep loop goes on preparing newer arrivals. The engine's
continuous batching merges them into its running batch. While the engine stage holds fewer
requests than wait for prep (:attr:`EngineDispatch.active` < queue) the prep loop takes only a
quarter of the waiting requests (at least one), so the engine gets work after a short prep
instead of after the whole queue's (closed-loop clients whose answers ended together otherwise
stay one cohort that alternates between prep and engine, the engine idle during each prep).

The engine's HTTP streams run on their own event loop in one thread (:class:`EngineIO`), not
on the frontend's loop: a stream read never waits behind a prep step (a batch's retrieval merge
and prompt building hold the frontend's loop for tens of ms), and a request whose prompt is
built is sent at once (:meth:`EngineDispatch.handoff`, called by the context step per request)
instead of when its whole prep batch ends. The frontend's loop gets one call per request (the
result) plus one per text delta only for ``QueryStream``. The thread shares the GIL with the
frontend's loop; it gets it within the interpreter's switch interval (5 ms) of being woken.

Admission: :meth:`EngineDispatch.estimated_delay_s` = requests ahead of a new one (waiting for a
slot, in prep, or waiting for prep) / measured engine throughput, where throughput =
``max_inflight`` / EWMA of one request's time in the engine (requests per second with all slots
busy).

Cancellation (client gone, gRPC deadline): :meth:`EngineDispatch.cancel` cancels the request's
engine stream on the engine thread, which closes its HTTP stream so the engine frees the slot;
the time from the cancel to the closed stream is ``oprag_engine_cancel_release_seconds``. The
slot is given to the next request only once the stream is closed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..models.protocols import EngineUsage
from .admission import ewma
from .stops import StopCut

log = logging.getLogger(__name__)


class EngineIO:
    """One daemon thread running its own asyncio event loop for the engine's HTTP streams."""

    def __init__(self, name: str = "oprag-engine-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        """Run ``coro`` on the engine loop; cancelling the returned future cancels it there."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def stop(self, last: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Run ``last()`` on the engine loop (e.g. close its HTTP client), then end the thread."""
        if not self._thread.is_alive():
            return
        if last is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.submit(last())), 10.0)
            except Exception:  # noqa: BLE001 - shutting down
                log.exception("closing the engine client failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 10.0)
        if not self._thread.is_alive():
            self.loop.close()


#: Period of the event-loop lag probe (s): ``oprag_event_loop_lag_seconds`` = how late it fires.
LAG_PROBE_S = 0.02


async def lag_probe(hist: Any) -> None:
    """Forever: sleep :data:`LAG_PROBE_S` and observe how much later than asked the loop woke."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        hist.observe(max(0.0, time.perf_counter() - t - LAG_PROBE_S))


class EngineDispatch:
    """Per-request dispatch to an engine generator.

    :param generator: an :class:`~oprag_server.models.protocols.EngineGenerator`.
    :param metrics: :class:`~oprag_server.service.metrics.Metrics` (``engine_*`` metrics).
    :param on_text: ``on_text(job, delta)``, called in the frontend's event loop for the first
        text delta of a request and, for a job with ``events`` (``QueryStream``), every delta.
    :param io_thread: stream on :class:`EngineIO` (default) or on the caller's event loop.
    """

    def __init__(self, generator: Any, metrics: Any, on_text: Callable[[Any, str], None], *,
                 io_thread: bool = True) -> None:
        self.gen, self.metrics, self.on_text = generator, metrics, on_text
        self.max_inflight = int(generator.max_inflight)
        self._free = self.max_inflight  # slots not held by a request
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self.in_engine = 0  # requests streaming from the engine now
        self.waiting = 0  # prepared requests waiting for a slot
        self.request_s_ewma = 2.0  # seconds one request spends in the engine (start value)
        self._timed = 0  # requests timed into request_s_ewma
        self._tasks: dict[int, asyncio.Task] = {}
        self._started: dict[int, tuple[concurrent.futures.Future | asyncio.Task, asyncio.Future]] = {}
        self._cancelled_at: dict[int, float] = {}
        self._io = EngineIO() if io_thread else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._probes: list[Any] = []
        for loop in ("frontend", "engine") if io_thread else ("frontend",):  # exported (0) before the probes start
            metrics.event_loop_lag_seconds.labels(loop=loop)

    @property
    def active(self) -> int:
        """Requests handed to the engine stage (spawned or already streaming) and not finished."""
        return len(self._tasks.keys() | self._started.keys())

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
        t.add_done_callback(lambda _: self._tasks.pop(id(job), None))
        return t

    def handoff(self, job: Any) -> None:
        """``job``'s prompt is built: send it to the engine now if a slot is free and no earlier
        request waits for one (else :meth:`generate` waits for a slot). Frontend loop only."""
        if self._free > 0 and not self._slot_waiters and id(job) not in self._started and not getattr(job, "cancelled", False):
            self._free -= 1
            self._start(job)

    def forget(self, job: Any) -> None:
        """``job`` failed before its answer phase: stop its engine request if one was started."""
        entry = self._started.pop(id(job), None)
        if entry is not None:
            entry[0].cancel()

    def cancel(self, job: Any) -> None:
        """The client went away: cancel the job's engine request (closes its HTTP stream)."""
        entry = self._started.pop(id(job), None)
        t = self._tasks.get(id(job))
        if (entry is not None and not entry[1].done()) or (t is not None and not t.done()):
            self._cancelled_at.setdefault(id(job), time.perf_counter())
        if entry is not None:
            entry[0].cancel()
        if t is not None and not t.done():
            t.cancel()

    async def stop(self) -> None:
        for t in [*self._tasks.values(), *self._probes]:
            t.cancel()
        for cf, _ in list(self._started.values()):
            cf.cancel()
        await asyncio.gather(*self._tasks.values(), *self._probes[:1], return_exceptions=True)
        if self._started:
            await asyncio.wait([asyncio.shield(d) for _, d in self._started.values()], timeout=10.0)
        if self._io is not None:
            await self._io.stop(getattr(self.gen, "aclose_client", None))
        await self.gen.aclose()

    # ------------------------------------------------------------------ slots
    async def _acquire(self) -> None:
        if self._free > 0 and not self._slot_waiters:
            self._free -= 1
            return
        w = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(w)
        try:
            await w  # the releasing request passed its slot on
        except asyncio.CancelledError:
            if w.done() and not w.cancelled():
                self._release()  # it was handed over just now: pass it on
            elif w in self._slot_waiters:  # (a release may have dropped it already)
                self._slot_waiters.remove(w)
            raise

    def _release(self) -> None:
        while self._slot_waiters:
            w = self._slot_waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        self._free += 1

    # ------------------------------------------------------------------ streaming
    def _start(self, job: Any) -> tuple[Any, asyncio.Future]:
        """Start ``job``'s engine stream (its slot is held). :returns: ``(handle, done)``: the
        stream's future or task (cancel it to close the stream) and a future that resolves to
        ``(pieces, usage, seconds)`` once the stream is closed."""
        if self._loop is None:  # the first request: the loops' lag probes start
            self._probes = [asyncio.ensure_future(lag_probe(self.metrics.event_loop_lag_seconds.labels(loop="frontend")))]
            if self._io is not None:
                self._probes.append(self._io.submit(lag_probe(self.metrics.event_loop_lag_seconds.labels(loop="engine"))))
        self._loop = asyncio.get_running_loop()
        self.in_engine += 1
        self.metrics.engine_inflight.set(self.in_engine)
        done = self._loop.create_future()
        coro = self._pump(job, done)
        handle: Any = self._io.submit(coro) if self._io is not None else asyncio.ensure_future(coro)
        self._started[id(job)] = (handle, done)
        return handle, done

    async def _pump(self, job: Any, done: asyncio.Future) -> None:
        """On the engine loop: stream ``job`` into a list of pieces; the result goes to ``done``
        on the frontend's loop after the stream is closed."""
        t = time.perf_counter()
        usage, pieces, err, cut = EngineUsage(), [], None, StopCut(getattr(job, "stop", ()))
        post = self._loop.call_soon_threadsafe if self._io is not None else self._loop.call_soon

        def put(text: str) -> None:
            if text:
                pieces.append(text)
                if len(pieces) == 1 or getattr(job, "events", None) is not None:
                    post(self.on_text, job, text)

        stream = self.gen.stream(job.payload.messages, job.max_new_tokens, usage, stop=cut.stops)
        try:
            async for delta in stream:  # (cut here too: an engine may ignore the request's stop strings)
                put(cut.feed(delta))
                if cut.hit:
                    usage.finish_reason = "stop"
                    break
            put(cut.flush())
        except BaseException as exc:  # noqa: BLE001 - handed to the frontend's loop below
            err = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            try:
                await stream.aclose()  # closes the HTTP stream (also when this task is cancelled)
            finally:
                cancelled_at = self._cancelled_at.pop(id(job), None)
                if cancelled_at is not None:
                    self.metrics.engine_cancel_release_seconds.observe(time.perf_counter() - cancelled_at)
                post(self._finished, job, done, pieces, usage, time.perf_counter() - t, err)

    def _finished(self, job: Any, done: asyncio.Future, pieces: list[str], usage: EngineUsage, dt: float,
                  err: BaseException | None) -> None:
        """Frontend loop: the stream is closed; free the slot and hand the result to :meth:`generate`."""
        self.in_engine -= 1
        self.metrics.engine_inflight.set(self.in_engine)
        self._release()
        self._cancelled_at.pop(id(job), None)  # a cancel that came after the stream ended
        if done.done():
            return
        if err is None:
            self.request_s_ewma = ewma(self.request_s_ewma, dt, self._timed)
            self._timed += 1
            done.set_result((pieces, usage, dt))
        elif isinstance(err, Exception):
            done.set_exception(err)
        else:
            done.cancel()

    async def generate(self, job: Any) -> float:
        """Stream one request's answer from the engine into ``job`` (``answer``,
        ``completion_tokens``, ``finish_reason``); usage goes to ``oprag_engine_tokens_total``.

        :returns: seconds in the engine (the wait for a slot is the step's queue time).
        :raises EngineUnavailable | EngineTimeout | EngineRejected: from the engine.
        """
        entry = self._started.get(id(job))
        if entry is None:
            self.waiting += 1
            try:
                await self._acquire()
            finally:
                self.waiting -= 1
            entry = self._start(job)
        handle, done = entry
        try:
            pieces, usage, dt = await asyncio.shield(done)
        except asyncio.CancelledError:
            handle.cancel()  # closes the stream (the slot is freed once it is closed)
            raise
        finally:
            if self._started.get(id(job)) is entry:
                self._started.pop(id(job), None)
        job.answer = "".join(pieces)
        job.completion_tokens = usage.completion_tokens or len(pieces)
        job.finish_reason = usage.finish_reason or "stop"
        self.metrics.generated_tokens.inc(job.completion_tokens)
        self.metrics.engine_tokens.labels(kind="prompt").inc(usage.prompt_tokens)
        self.metrics.engine_tokens.labels(kind="cached").inc(usage.cached_tokens)
        self.metrics.engine_tokens.labels(kind="completion").inc(job.completion_tokens)
        return dt
