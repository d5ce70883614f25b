"""The pruning-loss monitor: a sample of live dense-first (hybrid) queries is re-run in exact
mode (``full_hybrid``) off the request path, and their Recall@k against it is exported as
``oprag_pruning_recall``. Moved out of :mod:`oprag_server.engine.query` unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import numpy as np

log = logging.getLogger("oprag_server.engine.query")


class PruningMonitor:
    """:param fraction: share of dense-first queries re-run (every (1/fraction)-th, deterministic).
    :param max_inflight: re-runs at once; beyond it a sample is skipped (and counted)."""

    def __init__(self, retriever: Any, lock: Any, metrics: Any, fraction: float, max_inflight: int) -> None:
        self.retriever, self.lock, self.metrics = retriever, lock, metrics
        self.fraction, self.max_inflight = fraction, max_inflight
        self._credit = 0.0
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
        if len(self.tasks) >= self.max_inflight:
            self.metrics.pruning_checks_skipped.inc(len(picked))
            return
        t = asyncio.create_task(self._check(picked))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _check(self, jobs: list[Any]) -> None:
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
