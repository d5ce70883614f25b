"""A query whose prompt gets no sources is not generated (trial16: on an empty store, after every
document was deleted or with a filter matching nothing, the generator still answered, from its
own weights: "completed in 1999" with zero sources). Deterministic fakes, no models or shards;
a real server is in tests/integration/test_no_sources.py."""

from __future__ import annotations

import asyncio

import pytest

from oprag_server.cli import build_parser, config_from_args
from oprag_server.config import GenerateConfig
from oprag_server.engine.grounding import NO_SOURCES, without_sources
from oprag_server.service import convert, openai_api
from oprag_server.service.stream import job_events
from test_scheduler import FakeEngineGenerator, FakeGenerator, FakeMemory, FakeRetriever, _engine, _job


class SomeEmpty(FakeRetriever):
    """No hits for a question that starts with "none" (an empty store, a filter matching nothing)."""

    async def retrieve(self, vecs, texts, specs):
        await asyncio.sleep(0.01)  # (so that concurrent requests batch)
        hits, times, infos = await super().retrieve(vecs, texts, specs)
        return [[] if t.startswith("none") else h for t, h in zip(texts, hits)], times, infos


def _count(metrics, name, **labels) -> float:
    v = metrics.registry.get_sample_value(name, labels or None)
    return v or 0.0


NAMES = ["q0", "none1", "q2", "none3", "q4", "none5"]


def _mixed(gen, *, overlap=True, policy="refuse", memory=None, session_id=""):
    async def run():
        eng = _engine(gen, SomeEmpty(), overlap=overlap, max_batch=8, memory=memory)
        eng.gen_cfg = GenerateConfig(answer_without_sources=policy)
        eng.start()
        jobs = await asyncio.gather(*[eng.submit(_job(n, session_id=session_id)) for n in NAMES])
        await eng.stop()
        return jobs, eng.metrics

    return asyncio.run(run())


@pytest.mark.parametrize("engine", [False, True], ids=["builtin", "engine"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_mixed_batch_generates_only_the_requests_with_sources(engine, overlap):
    gen = FakeEngineGenerator(0.01) if engine else FakeGenerator(0.01)
    jobs, m = _mixed(gen, overlap=overlap)
    for n, j in zip(NAMES, jobs):
        if n.startswith("none"):
            assert (j.answer, j.completion_tokens, j.finish_reason, j.payload) == ("", 0, NO_SOURCES, None), n
            assert "context" in j.timings_ms and "generate" not in j.timings_ms and not j.ttft_ms
            r = convert.query_response(j, include_trace=False, has_generator=True)
            assert (r.answer, list(r.sources), r.prompt_tokens, r.completion_tokens, r.finish_reason) == \
                ("", [], 0, 0, "no_sources")
        else:
            assert (j.answer, j.finish_reason) == (n, "stop") and j.payload.sources and "generate" in j.timings_ms
    generated = len(gen.streams) if engine else sum(n for _, n in gen.batches)
    assert generated == 3  # the generator never saw the three requests without sources
    if not engine:
        assert max(n for _, n in gen.batches) > 1  # (they were batched with the others)
    assert _count(m, "oprag_stage_seconds_count", stage="generate") == 3
    assert _count(m, "oprag_stage_seconds_count", stage="context") == 6
    assert _count(m, "oprag_answers_without_sources_total", action="refused") == 3
    assert _count(m, "oprag_answers_without_sources_total", action="generated") == 0


@pytest.mark.parametrize("engine", [False, True], ids=["builtin", "engine"])
def test_answer_without_sources_generate_keeps_the_former_behaviour(engine):
    gen = FakeEngineGenerator(0.01) if engine else FakeGenerator(0.01)
    jobs, m = _mixed(gen, policy="generate")
    assert [(j.answer, j.finish_reason) for j in jobs] == [(n, "stop") for n in NAMES]
    assert (len(gen.streams) if engine else sum(n for _, n in gen.batches)) == 6
    assert _count(m, "oprag_stage_seconds_count", stage="generate") == 6
    assert _count(m, "oprag_answers_without_sources_total", action="generated") == 3
    assert _count(m, "oprag_answers_without_sources_total", action="refused") == 0


def test_memory_records_an_unanswered_turn_with_an_empty_answer():
    mem = FakeMemory()
    _mixed(FakeGenerator(0.01), memory=mem, session_id="s")
    assert sorted(mem.promoted) == sorted(("s", n, "" if n.startswith("none") else n) for n in NAMES)


@pytest.mark.parametrize("engine", [False, True], ids=["builtin", "engine"])
def test_a_stream_without_sources_has_no_text_and_ends_no_sources(engine):
    async def run():
        eng = _engine(FakeEngineGenerator(0.01) if engine else FakeGenerator(0.01), SomeEmpty())
        eng.start()
        out = {}
        for q in ("none", "q"):
            events = [(k, v) async for k, v in job_events(eng.submit, _job(q))]
            out[q], out[q + "-done"] = [k for k, _ in events], events[-1][1]
        await eng.stop()
        return out

    out = asyncio.run(run())
    assert out["none"] == ["sources", "done"]
    d = convert.done_event(out["none-done"], include_trace=False).done
    assert (d.answer, d.completion_tokens, d.prompt_tokens, d.finish_reason) == ("", 0, 0, "no_sources")
    # (the fake builtin generator emits no text pieces; the fake engine streams one)
    assert out["q"] == ["sources", *(["text"] if engine else []), "done"] and out["q-done"].finish_reason == "stop"


def test_http_says_stop_to_openai_and_no_sources_in_the_extension():
    j = _job("none")
    j.finish_reason = NO_SOURCES
    assert openai_api.finish_reason(j) == "stop"
    assert openai_api.extension(j, include_trace=False)["finish_reason"] == "no_sources"


def test_only_a_generating_request_with_a_prompt_is_refused():
    class M:
        class answers_without_sources:  # noqa: N801 - a stand-in counter
            n = 0

            @classmethod
            def labels(cls, action):
                return cls

            @classmethod
            def inc(cls):
                cls.n += 1

    j = _job("r", generate=False)
    assert not without_sources(j, "refuse", M) and j.finish_reason == ""  # no prompt (retrieval only)
    assert M.answers_without_sources.n == 0


def test_the_option_is_parsed_and_checked():
    assert GenerateConfig().answer_without_sources == "refuse"
    parse = lambda *a: config_from_args(build_parser().parse_args(["--generator", "none", *a]))  # noqa: E731
    assert parse().generate.answer_without_sources == "refuse"
    assert parse("--answer-without-sources", "generate").generate.answer_without_sources == "generate"
    with pytest.raises(ValueError, match="refuse' or 'generate'"):
        GenerateConfig(answer_without_sources="maybe")
    assert "--answer-without-sources" in build_parser().format_help()
