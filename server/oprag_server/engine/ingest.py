"""Ingest pipeline: Load -> Transform -> Embed -> Upsert as concurrent stages joined by bounded
queues (backpressure: a slow stage stalls the ones before it, nothing buffers without bound).

* Load: reads the client stream, validates each document (rejections carry a reason).
* Transform: character chunking, tokenisation on CPU ahead of the model, and a second split
  of any chunk longer than the embedder's token limit (never silent truncation).
* Embed: batches chunks across documents, grouped by token length by the encoder.
* Upsert: routes chunks to shards by the stable hash of their document id and commits
  coalesced bulk batches of ``upsert_batch`` chunks per shard under the index write lock,
  keeping the frontend's corpus-global BM25 statistics in step with the shards.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import records
from ..config import ChunkingConfig, IngestConfig, LimitsConfig
from ..index.bm25 import CorpusStats
from ..operators.chunking import chunk_text
from ..shards.pool import ShardPool, route
from .rwlock import RWLock

_END = object()


class IngestError(ValueError):
    """The stream as a whole is invalid (for example a wrong ``sent_documents`` count)."""


@dataclass
class IngestResult:
    documents_written: int = 0
    chunks_written: int = 0
    documents_replaced: int = 0
    chunks_split: int = 0
    rejected: list[tuple[int, str, str]] = field(default_factory=list)
    seq: int = 0
    elapsed_ms: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _Doc:
    index: int
    doc_id: str
    title: str
    text: str
    metadata: dict[str, str]
    generation: int


@dataclass
class _Chunk:
    doc: _Doc
    ordinal: int
    text: str
    ids: list[int]


def validate_document(doc: Any, limits: LimitsConfig) -> str | None:
    """Reason a document cannot be stored, or None. ``doc`` has id, title, text, metadata."""
    if not doc.id:
        return "id is empty: give every document a non-empty id"
    if len(doc.id.encode()) > limits.max_doc_id_bytes:
        return f"id is longer than {limits.max_doc_id_bytes} bytes: use a shorter id"
    if "\x00" in doc.id:
        return "id contains a NUL character"
    if not doc.text or not doc.text.strip():
        return "text is empty: send the document's text"
    size = len(doc.text.encode()) + len(doc.title.encode())
    if size > limits.max_document_bytes:
        return f"document is {size} bytes; the limit is {limits.max_document_bytes}: split it into several documents"
    if len(doc.metadata) > limits.max_metadata_entries:
        return f"metadata has {len(doc.metadata)} entries; the limit is {limits.max_metadata_entries}"
    msize = sum(len(k.encode()) + len(v.encode()) for k, v in doc.metadata.items())
    if msize > limits.max_metadata_bytes:
        return f"metadata is {msize} bytes; the limit is {limits.max_metadata_bytes}"
    return None


class IngestPipeline:
    def __init__(
        self,
        *,
        encoder: Any,
        pool: ShardPool,
        stats: CorpusStats,
        lock: RWLock,
        chunking: ChunkingConfig,
        cfg: IngestConfig,
        limits: LimitsConfig,
        embed_executor: ThreadPoolExecutor,
        metrics: Any,
        next_seq,
        next_generation,
        embed_batch: int = 32,
    ) -> None:
        self.encoder = encoder
        self.pool = pool
        self.stats = stats
        self.lock = lock
        self.chunking = chunking
        self.cfg = cfg
        self.limits = limits
        self.embed_executor = embed_executor
        self.metrics = metrics
        self.next_seq = next_seq
        self.next_generation = next_generation
        self.embed_batch = embed_batch
        self.streams = asyncio.Semaphore(cfg.max_concurrent_streams)

    async def run(self, messages: AsyncIterator[Any]) -> IngestResult:
        """Consume an ingest stream (messages with ``documents``, ``final``, ``sent_documents``).

        :raises IngestError: the final message's count differs from what arrived.
        """
        async with self.streams:
            return await self._run(messages)

    async def _run(self, messages: AsyncIterator[Any]) -> IngestResult:
        t0 = time.perf_counter()
        res = IngestResult(seq=self.next_seq())
        depth = self.cfg.queue_depth
        q_docs: asyncio.Queue = asyncio.Queue(depth * 4)
        q_chunks: asyncio.Queue = asyncio.Queue(depth)
        q_vecs: asyncio.Queue = asyncio.Queue(depth)
        busy = {"load": 0.0, "transform": 0.0, "embed": 0.0, "upsert": 0.0}
        loop = asyncio.get_running_loop()

        async def load() -> None:
            n = 0
            try:
                async for msg in messages:
                    for doc in msg.documents:
                        reason = validate_document(doc, self.limits)
                        if reason:
                            res.rejected.append((n, doc.id, reason))
                            self.metrics.documents_rejected.inc()
                        else:
                            await q_docs.put(
                                _Doc(n, doc.id, doc.title, doc.text, dict(doc.metadata), self.next_generation())
                            )
                        n += 1
                    if msg.final and msg.sent_documents != n:
                        raise IngestError(
                            f"final message says {msg.sent_documents} documents were sent, but {n} arrived"
                        )
            finally:
                await q_docs.put(_END)

        async def transform() -> None:
            done = False
            while not done:
                docs = [await q_docs.get()]
                while not q_docs.empty() and len(docs) < 32:
                    docs.append(q_docs.get_nowait())
                if docs[-1] is _END:
                    docs.pop()
                    done = True
                if not docs:
                    continue
                t = time.perf_counter()
                chunks = await loop.run_in_executor(None, self._transform, docs, res)
                busy["transform"] += time.perf_counter() - t
                if chunks:
                    await q_chunks.put(chunks)
            await q_chunks.put(_END)

        async def embed() -> None:
            pending: list[_Chunk] = []
            done = False
            while not done:
                item = await q_chunks.get()
                if item is _END:
                    done = True
                else:
                    pending.extend(item)
                while len(pending) >= self.embed_batch or (done and pending):
                    take, pending = pending[: self.embed_batch * 4], pending[self.embed_batch * 4 :]
                    t = time.perf_counter()
                    vecs = await loop.run_in_executor(
                        self.embed_executor, self.encoder.encode_tokenized, [c.ids for c in take]
                    )
                    busy["embed"] += time.perf_counter() - t
                    await q_vecs.put((take, vecs))
            await q_vecs.put(_END)

        async def upsert() -> None:
            buffers: dict[int, list[tuple[_Chunk, np.ndarray]]] = {}
            while True:
                item = await q_vecs.get()
                if item is _END:
                    break
                take, vecs = item
                for c, v in zip(take, vecs):
                    buffers.setdefault(route(c.doc.doc_id, self.pool.n), []).append((c, v))
                for shard in list(buffers):
                    while len(buffers[shard]) >= self.cfg.upsert_batch:
                        part, buffers[shard] = buffers[shard][: self.cfg.upsert_batch], buffers[shard][self.cfg.upsert_batch :]
                        busy["upsert"] += await self._commit(shard, part, res)
            for shard, part in sorted(buffers.items()):
                if part:
                    busy["upsert"] += await self._commit(shard, part, res)

        tasks = [asyncio.create_task(c()) for c in (load, transform, embed, upsert)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        res.elapsed_ms = (time.perf_counter() - t0) * 1000
        res.stage_seconds = busy
        for stage in ("transform", "embed", "upsert"):
            self.metrics.stage_seconds.labels(stage=stage).observe(busy[stage])
        return res

    def _transform(self, docs: list[_Doc], res: IngestResult) -> list[_Chunk]:
        """Chunk, tokenise and split over-long chunks (runs in a CPU thread)."""
        pieces: list[tuple[_Doc, str]] = []
        for d in docs:
            for p in chunk_text(d.text, self.chunking.size, self.chunking.overlap):
                if p.strip():
                    pieces.append((d, p))
        if not pieces:
            return []
        ids = self.encoder.tokenize([p for _, p in pieces])
        out: list[_Chunk] = []
        ordinals: dict[int, int] = {}
        for (d, p), tok in zip(pieces, ids):
            parts = [(p, tok)]
            if len(tok) > self.encoder.max_tokens:
                sub = [s for s in self.encoder.split_to_fit(p) if s.strip()]
                parts = list(zip(sub, self.encoder.tokenize(sub)))
                res.chunks_split += len(sub)
                self.metrics.chunks_split.inc(len(sub))
            for text, t in parts:
                o = ordinals.get(d.index, 0)
                ordinals[d.index] = o + 1
                out.append(_Chunk(d, o, text, t))
        return out

    async def _commit(self, shard: int, part: list[tuple[_Chunk, np.ndarray]], res: IngestResult) -> float:
        t = time.perf_counter()
        chunks = [c for c, _ in part]
        batch = records.make_chunk_batch(
            chunk_ids=[f"{c.doc.doc_id}#{c.ordinal}" for c in chunks],
            doc_ids=[c.doc.doc_id for c in chunks],
            titles=[c.doc.title for c in chunks],
            texts=[c.text for c in chunks],
            metadata=[c.doc.metadata for c in chunks],
            ordinals=[c.ordinal for c in chunks],
            generations=[c.doc.generation for c in chunks],
            content_hashes=[hashlib.sha256(c.text.encode()).hexdigest() for c in chunks],
            vectors=np.stack([v for _, v in part]),
        )
        ipc = records.to_ipc(batch)
        async with self.lock.write():
            out = await self.pool.call(shard, "upsert", {"ipc": ipc, "seq": res.seq})
            self.stats.apply_delta(*out["delta"])
        new_docs = {c.doc.index for c in chunks if c.ordinal == 0}
        res.documents_written += len(new_docs)
        res.documents_replaced += out["replaced_docs"]
        res.chunks_written += out["added"]
        self.metrics.documents_ingested.inc(len(new_docs))
        self.metrics.chunks_ingested.inc(out["added"])
        dt = time.perf_counter() - t
        self.metrics.stage_seconds.labels(stage="upsert").observe(dt)
        return dt
