"""The ingest Transform stage with the real MiniLM tokenizer: chunks end on natural boundaries
and fit the embedder's window as they come out of the chunker (nothing split again, nothing
truncated); document validation rejects empty and invisible-only texts."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig
from oprag_server.engine.ingest import IngestPipeline, IngestResult, _Doc, validate_document
from oprag_server.models.encoder import TransformersEncoder
from oprag_server.service.metrics import Metrics


@pytest.fixture(scope="module")
def encoder():
    e = TransformersEncoder("minilm")
    e.warm_up()
    return e


def _pipeline(encoder, size=256, overlap=0):
    return IngestPipeline(
        encoder=encoder, pool=None, commit=None, chunking=ChunkingConfig(size=size, overlap=overlap),
        cfg=IngestConfig(), limits=LimitsConfig(), embedder=None, metrics=Metrics(), next_generation=lambda: 1,
    )


def test_over_long_text_is_chunked_to_fit(encoder):
    text = " ".join(str(i % 10) for i in range(1200))  # 2,399 chars; every digit is a token
    p = _pipeline(encoder)
    res = IngestResult()
    chunks = p._transform([_Doc(0, "digits", "", text, {}, 1)], res)
    assert res.chunks_split == 0  # the chunker already fits the window: no second split
    assert all(len(c.ids) <= encoder.max_tokens for c in chunks)
    assert max(len(c.ids) for c in chunks) == encoder.max_tokens  # filled up to the window
    assert " ".join(c.text for c in chunks) == text  # nothing dropped, nothing duplicated
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert all(c.ids == encoder.tokenize([c.text])[0] for c in chunks)


def test_issue_case_photosynthesis_kept_whole(encoder):
    text = "a " * 448 + "photosynthesis"
    res = IngestResult()
    chunks = _pipeline(encoder)._transform([_Doc(0, "p", "", text, {}, 1)], res)
    assert res.chunks_split == 0
    assert chunks[-1].text.endswith(" photosynthesis")
    assert sum(c.text.split().count("photosynthesis") for c in chunks) == 1
    assert all(len(c.ids) <= encoder.max_tokens for c in chunks)


def test_chunk_size_and_overlap_in_tokens(encoder):
    paras = [f"Paragraph {i} tells of the quince harvest of year {1900 + i}. " * 6 for i in range(5)]
    text = "\n\n".join(p.strip() for p in paras)
    res = IngestResult()
    chunks = _pipeline(encoder, size=100)._transform([_Doc(0, "q", "", text, {}, 1)], res)
    assert all(len(c.ids) <= 100 for c in chunks)
    assert re.sub(r"\s+", "", "".join(c.text for c in chunks)) == re.sub(r"\s+", "", text)
    over = _pipeline(encoder, size=100, overlap=30)._transform([_Doc(0, "q", "", text, {}, 1)], IngestResult())
    assert len(over) >= len(chunks) and all(len(c.ids) <= 100 for c in over)


def test_safety_net_splits_what_still_does_not_fit(encoder):
    """Should the chunker ever return a piece over the window, it is split, counted, not truncated."""
    p = _pipeline(encoder)
    long = " ".join(str(i % 10) for i in range(600))
    p.chunker = SimpleNamespace(chunks=lambda text, should_stop=None: [text])  # a chunker that does not cut
    res = IngestResult()
    chunks = p._transform([_Doc(0, "digits", "", long, {}, 1)], res)
    assert res.chunks_split == len(chunks) > 1 and p.metrics.chunks_split._value.get() == res.chunks_split
    assert "".join(c.text for c in chunks) == long
    assert all(len(c.ids) <= encoder.max_tokens for c in chunks)


def _doc(text, id="d", title=""):
    return SimpleNamespace(id=id, title=title, text=text, metadata={})


@pytest.mark.parametrize("text", ["", "   \n", "\u200b", "\u200b\u2060", "\u00ad\ufeff\u200b", "\ufe0f \U000e0041\n"])
def test_empty_and_invisible_documents_rejected(text):
    """Issue 15 item 6: text made only of whitespace / Default_Ignorable code points is empty."""
    reason = validate_document(_doc(text), LimitsConfig())
    assert reason is not None and "text is empty" in reason


@pytest.mark.parametrize("text", ["a", "...", "\u200bWiki\u200bpedia", "\u0600"])
def test_visible_documents_accepted(text):
    assert validate_document(_doc(text), LimitsConfig()) is None


def test_title_over_its_limit_is_rejected_with_what_to_change():
    """A title travels with every chunk of its document (stored and in every hit): it has its own
    limit, counted in UTF-8 bytes, so a 4-byte character counts 4."""
    lim = LimitsConfig()
    assert validate_document(_doc("body", title="t" * lim.max_title_bytes), lim) is None
    assert validate_document(_doc("body", title="\U0001f993" * (lim.max_title_bytes // 4)), lim) is None
    for title in ("t" * (lim.max_title_bytes + 1), "\U0001f993" * (lim.max_title_bytes // 4 + 1)):
        reason = validate_document(_doc("body", title=title), lim)
        assert reason is not None and f"the limit is {lim.max_title_bytes}" in reason and "shorten the title" in reason


def test_a_cancelled_stream_stops_chunking_its_large_document_between_windows(encoder):
    """A stream cancelled (client gone, deadline passed) while a large document is being chunked:
    the chunking thread stops at its next window instead of running to the end unseen (the base
    chunked 400 K characters of CJK without punctuation for minutes after the cancel)."""
    import asyncio
    import random
    import threading

    from oprag_client.client import Doc, ingest_messages

    rng = random.Random(5)
    text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(400_000))
    p = _pipeline(encoder)
    real, windows, done = p.chunker.spans, [], threading.Event()

    def spy(t, should_stop=None):
        def counted() -> bool:
            windows.append(1)
            return bool(should_stop and should_stop())
        try:
            return real(t, counted)
        finally:
            done.set()

    p.chunker.spans = spy

    async def go() -> bool:
        async def messages():
            for msg in ingest_messages([Doc("big", text)]):
                yield msg
            await asyncio.sleep(3600)  # the client neither ends nor leaves: it is cancelled below

        task = asyncio.create_task(p._pipeline(messages(), "t"))
        for _ in range(3000):
            if len(windows) >= 2 or done.is_set():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        stopped = await asyncio.to_thread(done.wait, 10)
        with pytest.raises(asyncio.CancelledError):
            await task
        return stopped

    assert asyncio.run(go())  # stopped within 10 s (a window takes ~0.4 s; the whole text ~9 s)
    assert len(windows) < 20
