"""The bounds on an ingest stream's time (README "Ingest streams"; trial24: four streams that
stopped sending held every slot and each further stream waited forever, without a word).

* Slots: at most ``IngestConfig.max_concurrent_streams`` streams run at once (``--max-ingest-streams``).
  A further stream waits for a slot up to ``slot_wait_s`` (``--ingest-slot-wait-s``), and no
  longer than until :data:`DEADLINE_MARGIN_S` before its own deadline, then it is refused
  (:class:`IngestBusy`: RESOURCE_EXHAUSTED with ``retry-after-ms``) before it started: nothing of
  it is read or stored. Counted in ``oprag_overload_rejections_total{queue="ingest"}``.
* Idle limit: a stream holding a slot whose client sends no message for ``idle_s``
  (``--ingest-idle-s``; 0: no limit) fails with :class:`IngestIdle` (ABORTED); the pipeline aborts
  it as any failed stream (nothing stored, ``oprag_ingest_streams_aborted_total``) and its slot is
  free. Only the wait for the client's next message counts: a stream that sends slowly but
  steadily, or that the server's own stages hold back (backpressure), is never cut.

Each refusal and each idle abort logs one WARNING line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ..config import IngestConfig
from .errors import Overloaded

log = logging.getLogger(__name__)

#: a stream waiting for a slot is refused this many seconds before its deadline at the latest, so
#: that its caller is told RESOURCE_EXHAUSTED (not started, nothing stored) rather than DEADLINE_EXCEEDED
DEADLINE_MARGIN_S = 0.5
#: the ``retry-after-ms`` a refused stream is given (seconds)
RETRY_AFTER_S = 1.0


class IngestBusy(Overloaded):
    """Every ingest slot stayed taken while the stream waited: it was refused before it started."""

    def __init__(self, streams: int, waited_s: float, why: str) -> None:
        Exception.__init__(self, (
            f"{streams} ingest streams are in progress (--max-ingest-streams {streams}); this stream waited "
            f"{waited_s:.1f} s for one to end ({why}) and was not started: nothing of it was stored; retry later"))
        self.queue, self.retry_after_s = "ingest", RETRY_AFTER_S


class IngestIdle(Exception):
    """The client sent no message for the idle limit: the stream was aborted (nothing stored)."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(
            f"the stream sent no message for {idle_s:g} s (--ingest-idle-s {idle_s:g}) and was aborted: nothing of it "
            "was stored; send it again (an open stream holds one of the --max-ingest-streams slots until it ends)")


class StreamSlots:
    """The ingest slots: ``async with slots.held(time_left): ...`` runs one stream.

    :param cfg: ``max_concurrent_streams`` (slots) and ``slot_wait_s`` (seconds, >= 0).
    :param metrics: ``rejected_overload`` (a Counter with the label ``queue``), or None.
    """

    def __init__(self, cfg: IngestConfig, metrics: Any = None) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.sem = asyncio.Semaphore(cfg.max_concurrent_streams)

    @asynccontextmanager
    async def held(self, time_left: float | None = None):
        """Hold a slot for the body.

        :param time_left: seconds to the caller's deadline (None: none); the wait ends
            :data:`DEADLINE_MARGIN_S` before it.
        :raises IngestBusy: no slot came free within the wait (nothing was read from the stream).
        """
        wait, why = self.cfg.slot_wait_s, f"--ingest-slot-wait-s {self.cfg.slot_wait_s:g}"
        if time_left is not None and time_left - DEADLINE_MARGIN_S < wait:
            wait, why = max(0.0, time_left - DEADLINE_MARGIN_S), f"its deadline was {time_left:.1f} s away"
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(wait):  # (Semaphore.acquire is cancel-safe: no slot is lost)
                await self.sem.acquire()
        except TimeoutError:
            n, waited = self.cfg.max_concurrent_streams, time.perf_counter() - t0
            log.warning("Ingest stream refused (RESOURCE_EXHAUSTED): %d streams in progress (--max-ingest-streams), "
                        "none ended within %.1f s (%s)", n, waited, why)
            if self.metrics is not None:
                self.metrics.rejected_overload.labels(queue="ingest").inc()
            raise IngestBusy(n, waited, why) from None
        try:
            yield
        finally:
            self.sem.release()


async def idle_limited(messages: AsyncIterator[Any], idle_s: float) -> AsyncIterator[Any]:
    """``messages``, failing when the next one takes longer than ``idle_s`` seconds (0: never).

    :raises IngestIdle: no message (nor the stream's end) within ``idle_s``; the wait for it is cancelled.
    """
    it = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_s or None):
                msg = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            log.warning("Ingest stream aborted: no message for %g s (--ingest-idle-s); nothing of it was stored", idle_s)
            raise IngestIdle(idle_s) from None
        yield msg
