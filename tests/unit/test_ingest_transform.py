"""The ingest Transform stage with the real MiniLM tokenizer: over-long chunks are split again
at token boundaries, never truncated, and each piece fits the embedder."""

from __future__ import annotations

import pytest

from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig
from oprag_server.engine.ingest import IngestPipeline, IngestResult, _Doc
from oprag_server.models.encoder import TransformersEncoder
from oprag_server.service.metrics import Metrics


@pytest.fixture(scope="module")
def encoder():
    e = TransformersEncoder("minilm")
    e.warm_up()
    return e


def _pipeline(encoder, size=900):
    return IngestPipeline(
        encoder=encoder, pool=None, commit=None, chunking=ChunkingConfig(size=size), cfg=IngestConfig(),
        limits=LimitsConfig(), embedder=None, metrics=Metrics(), next_generation=lambda: 1,
    )


def test_over_long_chunk_is_split_to_fit(encoder):
    text = " ".join(str(i % 10) for i in range(1200))  # 2,399 chars; every digit is a token
    p = _pipeline(encoder)
    res = IngestResult()
    chunks = p._transform([_Doc(0, "digits", "", text, {}, 1)], res)
    assert res.chunks_split > 0
    assert all(len(c.ids) <= encoder.max_tokens for c in chunks)
    assert "".join(c.text for c in chunks) == text  # nothing dropped, nothing duplicated
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert p.metrics.chunks_split._value.get() == res.chunks_split


def test_ordinary_chunks_are_not_split(encoder):
    text = "Plain English prose about gardens and rivers. " * 40
    res = IngestResult()
    chunks = _pipeline(encoder)._transform([_Doc(0, "prose", "", text, {}, 1)], res)
    assert res.chunks_split == 0
    assert [len(c.text) for c in chunks] == [900, 900, len(text) - 1800]
