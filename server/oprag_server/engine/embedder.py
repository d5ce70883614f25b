"""The embed worker: one persistent thread that owns the encoder, fed by two priority queues.

Query embeddings always go first; ingest chunks from every concurrent stream are pooled and
cut into batches of similar token length (across documents and across streams: the longest
pending chunks go first), so padding stays small and a query never waits behind more than one ingest batch. While queries are
arriving, ingest batches shrink to ``small_batch`` chunks, bounding how long a query can wait.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models.protocols import Encoder


@dataclass
class _Req:
    """One caller's texts (query) or token ids (ingest chunks) and the future for its vectors.

    For ingest requests ``out`` (float32 ``[len(ids), dim]``) and ``done_mask`` (bool
    ``[len(ids)]``) collect the rows as the batches that hold them finish."""

    ids: list[list[int]] | None
    texts: list[str] | None
    future: asyncio.Future
    truncate: bool = False
    out: np.ndarray | None = None
    done_mask: np.ndarray | None = None


class EmbedWorker:
    """:param encoder: the model (:class:`~oprag_server.models.protocols.Encoder`); only this
        worker's threads call it.
    :param batch_size: chunks per ingest forward pass when no query is waiting.
    :param small_batch: chunks per ingest forward pass while queries are active (or, with
        ``slice_s``, as many chunks as take about ``slice_s`` seconds at the measured rate).
    :param query_quiet_s: queries count as active for this long after the last one."""

    def __init__(self, encoder: Encoder, executor, metrics: Any, *, batch_size: int = 32, small_batch: int = 8,
                 query_quiet_s: float = 0.5, slice_s: float | None = None, query_executor=None) -> None:
        self.encoder = encoder
        self.executor = executor
        self.metrics = metrics
        self.batch_size = batch_size
        self.small_batch = small_batch
        self.query_quiet_s = query_quiet_s
        self.slice_s = slice_s  # adapt small batches to this many seconds of work (None: fixed)
        # With a query executor, query embeddings run on their own thread at once, beside any
        # ingest batch (which then keeps its full size); without one they wait for the ingest
        # batch in flight, and ingest batches shrink while queries are active.
        self.query_executor = query_executor
        self._per_chunk_s = 0.0
        self._queries: asyncio.Queue[_Req] = asyncio.Queue()
        self._ingest: list[tuple[_Req, int]] = []  # (request, next index) pooled across streams
        self._wake = asyncio.Event()
        self._qwake = asyncio.Event()
        self._last_query = 0.0
        self._task: asyncio.Task | None = None
        self._qtask: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())
        self._qtask = asyncio.create_task(self._query_loop()) if self.query_executor is not None else None

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._qtask) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def embed_queries(self, texts: list[str]) -> np.ndarray:
        """float32[B, D] for query texts (truncated to the embedder's limit), high priority."""
        fut = asyncio.get_running_loop().create_future()
        self._last_query = time.perf_counter()
        await self._queries.put(_Req(None, texts, fut, truncate=True))
        if self.query_executor is not None:
            self._qwake.set()
        else:
            self._wake.set()
        return await fut

    async def embed_chunks(self, ids: list[list[int]]) -> np.ndarray:
        """float32[B, D] for pre-tokenised chunks, pooled with other streams' chunks."""
        fut = asyncio.get_running_loop().create_future()
        self._ingest.append((_Req(ids, None, fut), 0))
        self.metrics.queue_depth.labels(queue="embed_ingest").set(sum(len(r.ids) for r, _ in self._ingest))
        self._wake.set()
        return await fut

    async def _run_queries(self, loop, executor) -> None:
        reqs = []
        while not self._queries.empty():
            reqs.append(self._queries.get_nowait())
        texts = [t for r in reqs for t in r.texts]
        try:
            vecs = await loop.run_in_executor(executor, lambda: self.encoder.encode(texts, truncate=True))
        except Exception as exc:  # noqa: BLE001
            for r in reqs:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        o = 0
        for r in reqs:
            if not r.future.done():
                r.future.set_result(vecs[o : o + len(r.texts)])
            o += len(r.texts)

    async def _query_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._queries.empty():
                self._qwake.clear()
                await self._qwake.wait()
            await self._run_queries(loop, self.query_executor)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        concurrent = self.query_executor is not None
        while True:
            if (concurrent or self._queries.empty()) and not self._ingest:
                self._wake.clear()
                await self._wake.wait()
            if not concurrent and not self._queries.empty():
                await self._run_queries(loop, self.executor)
                continue
            try:
                await self._ingest_batch(loop)
            except Exception as exc:  # noqa: BLE001 - fail the waiting streams, keep the worker alive
                for r, _ in self._ingest:
                    if not r.future.done():
                        r.future.set_exception(exc)
                self._ingest = []

    async def _ingest_batch(self, loop) -> None:
        # drop requests whose stream went away
        self._ingest = [(r, i) for r, i in self._ingest if not r.future.done()]
        if not self._ingest:
            return
        busy = self.query_executor is None and time.perf_counter() - self._last_query < self.query_quiet_s
        size = self.batch_size * 4
        if busy:
            size = self.small_batch
            if self.slice_s and self._per_chunk_s > 0:
                size = max(1, int(self.slice_s / self._per_chunk_s))
        # pool the pending chunks of every stream and take `size` of them with similar token
        # lengths (longest first), so batches carry little padding
        pending = [(len(r.ids[ci]), ri, ci) for ri, (r, start) in enumerate(self._ingest)
                   for ci in range(start, len(r.ids)) if r.done_mask is None or not r.done_mask[ci]]
        pending.sort(key=lambda x: (-x[0], x[1], x[2]))
        picked = [(ri, ci) for _, ri, ci in pending[:size]]
        ids = [self._ingest[ri][0].ids[ci] for ri, ci in picked]
        t = time.perf_counter()
        try:
            vecs = await loop.run_in_executor(self.executor, self.encoder.encode_tokenized, ids)
        except Exception as exc:  # noqa: BLE001
            for ri in {ri for ri, _ in picked}:
                if not self._ingest[ri][0].future.done():
                    self._ingest[ri][0].future.set_exception(exc)
            return
        dt = time.perf_counter() - t
        per = dt / max(1, len(ids))
        self._per_chunk_s = per if not self._per_chunk_s else 0.8 * self._per_chunk_s + 0.2 * per
        self.metrics.stage_seconds.labels(stage="embed").observe(dt)
        self.metrics.batch_size.labels(stage="embed_ingest").observe(len(ids))
        real = sum(len(x) for x in ids)
        self.metrics.embed_tokens.labels(kind="real").inc(real)
        self.metrics.embed_tokens.labels(kind="padded").inc(getattr(self.encoder, "last_padded_tokens", real))
        for (ri, ci), v in zip(picked, vecs):
            r, _ = self._ingest[ri]
            if r.out is None:
                r.out = np.zeros((len(r.ids), vecs.shape[1]), dtype=np.float32)
                r.done_mask = np.zeros(len(r.ids), dtype=bool)
            r.out[ci] = v
            r.done_mask[ci] = True
        keep = []
        for r, start in self._ingest:
            if r.done_mask is not None and r.done_mask.all():
                if not r.future.done():
                    r.future.set_result(r.out)
            else:
                keep.append((r, start))
        self._ingest = keep
        self.metrics.queue_depth.labels(queue="embed_ingest").set(
            sum(len(r.ids) - int(r.done_mask.sum()) if r.done_mask is not None else len(r.ids) for r, _ in self._ingest))
