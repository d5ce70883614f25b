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
