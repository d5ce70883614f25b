"""Admission to :class:`~oprag_server.engine.query.QueryEngine` and the hint a refusal carries.

``queue_capacity`` bounds the admitted, unfinished queries; ``max_queue_delay_ms`` refuses a
generating query whose estimated queueing delay exceeds it. A refusal (:class:`.errors.Overloaded`)
carries ``retry_after_s`` (gRPC trailer ``retry-after-ms``, HTTP ``Retry-After``). A full queue
frees a slot when an admitted request ends: one that only retrieves (``Retrieve``; ``Query``
without generation or on ``--generator none``) ends about a prep batch after its batch started
(~10-50 ms on CPU), one that generates a generation batch (builtin generator) or an engine
request later (0.5 s to many seconds). So the hint of a full queue is the recent service time of
the kind that ends first -- retrieval-only while one is admitted, else generating -- within
[:data:`RETRY_MIN_S`, :data:`RETRY_MAX_S`]. (It was the generation batch time for every refusal:
0.5 s at start and never updated without the builtin generator, 25x a Retrieve's time; trial18.)
"""

from __future__ import annotations

from .errors import Overloaded
from .job import QueryJob
from .scheduler import GENERATE

#: bounds of a full queue's retry-after hint, seconds
RETRY_MIN_S, RETRY_MAX_S = 0.05, 30.0
#: weight of a new sample in the service-time EWMAs
EWMA_WEIGHT = 0.2


def ewma(old: float, sample: float, n: int) -> float:
    """The service-time average after ``sample`` (seconds), ``n`` samples taken before it: the
    first replaces the start value (trial20: an average from 0.5 s crept 0.5 -> 1.4 -> 2.2 s
    while each batch took 5.2 s), later ones weigh :data:`EWMA_WEIGHT`."""
    return sample if n == 0 else old + EWMA_WEIGHT * (sample - old)


class Admission:
    """Mixed into ``QueryEngine`` (its state: ``cfg``, ``metrics``, ``dispatch``, ``_inflight``,
    ``_waiting``, ``_preparing``; it sets this mixin's: ``retrieve_s`` (EWMA of a retrieval-only
    request's time from its prep batch's start to its answer, seconds), ``generate_s`` (EWMA of a
    builtin generation batch's time, seconds) and ``_retrieving`` (admitted retrieval-only
    requests not finished))."""

    def _admit(self, job: QueryJob) -> None:
        """:raises Overloaded: the queue is full, or (``max_queue_delay_ms``) ``job`` generates and
        would wait longer than that for its batch."""
        if self._inflight >= self.cfg.queue_capacity:
            self.metrics.rejected_overload.labels(queue="query").inc()
            raise Overloaded("query", retry_after_s=self.retry_after_s())
        if self.cfg.max_queue_delay_ms > 0 and job.generate:
            est = self.estimated_delay_s()
            if est * 1000 > self.cfg.max_queue_delay_ms:
                self.metrics.rejected_overload.labels(queue="query_latency").inc()
                raise Overloaded("query", retry_after_s=est)

    def estimated_delay_s(self) -> float:
        """Queueing delay a new query would see: batches ahead of it x recent batch time (s);
        with an engine backend :meth:`EngineDispatch.estimated_delay_s`."""
        if self.dispatch is not None:
            return self.dispatch.estimated_delay_s(len(self._waiting) + self._preparing)
        batches_ahead = self._inflight // self.cfg.max_batch
        return batches_ahead * self.generate_s

    def retry_after_s(self) -> float:
        """Seconds until a full queue likely frees a slot (module docstring): ``retrieve_s`` while
        a retrieval-only request is admitted, else ``generate_s`` (with an engine: its request
        time over its slots, one request ending at a time); within [``RETRY_MIN_S``, ``RETRY_MAX_S``]."""
        if self._retrieving:
            s = self.retrieve_s
        elif self.dispatch is not None:
            s = self.dispatch.request_s_ewma / self.dispatch.max_inflight
        else:
            s = self.generate_s
        return min(RETRY_MAX_S, max(RETRY_MIN_S, s))

    #: samples taken into ``retrieve_s`` / ``generate_s`` (:func:`ewma`)
    _retrieve_n = _generate_n = 0

    def _served(self, job: QueryJob) -> None:
        """``job`` is answered (``timings_ms["total"]`` set): one that only retrieved and whose
        prep batch started (``timings_ms["queue"]``) adds its time since then to ``retrieve_s``."""
        if "queue" in job.timings_ms and not job.runs(GENERATE):
            dt = (job.timings_ms["total"] - job.timings_ms["queue"]) / 1000
            self.retrieve_s = ewma(self.retrieve_s, dt, self._retrieve_n)
            self._retrieve_n += 1

    def _generated(self, dt: float) -> None:
        """A builtin generation batch took ``dt`` seconds: into ``generate_s``."""
        self.generate_s = ewma(self.generate_s, dt, self._generate_n)
        self._generate_n += 1
