"""Bulk ingest through Ray embedding actors (``--ray-address local --ray-embed-actors 2``): a
real Runtime (MiniLM, shards as Ray actors, two embedding actors each loading the model) ingests
a stream through :class:`IngestPipeline`; the vectors the shards stored equal what the
in-process encoder computes for the same chunks, and the actors did the embedding.

Skipped without the 'ray' extra; about 40 s on 2 cores at load average 2.5, 50 s at 8 (Ray start, 3 actors).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the 'ray' extra: pip install -e '.[ray]'")

from oprag.v1 import oprag_pb2  # noqa: E402
from oprag_server.app import Runtime  # noqa: E402
from oprag_server.config import RayConfig, ServerConfig  # noqa: E402
from oprag_server.engine.documents import content_hash, embedded_prefix  # noqa: E402
from oprag_server.engine.ray_embed import RayEmbedPool  # noqa: E402
from oprag_server.models.encoder import TransformersEncoder  # noqa: E402
from oprag_server.shards.protocol import Op, ReuseRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(120)]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

WORDS = ("harbour tide ferry lighthouse pier dock channel buoy anchor mooring keel hull rudder mast sail "
         "crew captain pilot beacon current swell reef shoal estuary wharf quay").split()


def _docs(n: int) -> list[oprag_pb2.Document]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):  # lengths from a few words to several chunks: batches of mixed widths
        words = rng.choice(WORDS, int(rng.integers(5, 400)))
        text = ". ".join(" ".join(words[j : j + 12]) for j in range(0, len(words), 12))
        out.append(oprag_pb2.Document(id=f"doc{i}", text=text))
    return out


async def _ingest_and_compare(tmp_path) -> None:
    encoder = TransformersEncoder("minilm", device="cpu")
    encoder.warm_up()
    cfg = ServerConfig(data_dir=tmp_path, shards=1,
                       ray=RayConfig(address="local", shard_cpus=0.5, embed_actors=2, embed_cpus=0.5))
    rt = Runtime(cfg, encoder, None)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, rt.start_shards, loop)
    try:
        await rt.start()
        assert isinstance(rt.embed_pool, RayEmbedPool) and rt.embed_pool.n == 2
        assert rt.ingest.embedder is rt.embed_pool
        docs = _docs(24)

        async def stream():
            yield oprag_pb2.IngestRequest(documents=docs[:12])
            yield oprag_pb2.IngestRequest(documents=docs[12:], final=True, sent_documents=len(docs))

        res = await rt.ingest.run(stream())
        assert res.documents_written == len(docs) and not res.rejected
        usage = await loop.run_in_executor(None, rt.embed_pool.usage)
        assert all(u["chunks"] > 0 for u in usage), usage  # both actors embedded
        assert sum(u["chunks"] for u in usage) == res.chunks_written  # every chunk's text is distinct

        # what the shards stored vs the in-process encoder on the same chunks
        chunks = [(d.id, c) for d in docs for c in rt.ingest.chunker.chunks(d.text)]
        assert len(chunks) == res.chunks_written
        want = encoder.encode_tokenized(encoder.tokenize([c for _, c in chunks]))
        stored = {}
        for s in range(cfg.shards):
            ids = [d.id for d in docs if rt.pool.owner(d.id) == s]
            stored.update((await rt.pool.call(s, Op.REUSE, ReuseRequest(ids))).vectors)
        got = np.stack([stored[d][content_hash(c, embedded_prefix(encoder.name))] for d, c in chunks])
        assert got.dtype == np.float32 and got.shape == want.shape
        assert float(np.abs(got - want).max()) <= 1e-6
    finally:
        await rt.close()


def test_ingest_through_ray_embedding_actors_stores_the_in_process_vectors(tmp_path):
    asyncio.run(_ingest_and_compare(tmp_path))
