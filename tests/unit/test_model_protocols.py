"""Real models and their fakes satisfy the Encoder / Generator protocols (no weights loaded)."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oprag_server.models.encoder import TransformersEncoder  # noqa: E402
from oprag_server.models.fakes import EchoGenerator, HashingEncoder  # noqa: E402
from oprag_server.models.generator import HFGenerator  # noqa: E402
from oprag_server.models.protocols import (  # noqa: E402
    Encoder,
    GenerationResult,
    Generator,
    validate_budgets,
)


def _methods(proto: type) -> list[str]:
    return [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]


def _same_parameters(obj: object, proto: type) -> None:
    for name in _methods(proto):
        want = list(inspect.signature(getattr(proto, name)).parameters)[1:]  # drop self
        got = list(inspect.signature(getattr(obj, name)).parameters)
        assert got == want, f"{type(obj).__name__}.{name}{got} != protocol {want}"


# Constructors only locate files and read small JSON configs: no weights are loaded.
IMPLEMENTATIONS = [
    (lambda: HashingEncoder(dim=8), Encoder, Generator),
    (lambda: TransformersEncoder("minilm"), Encoder, Generator),
    (lambda: EchoGenerator(), Generator, Encoder),
    (lambda: HFGenerator("smollm2"), Generator, Encoder),
]


@pytest.mark.parametrize(
    "make, proto, other", IMPLEMENTATIONS,
    ids=["HashingEncoder", "TransformersEncoder", "EchoGenerator", "HFGenerator"],
)
def test_implementations_satisfy_protocol(make, proto, other) -> None:
    model = make()
    assert isinstance(model, proto)
    assert not isinstance(model, other)
    _same_parameters(model, proto)
    assert isinstance(model.name, str) and model.name
    if proto is Encoder:
        assert isinstance(model.dim, int) and model.dim > 0
        assert isinstance(model.max_tokens, int) and model.max_tokens > 2


def test_fake_encoder_contract() -> None:
    enc = HashingEncoder(dim=16, max_tokens=8)
    v = enc.encode(["alpha beta", "gamma"])
    assert v.dtype == np.float32 and v.shape == (2, 16)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(enc.encode_tokenized(enc.tokenize(["alpha beta"])), v[:1])
    with pytest.raises(ValueError, match="text 0"):
        enc.encode(["w " * 10])
    assert enc.encode(["w " * 10], truncate=True).shape == (1, 16)


def test_fake_generator_contract() -> None:
    gen = EchoGenerator(answer_words=3)
    deltas: list[tuple[int, str]] = []
    prompt = gen.chat_prompt("sys", "[source 1] one two three four")
    res = gen.generate([prompt, prompt], [2, 5], on_token=lambda r, d: deltas.append((r, d)))
    assert all(isinstance(r, GenerationResult) for r in res)
    assert [r.finish_reason for r in res] == ["length", "stop"]
    assert [r.text for r in res] == ["one two", "one two three"]
    assert "".join(d for r, d in deltas if r == 1) == res[1].text
    assert res[0].prompt_tokens == gen.count_tokens(prompt)


def test_validate_budgets() -> None:
    assert validate_budgets(3, 4) == [4, 4, 4]
    assert validate_budgets(2, [0, 7]) == [0, 7]
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        validate_budgets(3, [1, 2])
    with pytest.raises(ValueError, match="prompt 1"):
        validate_budgets(2, [1, -1])
