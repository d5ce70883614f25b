"""One Ingest RPC marks the shards dirty once: the commit protocol's ``on_apply`` after its
transaction is applied (Runtime: ``mark_dirty``, which flags the snapshot loop and refreshes the
index gauges). Before small18 the servicer called ``mark_dirty`` again after every stream: a
second STATS broadcast per stream."""

from __future__ import annotations

import asyncio
import types

import pytest
from oprag_client.client import Doc, ingest_messages
from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig, ServerConfig
from oprag_server.engine.ingest import IngestPipeline
from oprag_server.models.fakes import HashingEncoder
from oprag_server.service.metrics import Metrics
from oprag_server.service.servicer import OpRAGServicer

from test_commit import DIM, _protocol


def _ingest(docs: list[Doc]) -> tuple[list[int], object]:
    """Send ``docs`` through the servicer's Ingest over a real pipeline and commit protocol
    (in-process shards). :returns: the sequence numbers ``mark_dirty`` was called at, the response."""
    cp = _protocol()
    marks: list[int] = []
    cp.on_apply = lambda: marks.append(cp.seq)  # (Runtime: on_apply=mark_dirty)
    pipeline = IngestPipeline(encoder=HashingEncoder(dim=DIM), pool=cp.pool, commit=cp.commit, chunking=ChunkingConfig(),
                              cfg=IngestConfig(), limits=LimitsConfig(), embedder=None, metrics=Metrics(),
                              next_generation=lambda: 1)
    rt = types.SimpleNamespace(cfg=ServerConfig(), ingest=pipeline, mark_dirty=lambda: marks.append(-1))
    servicer = OpRAGServicer(rt)

    async def messages():
        for msg in ingest_messages(docs):
            yield msg

    return marks, asyncio.run(servicer.Ingest(messages(), None))


@pytest.mark.parametrize("docs, written", [
    ([Doc(d, f"text of {d}", vector=[1.0 + i] + [0.5] * (DIM - 1)) for i, d in enumerate("abc")], 3),
    ([Doc("empty", " ")], 0),  # rejected (empty text): the stream still commits, an empty transaction
])
def test_an_ingest_marks_dirty_once(docs, written):
    marks, r = _ingest(docs)
    assert r.documents_written == written and marks == [r.seq] == [1]
