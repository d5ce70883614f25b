"""The direct path of :class:`~oprag_server.engine.query.QueryEngine`: a request that does not
generate and that the prep loop would take alone at once runs in its caller's task, the batch of
one the loop would form (same steps and results, fewer event-loop hand-offs); one whose plan is
the retrieve step alone (a Retrieve with its query vector and no session memory: the common
request) also skips the batch machinery around that step (:meth:`DirectPath._lone`)."""

from __future__ import annotations

import asyncio
import logging

from .job import QueryJob
from .scheduler import GENERATE, compile_plan

log = logging.getLogger("oprag_server.engine.query")

#: the plan of a retrieval-only request with its own query vector and no session memory
LONE = compile_plan(memory=False, generate=False, embed=False)


class DirectPath:
    """Mixed into ``QueryEngine`` (its state: ``_waiting``, ``_preparing``, ``_busy``,
    ``_batch_ids``, ``_inflight``, ``_retrieving``, ``_arrived``, ``policy``, ``dispatch``; its steps:
    ``_queued``, ``_step``, ``_finish``)."""

    def _direct(self, job: QueryJob) -> bool:
        """Whether ``job`` runs in its caller's task: it does not generate and the prep loop
        would take it alone at once (nothing waits or is prepared, the generator is idle, one
        prep batch at a time). Same steps and results; fewer event-loop hand-offs."""
        if (self._waiting or self._preparing or self._busy or job.runs(GENERATE)
                or (self.dispatch is not None and self.cfg.overlap)
                or not self.policy.decide(1, 0.0, downstream_busy=self._generating > 0).take):
            return False
        self._busy, self._batch_ids, self._preparing = True, self._batch_ids + 1, 1
        return True

    async def _lone(self, job: QueryJob) -> QueryJob:
        """A direct request (:meth:`_direct`) whose plan is :data:`LONE`: what ``_prep_batch``
        does for it as a batch of one (the same step, metrics, timings, log line and errors),
        without its future, the walk of both phases' plans and the empty answer phase; the
        caller (``submit``) has admitted it. :returns: ``job``, answered."""
        self._inflight, self._retrieving = self._inflight + 1, self._retrieving + 1
        try:
            try:
                self._queued([job], self._batch_ids)
                await self._step(job.plan[0], [job])
            except Exception:
                log.exception("query batch failed")
                if self.dispatch is not None:
                    self.dispatch.forget(job)
                raise
            finally:
                self._preparing -= 1
            self._finish(job)
            return job
        except asyncio.CancelledError:
            job.cancelled = True  # the client went away
            if self.dispatch is not None:
                self.dispatch.cancel(job)
            raise
        finally:
            self._inflight, self._retrieving = self._inflight - 1, self._retrieving - 1
            self._busy = False
            if self._waiting:  # requests that came meanwhile form the next batch
                self._arrived.set()
