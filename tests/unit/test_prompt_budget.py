"""The prompt budget is ``--context-tokens`` minus ``max_new_tokens`` (README), capped by the model."""

import pytest

from oprag_server.models.fakes import EchoGenerator
from oprag_server.operators.context import build_context


def _question_tokens(gen: EchoGenerator, question: str) -> int:
    from oprag_server.operators.context import SYSTEM_PROMPT, _user
    return gen.count_tokens(gen.chat_prompt(SYSTEM_PROMPT, _user([], question, "")))


def test_max_new_tokens_is_subtracted_from_context_tokens():
    gen = EchoGenerator(max_context=8192)
    q = "lobster diet " * 300
    need = _question_tokens(gen, q)
    assert 512 < need < 1024
    with pytest.raises(ValueError) as exc:  # 1024 - 512 = 512 < need
        build_context(q, [], gen, budget_tokens=1024, max_new_tokens=512)
    msg = str(exc.value)
    assert "prompt budget is 512" in msg and "1024" in msg and "512" in msg
    build_context(q, [], gen, budget_tokens=1024, max_new_tokens=1024 - need)  # fits exactly


def test_model_context_caps_the_window():
    gen = EchoGenerator(max_context=600)
    q = "seven " * 100
    with pytest.raises(ValueError, match="prompt budget is 100 "):
        build_context(q, [], gen, budget_tokens=1024, max_new_tokens=500)


class _JoinCostGenerator(EchoGenerator):
    """Words are tokens, plus one token where a source's text follows its header line: a
    source cut to fit costs one token more than its header and its text counted apart (as
    a byte-level tokenizer's merge at the boundary, trial28 with SmolLM2's)."""

    def count_tokens(self, text: str) -> int:
        return len(text.split()) + text.count("\nw")


def _hit(i: int, words: int):
    from oprag_server.domain import Hit

    return Hit(chunk_id=f"c{i}", doc_id=f"d{i}", title=f"T{i}", text=" ".join(f"w{i}x{j}" for j in range(words)),
               score=1.0 - i / 10, dense_score=0.5, lexical_score=1.0, shard=0)


@pytest.mark.parametrize("room_words", [20, 40, 77, 150])
def test_a_source_that_does_not_fit_whole_is_placed_cut_when_its_cut_costs_more_than_its_parts(room_words):
    gen = _JoinCostGenerator(max_context=8192)
    q = "lobster diet"
    base = _question_tokens(gen, q)
    hits = [_hit(1, 30), _hit(2, 400), _hit(3, 10)]
    whole = gen.count_tokens("[1] T1\n" + hits[0].text + "\n\n")
    budget = base + whole + 4 + room_words  # 4: build_context's margin
    p = build_context(q, hits, gen, budget_tokens=budget + 16, max_new_tokens=16)
    assert [(s.doc_id, s.truncated) for s in p.sources] == [("d1", False), ("d2", True)]
    assert p.prompt_tokens <= budget
    assert p.sources[1].tokens <= room_words  # what it costs, the join token included
    assert p.sources[1].tokens >= room_words - 2  # the room is used, not left empty
    # nothing placed whole: the first source is cut to the room the question leaves
    p = build_context(q, [_hit(2, 400)], gen, budget_tokens=base + 4 + room_words + 16, max_new_tokens=16)
    assert [(s.doc_id, s.truncated) for s in p.sources] == [("d2", True)] and p.prompt_tokens <= base + 4 + room_words
