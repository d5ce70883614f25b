"""Trial 21: a long earlier question (session memory, or an earlier chat message) is cut to fit
the prompt budget; only a question that does not fit by itself is refused."""

import pytest

from oprag_server.domain import Hit
from oprag_server.models.fakes import EchoGenerator
from oprag_server.operators.context import MEMORY_SHARE, build_context


def _hit(i: int) -> Hit:
    return Hit(chunk_id=f"c{i}", doc_id=f"d{i}", text="lobsters eat fish and molluscs " * 8, title=f"T{i}",
               score=1.0, dense_score=1.0, lexical_score=1.0, shard=0)


def test_long_memory_is_cut_and_the_short_question_is_answered_with_sources():
    gen = EchoGenerator(max_context=8192)
    memory = "Previous question: " + "lobster habitat " * 1000
    p = build_context("What does it eat?", [_hit(1), _hit(2)], gen, budget_tokens=1024, max_new_tokens=64,
                      memory_text=memory)
    budget = 1024 - 64
    assert p.prompt_tokens <= budget
    assert p.sources, "the memory must leave room for the sources"
    assert "Earlier in this conversation:\nPrevious question: lobster habitat" in p.prompt and " ...\n" in p.prompt
    mem = p.messages[1]["content"].split("Sources:")[0]
    assert gen.count_tokens(mem) <= budget // MEMORY_SHARE + 8


def test_short_memory_is_kept_whole():
    gen = EchoGenerator(max_context=8192)
    p = build_context("What does it eat?", [_hit(1)], gen, budget_tokens=1024, max_new_tokens=64,
                      memory_text="Previous question: What is Homarus gammarus?")
    assert "Previous question: What is Homarus gammarus?\n" in p.prompt


def test_a_question_that_alone_does_not_fit_is_refused_naming_the_question():
    gen = EchoGenerator(max_context=8192)
    with pytest.raises(ValueError, match="the question needs .* shorten the question"):
        build_context("lobster " * 2000, [], gen, budget_tokens=1024, max_new_tokens=64, memory_text="Previous question: x")


def test_question_filling_the_budget_leaves_no_memory():
    gen = EchoGenerator(max_context=8192)
    from oprag_server.operators.context import SYSTEM_PROMPT, _user
    q = "lobster " * 900
    need = gen.count_tokens(gen.chat_prompt(SYSTEM_PROMPT, _user([], q, "")))
    p = build_context(q, [], gen, budget_tokens=need + 64, max_new_tokens=64, memory_text="Previous question: a b c")
    assert p.prompt_tokens <= need and "Earlier in this conversation" not in p.prompt
