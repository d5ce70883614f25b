"""fix21d: a cancelled request stops costing prefill (real SmolLM2 on CPU).

trial21: six queries whose 2 s deadline passed during their batch's prefill still held the
generator for the whole 67 s prefill (cancellation was polled only at the first token), and
the next live query waited 71.6 s instead of 4.3 s. The prefill now runs in chunks of
``PREFILL_CHUNK`` token columns and polls ``should_stop`` between them: cancelled rows leave the
batch, and a batch with none left ends. Chunk boundaries count from the prompts' common end, so
a row's answer is still the same batched or alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oprag_server.models.decoding import PREFILL_CHUNK  # noqa: E402
from oprag_server.models.generator import HFGenerator  # noqa: E402

FACT = "The Varnholm lighthouse stands on a granite islet and was lit for the first time in 1871. "
QUESTIONS = [FACT * 16 + "When was it first lit?", FACT * 5 + "Where does it stand?", "Say hello."]
MAX_NEW = 6


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> HFGenerator:
    env = os.environ.get("OPRAG_CACHE_DIR")
    g = HFGenerator("smollm2", device="cpu", cache_dir=Path(env) if env else tmp_path_factory.mktemp("cache"))
    g.warm_up()
    return g


@pytest.fixture(scope="module")
def prompts(gen) -> list[str]:
    ps = [gen.chat_prompt("Answer briefly.", q) for q in QUESTIONS]
    lens = [gen.count_tokens(p) for p in ps]
    assert lens[0] > 3 * PREFILL_CHUNK and PREFILL_CHUNK < lens[1] < 2 * PREFILL_CHUNK and lens[2] < PREFILL_CHUNK
    return ps


def _forwards(gen: HFGenerator) -> tuple[list[tuple[int, int]], object]:
    """(the ``[rows, columns]`` of every decoder forward, the hook handle)."""
    seen: list[tuple[int, int]] = []
    h = gen.model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return seen, h


def test_a_batch_cancelled_during_its_prefill_stops_after_one_chunk(gen, prompts) -> None:
    seen, h = _forwards(gen)
    try:  # every caller leaves while the first chunk runs (the deadline passes)
        res = gen.generate(prompts, MAX_NEW, should_stop=lambda _row: len(seen) > 0)
    finally:
        h.remove()
    assert [r.finish_reason for r in res] == ["cancelled"] * 3
    assert [r.completion_tokens for r in res] == [0, 0, 0]  # (before: a whole prefill, then 1 token each)
    assert len(seen) == 1 and seen[0][1] <= PREFILL_CHUNK, seen


def test_a_row_cancelled_during_the_prefill_leaves_and_the_rest_answer_as_alone(gen, prompts) -> None:
    singles = [gen.generate([p], MAX_NEW)[0] for p in prompts]
    seen, h = _forwards(gen)
    try:
        res = gen.generate(prompts, MAX_NEW, should_stop=lambda row: row == 0 and len(seen) > 0)
    finally:
        h.remove()
    assert res[0].finish_reason == "cancelled" and res[0].completion_tokens == 0
    assert seen[0][0] == 3 and seen[1][0] == 2, seen  # row 0 left after the first chunk
    for i in (1, 2):
        assert res[i].token_ids == singles[i].token_ids and res[i].finish_reason == singles[i].finish_reason


def test_long_prompts_answer_the_same_batched_or_alone_with_a_chunked_prefill(gen, prompts) -> None:
    seen, h = _forwards(gen)
    try:
        batched = gen.generate(prompts, MAX_NEW)
    finally:
        h.remove()
    assert sum(1 for s in seen if s[1] > 1) > 1  # the prefill ran in several chunks
    for p, r in zip(prompts, batched):
        assert gen.generate([p], MAX_NEW)[0].token_ids == r.token_ids
