"""Content-hash reuse takes only vectors the server's own embedder made (trial24 finding #1):
a vector a client supplied for a text, a vector stored before chunks recorded where their vector
came from (a bare sha256 content hash), and one another embedder made, are never given to a chunk
the server must embed. Real pipeline, commit protocol and in-process shards; a hashing encoder."""

from __future__ import annotations

import asyncio
import hashlib
import itertools

import numpy as np
from oprag_client.client import Doc, ingest_messages
from oprag_server import records
from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig
from oprag_server.engine.ingest import IngestPipeline
from oprag_server.models.fakes import HashingEncoder
from oprag_server.service.metrics import Metrics
from oprag_server.shards.protocol import Op, ReuseRequest, StageRequest

from test_commit import DIM, _protocol

_GENERATIONS = itertools.count(2)  # (one sequence for every pipeline: 1 is the staged old chunk's)
TEXT = "the quokka crossing at midnight under a violet moon"


class _Embedder:
    """``embed_chunks`` of an encoder, in the event loop (what the pipeline calls)."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder

    async def embed_chunks(self, ids: list[list[int]]) -> np.ndarray:
        return self.encoder.encode_tokenized(ids)


class _OtherEncoder(HashingEncoder):
    """Another model of the same width: the hashing encoder's vectors, negated."""

    name = "other"

    def encode_tokenized(self, ids):
        return -super().encode_tokenized(ids)


def _pipeline(cp, encoder) -> IngestPipeline:
    return IngestPipeline(encoder=encoder, pool=cp.pool, commit=cp.commit, chunking=ChunkingConfig(), cfg=IngestConfig(),
                          limits=LimitsConfig(), embedder=_Embedder(encoder), metrics=Metrics(),
                          next_generation=lambda: next(_GENERATIONS))


async def _ingest(p: IngestPipeline, docs: list[Doc]):
    async def messages():
        for m in ingest_messages(docs):
            yield m

    return await p.run(messages())


async def _stored(cp, doc_id: str) -> np.ndarray:
    """The stored vector of one-chunk document ``doc_id``."""
    r = await cp.pool.call(cp.pool.owner(doc_id), Op.REUSE, ReuseRequest([doc_id]))
    (v,) = r.vectors[doc_id].values()
    return v


def test_a_supplied_vector_is_never_a_reuse_source():
    async def go():
        cp, enc = _protocol(), HashingEncoder(dim=DIM)
        p, want = _pipeline(cp, enc), enc.encode([TEXT])[0]
        own = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
        await _ingest(p, [Doc("own", TEXT, vector=own)])
        for d in ("a", "b", "c", "d"):  # (both shards own some of them)
            r = await _ingest(p, [Doc(d, TEXT)])
            assert r.chunks_reused == 0 and np.array_equal(await _stored(cp, d), want)
        assert abs(float(await _stored(cp, "own") @ own) / float(np.linalg.norm(own)) - 1) < 1e-6  # kept as given
        await _ingest(p, [Doc("own", TEXT, vector=own)])
        r = await _ingest(p, [Doc("own", TEXT)])  # re-ingested without its vector: embedded
        assert r.documents_replaced == 1 and r.chunks_reused == 0 and np.array_equal(await _stored(cp, "own"), want)
        r = await _ingest(p, [Doc("own", TEXT)])  # now the embedder's: a real reuse, counted
        assert r.chunks_reused == 1 and np.array_equal(await _stored(cp, "own"), want)

    asyncio.run(go())


def test_chunks_of_unknown_provenance_or_another_embedder_are_not_reused():
    async def go():
        cp, enc = _protocol(), HashingEncoder(dim=DIM)
        # a chunk as stored before the prefixes: bare sha256 content hash, whoever made its vector
        old = np.zeros((1, DIM), np.float32)
        old[0, 0] = 1.0
        batch = records.make_chunk_batch(chunk_ids=["old#0"], doc_ids=["old"], titles=[""], texts=[TEXT], metadata=[{}],
                                         ordinals=[0], generations=[1],
                                         content_hashes=[hashlib.sha256(TEXT.encode()).hexdigest()], vectors=old)
        await cp.pool.call(cp.pool.owner("old"), Op.STAGE, StageRequest("t0", records.to_ipc(batch)))
        await cp.commit("t0", "upsert")
        assert np.array_equal(await _stored(cp, "old"), old[0])
        p, want = _pipeline(cp, enc), enc.encode([TEXT])[0]
        for d in ("new", "old"):  # another document, and the old one re-ingested: embedded
            r = await _ingest(p, [Doc(d, TEXT)])
            assert r.chunks_reused == 0 and np.array_equal(await _stored(cp, d), want)
        # another embedder (same width) on the same shards embeds the text itself
        other = _OtherEncoder(dim=DIM)
        r = await _ingest(_pipeline(cp, other), [Doc("new", TEXT), Doc("x", TEXT)])
        assert r.chunks_reused == 0
        for d in ("new", "x"):
            assert np.array_equal(await _stored(cp, d), -want)

    asyncio.run(go())
