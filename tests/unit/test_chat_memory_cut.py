"""The earlier user message a chat request turns into memory (service/openai_api.conversation) is
cut to the question limit (trial23 #1: uncut, one pasted 10 MB message was embedded and
BM25-scored whole on the shared query path and held every other request for minutes)."""

from __future__ import annotations

import time

from oprag_server.service import openai_api as api


def _req(*texts: str) -> api.ChatRequest:
    return api.ChatRequest(model="oprag", messages=[{"role": "user", "content": t} for t in texts])


def test_a_short_earlier_message_is_kept_whole_with_whitespace_runs_as_one_space():
    q, mem = api.conversation(_req("What  do\tlobsters\n eat?", "Where do they live?"), 4096)
    assert q == "Where do they live?"
    assert mem.memory_text == "Previous question: What do lobsters eat?"
    assert mem.context_text == "Where do they live? What do lobsters eat?"


def test_a_long_earlier_message_is_cut_at_a_word_boundary_to_the_limit():
    words = [f"w{i}" for i in range(1000)]
    _, mem = api.conversation(_req("  ".join(words), "And then?"), 50)
    prev = mem.context_text[len("And then? "):]
    assert len(prev) <= 50 and prev == " ".join(words)[:len(prev)] and prev.split() == words[:len(prev.split())]
    assert len(" ".join(words[:len(prev.split()) + 1])) > 50  # as many words as fit
    assert mem.memory_text == "Previous question: " + prev


def test_one_word_longer_than_the_limit_is_cut_mid_word():
    _, mem = api.conversation(_req("   " + "x" * 100, "Why?"), 10)
    assert mem.memory_text == "Previous question: " + "x" * 10


def test_a_huge_earlier_message_costs_little():
    huge = "lobster habitat " * 2_000_000  # 32 MB, the HTTP body limit
    t = time.perf_counter()
    _, mem = api.conversation(_req(huge, "Why?"), 4096)
    assert time.perf_counter() - t < 0.5
    assert len(mem.context_text) <= len("Why? ") + 4096
