"""Ingest pipeline: Load -> Transform -> Embed -> Upsert as concurrent stages joined by bounded
queues (backpressure: a slow stage stalls the ones before it, nothing buffers without bound).

* Load: reads the client stream, validates each document (rejections carry a reason).
* Transform: chunking on natural boundaries (paragraph, sentence, word) measured in the
  embedder's tokens so that every chunk fits its window (:mod:`..operators.chunking`; never
  truncation), tokenisation on CPU ahead of the model, and content hashes: a chunk whose text
  is unchanged from the stored version of its document reuses its vector, and so does a chunk
  whose text any stored chunk already has (identical text, identical vector: README), when
  that vector is this embedder's (the hash's prefix: :func:`.documents.embedded_prefix`).
* Embed: batches the remaining chunks across documents, grouped by token length; a text that
  occurs again in the stream takes the vector its first occurrence got. A document that brings
  its own vectors (``Document.vector``: one chunk, the whole text; ``Document.chunks``: its
  chunks with their vectors) is neither chunked nor embedded; its vectors are L2-normalised and
  a wrong width, NaN/infinity or an all-zero vector fails the stream (INVALID_ARGUMENT, nothing
  stored).
* Upsert: routes chunks to shards by the stable hash of their document id and stages coalesced
  bulk batches of ``upsert_batch`` chunks per shard, without waiting for each reply (at most
  ``STAGES_IN_FLIGHT`` per shard): the shards analyse their batches at the same time.

A stream is all-or-nothing: only when the client's final message (with the number of
documents it sent) has arrived and every stage has finished is the stream committed, on every
shard, with a new sequence number, and applied under the index write lock; the frontend's
corpus-global BM25 statistics move in the same step. A stream that is cancelled, fails or ends without the
final message is aborted: the shards drop what they staged and the index is exactly as before.
One cancelled once its commit has begun is committed or aborted whole (:meth:`.commit.CommitProtocol.commit`);
committed, it is counted as stored, not aborted (:mod:`.ingest_commit`). A caller cancelled after
its final message arrived, before the commit began (its last documents still being embedded), is
aborted and counted in ``oprag_writes_after_caller_left_total`` too (:func:`.ingest_commit.abort_stream`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import metadata as md
from .. import records
from ..config import ChunkingConfig, IngestConfig, LimitsConfig
from ..operators.chunking import Chunker
from ..shards.pool import ShardPool
from ..shards.protocol import Op, ReuseRequest, StageRequest
from .commit import CommittedAfterLeave
from .documents import (SUPPLIED_PREFIX, IngestError, content_hash, embedded_prefix, supplied_vectors,  # noqa: F401
                        supplied_vectors_many, validate_document)
from .ingest_commit import abort_stream, commit_stream
from .ingest_slots import StreamSlots, idle_limited

_END = object()
#: distinct chunk texts per stream whose vector the embed stage remembers for later repeats
STREAM_VECTOR_MEMORY = 16384
#: staged batches per shard sent and not yet answered (the shard analyses one while the next
#: is on its way; more only queue in the pipe)
STAGES_IN_FLIGHT = 2


@dataclass
class IngestResult:
    documents_written: int = 0
    chunks_written: int = 0
    documents_replaced: int = 0
    chunks_split: int = 0
    chunks_reused: int = 0
    rejected: list[tuple[int, str, str]] = field(default_factory=list)
    seq: int = 0
    elapsed_ms: float = 0.0


@dataclass
class _Doc:
    index: int
    doc_id: str
    title: str
    text: str
    metadata: dict[str, md.Value]
    generation: int
    supplied: list[tuple[str, np.ndarray]] | None = None  # (chunk text, unit vector): no embedding


@dataclass
class _Chunk:
    doc: _Doc
    ordinal: int
    text: str
    ids: list[int]
    content_hash: str = ""
    vector: np.ndarray | None = None


class IngestPipeline:
    def __init__(
        self,
        *,
        encoder: Any,
        pool: ShardPool,
        commit,
        chunking: ChunkingConfig,
        cfg: IngestConfig,
        limits: LimitsConfig,
        embedder: Any,
        metrics: Any,
        next_generation,
        embed_batch: int = 32,
    ) -> None:
        self.encoder = encoder
        self.pool = pool
        self.commit = commit  # async (txn, kind) -> (seq, per-shard ApplyReply): two-phase commit
        self.chunking = chunking
        # counts with the embedder's own tokenizer; chunks never exceed its window
        self.chunker = Chunker.for_encoder(encoder, chunking.size, chunking.overlap)
        self.cfg = cfg
        self.limits = limits
        self.embedder = embedder
        self.metrics = metrics
        self.next_generation = next_generation
        self.embed_batch = embed_batch
        self.hash_prefix = embedded_prefix(encoder.name)  # (the stored vectors this model made)
        self.streams = StreamSlots(cfg, metrics)  # (and cfg.idle_s: :mod:`.ingest_slots`)

    async def run(self, messages: AsyncIterator[Any], time_left: float | None = None) -> IngestResult:
        """Consume an ingest stream (messages with ``documents``, ``final``, ``sent_documents``) in one of
        the ``max_concurrent_streams`` slots; ``time_left``: seconds to the caller's deadline (None: none).
        :raises IngestError: the final message's count differs from what arrived. :raises IngestBusy |
        IngestIdle: no slot came free in time / the client sent nothing for ``idle_s``."""
        async with self.streams.held(time_left):
            return await self._run(messages)

    async def _run(self, messages: AsyncIterator[Any]) -> IngestResult:
        txn = uuid.uuid4().hex
        phase = {"final": False, "commit": False}  # the final message arrived; the commit began
        try:
            res = await self._pipeline(messages, txn, phase)
        except CommittedAfterLeave:  # the client left after the commit point: stored and counted
            raise  # as such (:func:`.ingest_commit.commit_stream`), not aborted
        except BaseException as exc:  # (a cancelled commit counted itself: CommitProtocol.commit)
            left = isinstance(exc, asyncio.CancelledError) and phase["final"] and not phase["commit"]
            await asyncio.shield(abort_stream(self.pool, txn, self.metrics, left, None if phase["commit"] else exc))
            raise
        return res

    async def _pipeline(self, messages: AsyncIterator[Any], txn: str, phase: dict[str, bool] | None = None) -> IngestResult:
        t0, phase = time.perf_counter(), {"final": False, "commit": False} if phase is None else phase
        res = IngestResult()
        # bounded queues give backpressure; the barrier baseline runs each stage to completion
        # before the next starts, so its queues must hold everything
        depth = 0 if self.cfg.barriers else self.cfg.queue_depth
        q_docs: asyncio.Queue = asyncio.Queue(depth * 4)
        q_chunks: asyncio.Queue = asyncio.Queue(depth)
        q_vecs: asyncio.Queue = asyncio.Queue(depth)
        busy = {"load": 0.0, "transform": 0.0, "embed": 0.0, "upsert": 0.0}
        loop = asyncio.get_running_loop()
        # set when the stream fails or is cancelled (deadline, client gone): a chunking thread then
        # stops at its next window (Chunker.spans) instead of finishing a large document unseen
        stop = threading.Event()

        async def load() -> None:
            n = 0
            size = 0
            try:
                async for msg in idle_limited(messages, self.cfg.idle_s):
                    if phase["final"]:
                        raise IngestError("a message arrived after the final message; nothing was stored")
                    phase["final"] = msg.final  # (from here a caller that leaves cannot know the outcome)
                    size += msg.ByteSize()
                    if n + len(msg.documents) > self.limits.max_stream_documents or size > self.limits.max_stream_bytes:
                        raise IngestError(
                            f"the stream exceeds {self.limits.max_stream_documents} documents or "
                            f"{self.limits.max_stream_bytes} bytes: split it into several streams; nothing was stored"
                        )
                    reasons = [validate_document(doc, self.limits) for doc in msg.documents]
                    vecs = iter(supplied_vectors_many(  # (one matrix for the message's packed vectors)
                        [(n + i, d) for i, (d, r) in enumerate(zip(msg.documents, reasons)) if not r], self.encoder.dim))
                    for doc, reason in zip(msg.documents, reasons):
                        if reason:
                            res.rejected.append((n, doc.id, reason))
                            self.metrics.documents_rejected.inc()
                        else:
                            await q_docs.put(_Doc(n, doc.id, doc.title, doc.text, md.of_document(doc),
                                                  self.next_generation(), next(vecs)))
                        n += 1
                    if msg.final and msg.sent_documents != n:
                        raise IngestError(
                            f"final message says {msg.sent_documents} documents were sent, but {n} arrived; "
                            "nothing was stored"
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
                if all(d.supplied for d in docs):  # hashes only (~2 us a chunk): no thread hop
                    chunks = self._transform(docs, res)
                else:
                    chunks = await loop.run_in_executor(None, self._transform, docs, res, stop.is_set)
                await self._reuse_vectors(chunks, res)
                busy["transform"] += time.perf_counter() - t
                if chunks:
                    await q_chunks.put(chunks)
            await q_chunks.put(_END)

        seen: dict[str, np.ndarray] = {}  # content hash -> vector, this stream (bounded, oldest out)

        async def embed() -> None:
            pending: list[_Chunk] = []
            done = False
            while not done:
                item = await q_chunks.get()
                if item is _END:
                    done = True
                else:
                    pending.extend(item)
                for c in pending:
                    if c.vector is None and c.content_hash in seen:
                        c.vector = seen[c.content_hash]
                ready = [c for c in pending if c.vector is not None]
                if ready:  # unchanged chunks carry their stored vector: no embedding
                    pending = [c for c in pending if c.vector is None]
                    await q_vecs.put((ready, np.stack([c.vector for c in ready])))
                # hand the embed worker windows of up to 32 batches (1,024 chunks): it sorts them by length;
                # simulated on 2,000 corpus documents, padding waste is 4.9% with 512-chunk windows and
                # 2.6% with 1,024
                while len(pending) >= self.embed_batch * 32 or (done and pending):
                    take, pending = pending[: self.embed_batch * 32], pending[self.embed_batch * 32 :]
                    first: dict[str, int] = {}  # one forward pass per distinct text
                    reps: list[_Chunk] = []
                    for c in take:
                        if c.content_hash not in first:
                            first[c.content_hash] = len(reps)
                            reps.append(c)
                    t = time.perf_counter()
                    vecs = await self.embedder.embed_chunks([c.ids for c in reps])
                    busy["embed"] += time.perf_counter() - t
                    for h, i in first.items():
                        seen[h] = vecs[i]
                    while len(seen) > STREAM_VECTOR_MEMORY:
                        del seen[next(iter(seen))]
                    await q_vecs.put((take, vecs[[first[c.content_hash] for c in take]]))
            await q_vecs.put(_END)

        async def upsert() -> None:
            # staged batches are sent without waiting for the reply (at most STAGES_IN_FLIGHT per
            # shard unanswered): the shards analyse them in parallel, with each other and with
            # the stages above; every reply is awaited before the commit
            buffers: dict[int, list[tuple[_Chunk, np.ndarray]]] = {}
            flying: dict[int, list[asyncio.Future]] = {}

            async def send(shard: int, part: list[tuple[_Chunk, np.ndarray]]) -> None:
                held = flying.setdefault(shard, [])
                while len(held) >= STAGES_IN_FLIGHT:
                    await held.pop(0)
                held.append(self._stage(shard, part, txn, busy))

            try:
                while True:
                    item = await q_vecs.get()
                    if item is _END:
                        break
                    take, vecs = item
                    for shard, idx in self.pool.group(take, lambda c: self.pool.owner(c.doc.doc_id)).items():
                        buffers.setdefault(shard, []).extend((take[i], vecs[i]) for i in idx)
                    for shard in list(buffers):
                        while len(buffers[shard]) >= self.cfg.upsert_batch:
                            part, buffers[shard] = buffers[shard][: self.cfg.upsert_batch], buffers[shard][self.cfg.upsert_batch :]
                            await send(shard, part)
                for shard, part in sorted(buffers.items()):
                    if part:
                        await send(shard, part)
                await asyncio.gather(*[f for held in flying.values() for f in held])
            finally:  # (a failed stream: collect what is still in flight; the abort drops it)
                await asyncio.gather(*[f for held in flying.values() for f in held], return_exceptions=True)

        stages = (load, transform, embed, upsert)
        tasks = []
        try:
            if self.cfg.barriers:
                for stage in stages:
                    await stage()
            else:
                tasks = [asyncio.create_task(c()) for c in stages]
            await asyncio.gather(*tasks)
        except BaseException:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if not phase["final"]:
            raise IngestError(
                "the stream ended without its final message (final=true with sent_documents); nothing was stored"
            )
        t = time.perf_counter()
        phase["commit"] = True
        await commit_stream(self.commit, txn, res, self.metrics)
        busy["upsert"] += time.perf_counter() - t
        res.elapsed_ms = (time.perf_counter() - t0) * 1000
        # embed (per forward pass, in the embed worker) and upsert (per staged batch) are observed
        # where they happen; transform is observed once per stream here
        self.metrics.stage_seconds.labels(stage="transform").observe(busy["transform"])
        return res

    def _transform(self, docs: list[_Doc], res: IngestResult,
                   should_stop: Callable[[], bool] | None = None) -> list[_Chunk]:
        """Chunk and tokenise (runs in a CPU thread; ``should_stop`` as :meth:`Chunker.spans`:
        a large document's chunking stops between windows, raising ``ChunkingStopped``).

        The chunker already keeps every chunk within the embedder's window; a chunk that still
        tokenises longer (not expected: the chunker counts with the same tokenizer) is split at
        token boundaries and counted in ``chunks_split``, never truncated.
        """
        out: list[_Chunk] = [_Chunk(d, o, text, [], content_hash(text, SUPPLIED_PREFIX), v)
                             for d in docs if d.supplied for o, (text, v) in enumerate(d.supplied)]
        pieces = [(d, p) for d in docs if not d.supplied for p in self.chunker.chunks(d.text, should_stop)]
        if not pieces:
            return out
        ids = self.encoder.tokenize([p for _, p in pieces])
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
                out.append(_Chunk(d, o, text, t, content_hash(text, self.hash_prefix)))
        return out

    async def _reuse_vectors(self, chunks: list[_Chunk], res: IngestResult) -> None:
        """Give chunks whose text is unchanged from the stored document their stored vector
        (counted in ``chunks_reused``), and chunks whose text another stored chunk has that
        chunk's vector (the lowest shard's; not counted): identical text, identical vector. Only
        vectors this embedder made match (the hashes carry its prefix; supplied ones another)."""
        chunks = [c for c in chunks if c.vector is None]  # brought their own vectors
        if not chunks:
            return
        doc_ids = sorted({c.doc.doc_id for c in chunks})
        hashes = sorted({c.content_hash for c in chunks})
        by = self.pool.group(doc_ids, self.pool.owner)
        replies = await asyncio.gather(*[
            self.pool.call(s, Op.REUSE, ReuseRequest([doc_ids[i] for i in by.get(s, [])], hashes))
            for s in range(len(self.pool.clients))])
        stored: dict[str, dict[str, np.ndarray]] = {}
        same_text: dict[str, np.ndarray] = {}
        for r in replies:
            stored.update(r.vectors)
            for h, v in r.by_hash.items():
                same_text.setdefault(h, v)
        for c in chunks:
            v = stored.get(c.doc.doc_id, {}).get(c.content_hash)
            if v is not None:
                c.vector = v
                res.chunks_reused += 1
                self.metrics.chunks_reused.inc()
            elif c.content_hash in same_text:
                c.vector = same_text[c.content_hash]

    def _stage(self, shard: int, part: list[tuple[_Chunk, np.ndarray]], txn: str, busy: dict) -> asyncio.Future:
        """Send one staged batch to ``shard`` (returned at once: the future of its reply; the
        time to the reply is added to ``busy["upsert"]`` and observed as the upsert stage)."""
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
            content_hashes=[c.content_hash for c in chunks],
            vectors=np.stack([v for _, v in part]),
        )
        fut = asyncio.ensure_future(self.pool.call(shard, Op.STAGE, StageRequest(txn, records.to_ipc(batch))))

        def done(_f) -> None:
            dt = time.perf_counter() - t
            busy["upsert"] += dt
            self.metrics.stage_seconds.labels(stage="upsert").observe(dt)

        fut.add_done_callback(done)
        return fut
