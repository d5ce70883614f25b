"""The pruning-loss monitor: a sample of live dense-first (hybrid) queries is re-run in exact
mode (``full_hybrid``) off the request path, and their Recall@k against it is exported as
``oprag_pruning_recall``.

An exact re-run costs far more than the query it checks (at a million chunks ~200 ms of shard
time against ~10 ms), and a shard serves one request at a time, so a fixed share of re-runs
would become most of the shards' work as the corpus grows. The re-runs therefore also keep to a
time budget: a sample is skipped (counted in ``oprag_pruning_checks_skipped_total``) while the
re-runs' wall time so far exceeds :attr:`PruningMonitor.BUDGET` of the time since the first one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import numpy as np

log = logging.getLogger("oprag_server.engine.query")


class PruningMonitor:
    """:param fraction: share of dense-first queries re-run (every (1/fraction)-th, deterministic).
    :param max_inflight: re-runs at once; beyond it a sample is skipped (and counted)."""

    #: share of wall time the exact re-runs may take (module docstring)
    BUDGET = 0.02

    def __init__(self, retriever: Any, lock: Any, metrics: Any, fraction: float, max_inflight: int) -> None:
        self.retriever, self.lock, self.metrics = retriever, lock, metrics
        self.fraction, self.max_inflight = fraction, max_inflight
        self._credit = 0.0
        self._spent, self._since = 0.0, None  # seconds of re-runs; monotonic time of the first
        self.tasks: set[asyncio.Task] = set()

    def sample(self, jobs: list[Any]) -> None:
        """Pick every (1/fraction)-th dense-first query (deterministic) for an exact re-run."""
        if self.fraction <= 0:
            return
        picked = []
        for j in jobs:
            if j.spec.mode != "hybrid" or not j.hits or j.spec.group_by_document or (j.memory and j.memory.used):
                continue  # grouped or memory-fused hits are not the question's chunk top-k: nothing to compare
            self._credit += self.fraction
            if self._credit >= 1.0:
                self._credit -= 1.0
                picked.append(j)
        if not picked:
            return
        now = time.monotonic()
        if self._since is None:
            self._since = now
        over = self._spent > self.BUDGET * (now - self._since)
        if len(self.tasks) >= self.max_inflight or over:
            self.metrics.pruning_checks_skipped.inc(len(picked))
            return
        t = asyncio.create_task(self._check(picked))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _check(self, jobs: list[Any]) -> None:
        t0 = time.monotonic()
        try:
            specs = [dataclasses.replace(j.spec, mode="full_hybrid") for j in jobs]
            vecs = np.stack([j.vector for j in jobs]).astype(np.float32, copy=False)
            texts = [j.retrieval_text for j in jobs]
            async with self.lock.read():
                exact, _, _ = await self.retriever.retrieve(vecs, texts, specs)
            for j, ex in zip(jobs, exact):
                if ex:
                    want = {h.chunk_id for h in ex}
                    got = {h.chunk_id for h in j.hits[: len(ex)]}
                    self.metrics.pruning_recall.observe(len(want & got) / len(want))
        except Exception:  # noqa: BLE001 - the monitor never affects serving
            log.exception("pruning-loss monitor failed")
        finally:
            self._spent += time.monotonic() - t0
