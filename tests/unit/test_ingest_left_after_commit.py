"""An ingest stream whose client left after the commit point is stored whole (trial16) and is
counted as stored: in ``oprag_documents_ingested_total`` and ``oprag_chunks_ingested_total``,
not in ``oprag_ingest_streams_aborted_total`` (before this it was counted aborted, and its
documents and chunks nowhere), and it marks the shards dirty for the snapshot loop (before, the
next snapshot waited for another write). A stream cancelled before the commit point stays an aborted one."""

from __future__ import annotations

import asyncio

import pytest

from oprag_client.client import Doc, ingest_messages
from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig
from oprag_server.engine.ingest import IngestPipeline
from oprag_server.models.fakes import HashingEncoder
from oprag_server.shards.protocol import Op
from oprag_server.service.metrics import Metrics

from test_commit import DIM, _protocol
from test_commit_cancel import _docs


def _count(m: Metrics, name: str) -> float:
    return m.registry.get_sample_value(name) or 0.0


async def _cancel_at(op: Op):
    """Run an ingest stream of 3 documents (own vectors) and cancel it while ``op`` is held on
    shard 0. :returns: (metrics, documents on the shards, the commit protocol)."""
    cp = _protocol()
    m = Metrics()
    p = IngestPipeline(encoder=HashingEncoder(dim=DIM), pool=cp.pool, commit=cp.commit, chunking=ChunkingConfig(),
                       cfg=IngestConfig(), limits=LimitsConfig(), embedder=None, metrics=m, next_generation=lambda: 1)
    docs = [Doc(d, f"text of {d}", vector=[1.0 + i] + [0.5] * (DIM - 1)) for i, d in enumerate("abc")]

    async def messages():
        for msg in ingest_messages(docs):
            yield msg

    reached, gate = asyncio.Event(), asyncio.Event()
    client = cp.pool.clients[0]
    real_call = client.call

    async def held(o, req):
        if o is op:
            reached.set()
            await gate.wait()
        return await real_call(o, req)

    client.call = held
    cp.on_apply = lambda: applied.append(cp.seq)  # (Runtime: mark_dirty, for the snapshot loop)
    applied: list[int] = []
    task = asyncio.create_task(p.run(messages()))
    await asyncio.wait_for(reached.wait(), 30)
    task.cancel()  # the client left (its deadline passed) while the shards prepare / apply
    await asyncio.sleep(0.02)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert applied == ([1] if op is Op.APPLY else [])
    return m, _docs(cp), cp


def test_a_stream_whose_client_left_after_the_commit_point_counts_as_stored():
    m, stored, cp = asyncio.run(_cancel_at(Op.APPLY))
    assert stored == {"a", "b", "c"} and cp.applied_seq == 1  # stored whole (trial16)
    assert _count(m, "oprag_documents_ingested_total") == 3
    assert _count(m, "oprag_chunks_ingested_total") == 3
    assert _count(m, "oprag_ingest_streams_aborted_total") == 0


def test_a_stream_whose_client_left_before_the_commit_point_counts_as_aborted():
    m, stored, _ = asyncio.run(_cancel_at(Op.PREPARE))
    assert stored == set()
    assert _count(m, "oprag_documents_ingested_total") == 0 and _count(m, "oprag_chunks_ingested_total") == 0
    assert _count(m, "oprag_ingest_streams_aborted_total") == 1
