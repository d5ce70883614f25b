"""Stop sequences (:mod:`oprag_server.engine.stops`): the cut itself against its definition on texts split into
deltas in many ways, the request checks, and both generation paths of the query engine (builtin batch decoding and
an engine stream that ignores the request's stop strings). The real model over HTTP: tests/integration/test_http.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import FakeEngineGenerator, FakeGenerator, FakeRetriever, _engine, _job

from oprag_server.engine.stops import MAX_STOP_CHARS, StopCut, stop_strings
from oprag_server.models.generator import GenerationResult


def _expected(text: str, stops: list[str]) -> tuple[str, bool]:
    """The definition, by brute force over every occurrence: generation stops where the first stop string is
    complete (the smallest end), cut before it (of those ending there, the earliest start); and whether one was."""
    occ = [(i + len(s), i) for s in stops if s for i in range(len(text)) if text.startswith(s, i)]
    return (text[:min(occ)[1]], True) if occ else (text, False)


def _run(deltas: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    cut, sent = StopCut(stops), []
    for d in deltas:
        sent.append(cut.feed(d))
        assert _expected("".join(deltas), stops)[0].startswith("".join(sent))  # nothing sent that the end removes
    if not cut.hit:
        sent.append(cut.flush())
    return "".join(sent), cut.hit, sent


def _split(text: str, cuts: list[int]) -> list[str]:
    at = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:])]


# small alphabets, so stop strings occur, overlap, repeat and straddle deltas often
_text = st.text(alphabet="ab c\n", max_size=40)
_stop = st.text(alphabet="ab c\n", min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(_text, st.lists(_stop, max_size=4), st.lists(st.integers(0, 40), max_size=12))
def test_the_cut_matches_its_definition_however_the_text_is_split(text, stops, cuts):
    got, hit, _ = _run(_split(text, cuts), stops)
    assert (got, hit) == _expected(text, stops)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=6), max_size=4), st.integers(1, 5))
def test_any_unicode_in_fixed_size_deltas(text, stops, size):
    deltas = [text[i:i + size] for i in range(0, len(text), size)]
    got, hit, _ = _run(deltas, stops)
    assert (got, hit) == _expected(text, stops)


def test_the_first_stop_string_to_end_wins_however_the_text_is_split():
    # " aa" begins first, "a" ends first: generation would stop after " a", so the answer is " "
    assert _run([" aa"], ["a", " aa"])[:2] == _run([" a", "a"], ["a", " aa"])[:2] == (" ", True)
    assert _run(["xab"], ["ab", "xab"])[:2] == ("", True)  # both end at the same place: the longer is cut


def test_held_text_and_what_is_sent_when():
    cut = StopCut(["\nObservation:"])
    assert cut.feed("The answer is 4.") == "The answer is 4."
    assert cut.feed("\nObs") == ""  # could begin the stop string: held
    assert cut.feed("ervation: x") == "" and cut.hit and cut.text == "The answer is 4."
    assert cut.feed("more") == "" and cut.flush() == ""
    cut = StopCut(["\nObservation:"])
    assert cut.feed("a\nOb") == "a" and cut.feed("ey") == "\nObey" and not cut.hit  # released once it cannot match
    assert cut.feed("\n") == "" and cut.flush() == "\n"  # the end releases the held tail
    cut = StopCut([])
    assert cut.feed("x") == "x" and cut.flush() == "" and not cut.hit


def test_request_checks():
    assert stop_strings(["b", "a", "b"]) == ("b", "a")
    assert stop_strings([]) == ()
    for values, words in ((["a"] * 5, "stop has 5 strings; at most 4 are allowed"),
                          ([""], "stop must not hold an empty string"),
                          (["x" * (MAX_STOP_CHARS + 1)], f"stop has a string of {MAX_STOP_CHARS + 1} characters; the limit is")):
        with pytest.raises(ValueError) as ei:
            stop_strings(values)
        assert words in str(ei.value)

    class Custom(ValueError):
        pass

    with pytest.raises(Custom):
        stop_strings([""], Custom)


class WordGenerator(FakeGenerator):
    """Batch decoding, one word a step per row (``WORDS``), polling ``should_stop`` before each step as the real
    decoder does; records the steps each row took."""

    WORDS = ["Sources", " say", " the", " lamp", " was", " lit", " in", " 1874", ".", " STOP", " more", " words"]

    def generate(self, prompts, max_new_tokens, on_token=None, should_stop=None):
        self.batches.append((0.0, len(prompts)))
        texts, steps, reasons = [""] * len(prompts), [0] * len(prompts), ["length"] * len(prompts)
        for step in range(len(self.WORDS)):
            for i in range(len(prompts)):
                if reasons[i] != "length" or steps[i] >= max_new_tokens[i]:
                    continue
                if should_stop is not None and should_stop(i):
                    reasons[i] = "cancelled"
                    continue
                texts[i] += self.WORDS[step]
                steps[i] += 1
                if on_token is not None:
                    on_token(i, self.WORDS[step])
        self.steps = steps
        return [GenerationResult(t, [1] * n, 1, n, r) for t, n, r in zip(texts, steps, reasons)]


def _stream_job(q: str, stop=()):
    j = dataclasses.replace(_job(q), max_new_tokens=64, stop=tuple(stop))
    j.events = asyncio.Queue()
    return j


def _texts(job) -> str:
    out = []
    while not job.events.empty():
        kind, v = job.events.get_nowait()
        if kind == "text":
            out.append(v)
    return "".join(out)


def test_builtin_batch_rows_cut_at_their_own_stop_strings_and_leave_the_batch():
    async def run():
        gen = WordGenerator(0.0)
        eng = _engine(gen, FakeRetriever(), max_batch=4)
        eng.start()
        jobs = [_stream_job("a", [" STOP"]), _stream_job("b"), _stream_job("c", ["lit", " in"]),
                _stream_job("d", ["18", "zzz"])]
        await asyncio.gather(*[eng.submit(j) for j in jobs])
        await eng.stop()
        return jobs, gen

    jobs, gen = asyncio.run(run())
    full = "".join(WordGenerator.WORDS)
    want = ["Sources say the lamp was lit in 1874.", full, "Sources say the lamp was ", "Sources say the lamp was lit in "]
    assert [j.answer for j in jobs] == want
    assert [j.finish_reason for j in jobs] == ["stop", "length", "stop", "stop"]
    assert [_texts(j) for j in jobs] == want  # the streamed text is the answer, no piece of a stop string in it
    assert gen.steps[0] < len(WordGenerator.WORDS) and gen.steps[2] < gen.steps[0]  # cut rows stopped decoding
    assert gen.steps[1] == len(WordGenerator.WORDS)


class IgnoringEngine(FakeEngineGenerator):
    """An engine that takes the stop strings and ignores them, streaming word by word."""

    def __init__(self):
        super().__init__(0.0)
        self.stops, self.sent = [], 0

    async def stream(self, messages, max_new_tokens, usage, stop=()):
        self.stops.append(tuple(stop))
        for w in WordGenerator.WORDS:
            self.sent += 1
            yield w
        usage.finish_reason = "length"


def test_an_engine_stream_is_cut_too_and_gets_the_stop_strings():
    async def run():
        gen = IgnoringEngine()
        eng = _engine(gen, FakeRetriever(), max_batch=1)
        eng.start()
        cut, plain = _stream_job("a", [" was"]), _stream_job("b")
        await eng.submit(cut)
        await eng.submit(plain)
        await eng.stop()
        return cut, plain, gen

    cut, plain, gen = asyncio.run(run())
    assert (cut.answer, cut.finish_reason, _texts(cut)) == ("Sources say the lamp", "stop", "Sources say the lamp")
    assert (plain.answer, plain.finish_reason) == ("".join(WordGenerator.WORDS), "length")
    assert gen.stops == [(" was",), ()]
    assert gen.sent == 5 + len(WordGenerator.WORDS)  # the cut stream was closed at the stop string
