"""Generator tests on the real SmolLM2 (converted once per session) and the Echo fake."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oprag_server.models.fakes import EchoGenerator  # noqa: E402
from oprag_server.models.generator import (  # noqa: E402
    GenerationResult,
    HFGenerator,
    load_generator,
    resolve_generator_source,
)

SYSTEM = "You are a helpful assistant. Answer briefly."
USERS = [
    "Hi",
    "What is the capital of France?",
    "Context: The Eiffel Tower is a wrought-iron lattice tower in Paris. It was built from 1887 "
    "to 1889 as the entrance arch of the 1889 World's Fair. " * 5
    + "Question: when was the Eiffel Tower built?",
    "List three prime numbers.",
    "Explain in detail how photosynthesis works, covering the light reactions, the Calvin cycle "
    "and the role of chlorophyll in plants.",
]
MAX_NEW = 16


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    env = os.environ.get("OPRAG_CACHE_DIR")
    return Path(env) if env else tmp_path_factory.mktemp("oprag-cache")


@pytest.fixture(scope="module")
def gen(cache_dir) -> HFGenerator:
    g = HFGenerator("smollm2", device="cpu", cache_dir=cache_dir)
    g.warm_up()
    return g


@pytest.fixture(scope="module")
def prompts(gen) -> list[str]:
    return [gen.chat_prompt(SYSTEM, u) for u in USERS]


@pytest.fixture(scope="module")
def singles(gen, prompts) -> list[GenerationResult]:
    return [gen.generate([p], MAX_NEW)[0] for p in prompts]


def test_resolve_source(tmp_path) -> None:
    d, f = resolve_generator_source("smollm2")
    assert (d / f).is_file() and f.endswith(".gguf")
    with pytest.raises(ValueError, match="unknown generator"):
        resolve_generator_source(str(tmp_path / "nope"))
    assert load_generator("none") is None


def test_cache_reused_and_atomic(gen, cache_dir) -> None:
    assert gen.model_dir is not None and (gen.model_dir / "config.json").is_file()
    assert gen.model_dir.parent == cache_dir / "models"
    # no half-written temp directories left behind
    assert not [p.name for p in (cache_dir / "models").iterdir() if ".tmp-" in p.name]
    second = HFGenerator("smollm2", device="cpu", cache_dir=cache_dir)
    t0 = time.perf_counter()
    second.warm_up()
    elapsed = time.perf_counter() - t0
    assert second.converted is False
    assert second.model_dir == gen.model_dir
    assert elapsed < 10.0


def test_vocab_not_grown(gen) -> None:
    rows = gen.model.get_input_embeddings().weight.shape[0]
    assert len(gen.tokenizer) == rows == gen.model.config.vocab_size
    assert gen.pad_token_id == gen.tokenizer.pad_token_id
    assert gen.tokenizer.padding_side == "left"
    assert gen.max_context == gen.model.config.max_position_embeddings


def test_prompt_helpers(gen) -> None:
    p = gen.chat_prompt("SYS", "What is 2+2?")
    assert "SYS" in p and "What is 2+2?" in p and p.rstrip().endswith("assistant")
    text = "The quick brown fox jumps over the lazy dog. " * 10
    n = gen.count_tokens(text)
    assert n > 20
    cut = gen.truncate_to_tokens(text, 7)
    assert text.startswith(cut) and 0 < gen.count_tokens(cut) <= 7
    assert gen.truncate_to_tokens(text, n) == text
    assert gen.truncate_to_tokens(text, 0) == ""


def test_prompts_have_different_lengths(gen, prompts) -> None:
    lengths = sorted(gen.count_tokens(p) for p in prompts)
    assert lengths[-1] > 3 * lengths[0]
    assert len(set(lengths)) == len(lengths)


def test_batched_equals_unbatched(gen, prompts, singles) -> None:
    batched = gen.generate(prompts, MAX_NEW)
    assert len(batched) == len(prompts)
    for i, (s, b) in enumerate(zip(singles, batched)):
        assert b.token_ids == s.token_ids, i
        assert b.text == s.text
        assert b.finish_reason == s.finish_reason
        assert b.prompt_tokens == s.prompt_tokens == gen.count_tokens(prompts[i])
    # a different composition/order of the batch gives the same answers too
    order = [3, 0, 4]
    again = gen.generate([prompts[i] for i in order], MAX_NEW)
    for i, r in zip(order, again):
        assert r.token_ids == singles[i].token_ids


def test_finish_reasons(gen, prompts) -> None:
    long = gen.generate([prompts[0]], 64)[0]  # greedy "Hi" answer ends well before 64 tokens
    assert long.finish_reason == "stop"
    n = long.completion_tokens
    assert 0 < n < 64 and n == len(long.token_ids)
    assert not (set(long.token_ids) & gen.eos_token_ids)
    exact = gen.generate([prompts[0]], [n])[0]
    assert exact.finish_reason == "length" and exact.token_ids == long.token_ids
    plus = gen.generate([prompts[0]], [n + 1])[0]
    assert plus.finish_reason == "stop" and plus.token_ids == long.token_ids
    short = gen.generate([prompts[4]], 3)[0]
    assert short.finish_reason == "length" and short.completion_tokens == 3
    zero = gen.generate([prompts[1], prompts[0]], [0, 2])
    assert zero[0].finish_reason == "length" and zero[0].token_ids == [] and zero[0].text == ""
    assert zero[1].token_ids == long.token_ids[:2]
    with pytest.raises(ValueError):
        gen.generate([""], 4)
    with pytest.raises(ValueError):
        gen.generate([prompts[0]], [1, 2])


def test_streaming_deltas(gen, prompts, singles) -> None:
    deltas: dict[int, list[str]] = {}
    res = gen.generate(prompts, MAX_NEW, on_token=lambda r, d: deltas.setdefault(r, []).append(d))
    for i, r in enumerate(res):
        assert "".join(deltas.get(i, [])) == r.text
        assert r.text == gen.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        assert all(deltas.get(i, []))
        assert r.token_ids == singles[i].token_ids


def test_streaming_multibyte(gen) -> None:
    p = gen.chat_prompt(
        SYSTEM, "Write the word 'café' and a smiley emoji, then the Japanese word for cat."
    )
    deltas: list[str] = []
    r = gen.generate([p], 24, on_token=lambda _row, d: deltas.append(d))[0]
    assert "".join(deltas) == r.text
    assert "\ufffd" not in "".join(deltas[:-1])


def test_should_stop_cancels_one_row(gen, prompts, singles) -> None:
    polls = {1: 0}

    def should_stop(row: int) -> bool:
        if row != 1:
            return False
        polls[1] += 1
        return polls[1] > 4

    res = gen.generate(prompts, MAX_NEW, should_stop=should_stop)
    assert res[1].finish_reason == "cancelled"
    assert 0 < res[1].completion_tokens < singles[1].completion_tokens
    assert res[1].token_ids == singles[1].token_ids[: res[1].completion_tokens]
    for i in (0, 2, 3, 4):
        assert res[i].token_ids == singles[i].token_ids
        assert res[i].finish_reason == singles[i].finish_reason
    pre = gen.generate(prompts[:2], MAX_NEW, should_stop=lambda r: r == 0)
    assert pre[0].finish_reason == "cancelled" and pre[0].token_ids == []
    assert pre[1].token_ids == singles[1].token_ids


def test_echo_generator() -> None:
    g = EchoGenerator(answer_words=5)
    prompt = g.chat_prompt(
        "sys", "[source 1] alpha beta\n[Source 2] one two three four five six\nQ?"
    )
    deltas: list[str] = []
    r = g.generate([prompt], 10, on_token=lambda _r, d: deltas.append(d))[0]
    assert r.text == "one two three four five" and "".join(deltas) == r.text
    assert r.finish_reason == "stop" and r.completion_tokens == 5
    assert g.generate([prompt], 2)[0].finish_reason == "length"
    assert g.generate([prompt], 10, should_stop=lambda _r: True)[0].finish_reason == "cancelled"
    assert g.generate([prompt, prompt], [3, 10])[0].text == "one two three"
    assert g.truncate_to_tokens("a b c d", 2) == "a b " and g.count_tokens("a b c") == 3


def _capture_logits(gen: HFGenerator, prompts: list[str], steps: int) -> list:
    """Last-position logits per decoding step: list over steps of float32[rows, vocab]."""
    seen: list = []
    hook = gen.model.get_output_embeddings().register_forward_hook(
        lambda _m, _inp, out: seen.append(out[:, -1, :].detach().clone())
    )
    try:
        res = gen.generate(prompts, steps)
    finally:
        hook.remove()
    assert all(r.completion_tokens == steps for r in res)  # no row left early: rows stay aligned
    return seen


def test_logits_bit_identical_batched_vs_single(gen, prompts) -> None:
    """Stronger than token equality: the logits themselves must not depend on the batch."""
    import torch

    idx = [1, 2, 4]  # prompts whose answers run past 3 tokens
    batched = _capture_logits(gen, [prompts[i] for i in idx], 3)
    for row, i in enumerate(idx):
        single = _capture_logits(gen, [prompts[i]], 3)
        assert len(single) == len(batched) == 3
        for step in range(3):
            assert torch.equal(single[step][0], batched[step][row]), (i, step)


def test_the_source_cut_to_the_room_left_is_placed_with_the_real_tokenizer(gen) -> None:
    """trial28: with SmolLM2's tokenizer a source cut to fit tokenised one token longer than its
    header and text apart, so it was dropped: long questions got no source at all (``no_sources``)
    with 120-150 prompt tokens free. Every question length here leaves room for a cut source."""
    from oprag_server.domain import Hit
    from oprag_server.operators.context import build_context

    text = ("The European lobster, Homarus gammarus, is a species of clawed lobster from the eastern Atlantic "
            "Ocean, Mediterranean Sea and parts of the Black Sea. It is closely related to the American lobster. "
            "It may grow to a length of 60 cm and a mass of 6 kilograms, and bears a conspicuous pair of claws. ") * 4
    hits = [Hit(chunk_id=f"c{i}#0", doc_id=f"c{i}", title=f"Homarus gammarus {i}", text=text, score=1.0,
                dense_score=0.5, lexical_score=1.0, shard=0) for i in range(3)]
    placed = []
    for words in range(100, 400, 23):
        q = "lobster " * words
        p = build_context(q, hits, gen, budget_tokens=1024, max_new_tokens=512)
        assert p.prompt_tokens <= 512
        assert p.sources, f"{words}-word question: no source placed with {512 - p.prompt_tokens} tokens free"
        free = 512 - p.prompt_tokens
        if p.sources[-1].truncated:
            assert free < 12  # the room is used
        else:  # too little room left for a cut source: its header and 16 tokens of text, a margin of 4
            assert free < gen.count_tokens(f"[{len(p.sources) + 1}] Homarus gammarus 0\n\n\n") + 16 + 4
        placed.append(len(p.sources))
    assert placed == sorted(placed, reverse=True)  # a longer question leaves no more sources


def test_cache_key_follows_content_not_mtime(tmp_path) -> None:
    """A reinstall (same bytes, new mtime) reuses the conversion; other bytes do not."""
    from oprag_server.models.gguf import converted_model_dir, gguf_cache_key

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    b.write_bytes(a.read_bytes())
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    c.write_bytes(a.read_bytes()[:-1] + b"\x00")
    assert a.stat().st_mtime_ns != b.stat().st_mtime_ns
    assert gguf_cache_key(a) == gguf_cache_key(b)
    assert gguf_cache_key(a) != gguf_cache_key(c)
    assert converted_model_dir(tmp_path, "m", a) == converted_model_dir(tmp_path, "m", b)
    # the memo is keyed by (path, size, mtime): rewriting a file in place is seen
    a.write_bytes(c.read_bytes())
    os.utime(a, ns=(2_000_000_000, 2_000_000_000))
    assert gguf_cache_key(a) == gguf_cache_key(c)
