"""The condense-question step of the memory operator (``--memory-condense``) with a fake
engine: the rewrite becomes the session-context row; an engine error or a slow engine leaves
the default context; a non-engine generator is refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from oprag_server.config import MemoryConfig
from oprag_server.domain import Hit
from oprag_server.operators.memory import Memory, condense_messages, condensed_text
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.state import ShardState

DIM = 8


class FakeEngine:
    """Streams a fixed reply in two deltas and records the messages it was given."""

    is_engine = True

    def __init__(self, reply: str = "", fail: bool = False, delay_s: float = 0.0) -> None:
        self.reply, self.fail, self.delay_s, self.seen = reply, fail, delay_s, []

    async def stream(self, messages, max_new_tokens, usage, stop=()):
        self.seen.append((messages, max_new_tokens))
        if self.fail:
            raise RuntimeError("engine down")
        await asyncio.sleep(self.delay_s)
        half = len(self.reply) // 2
        for part in (self.reply[:half], self.reply[half:]):
            yield part


async def _session(rewriter, cfg=MemoryConfig(condense=True, condense_timeout_s=0.5)):
    mem = Memory(in_process_pool([ShardState(i, DIM, None) for i in range(2)]), cfg, rewriter=rewriter)
    hit = Hit("z900#1", "z900", "Z900 manual", "Model Z900 warranty: 36 months.", 1.0, 0.9, 0.0, 0)
    await mem.promote("s", "What is the Z900 warranty?", "", [hit], np.ones(DIM, np.float32))
    return await mem.lookup(["And the battery warranty period?", "x"], ["s", ""])


def test_the_rewrite_is_the_context_row_and_the_prompt_holds_the_turns_subject():
    eng = FakeEngine('Standalone question: "What is the battery warranty period of the Z900?"\nextra line')
    got = asyncio.run(_session(eng))
    assert got[0].context_text == "What is the battery warranty period of the Z900?"
    assert got[1].context_text == "" and len(eng.seen) == 1  # no session: no generation
    (msgs, max_new), = eng.seen
    assert max_new == MemoryConfig().condense_tokens
    assert "What is the Z900 warranty? (about: Z900 manual)" in msgs[-1]["content"]
    assert msgs[-1]["content"].rstrip().endswith("Follow-up question: And the battery warranty period?\nStandalone question:")


@pytest.mark.parametrize("eng", [FakeEngine(fail=True), FakeEngine("late", delay_s=2.0), FakeEngine("  \n")])
def test_a_failed_slow_or_empty_rewrite_keeps_the_default_context(eng):
    got = asyncio.run(_session(eng))
    assert got[0].context_text == "And the battery warranty period? Z900 manual"


def test_without_the_flag_no_generation_and_a_non_engine_is_refused():
    eng = FakeEngine("never")
    got = asyncio.run(_session(None))
    assert got[0].context_text == "And the battery warranty period? Z900 manual" and not eng.seen
    with pytest.raises(ValueError, match="engine generator"):
        Memory(in_process_pool([ShardState(0, DIM, None)]), MemoryConfig(condense=True), rewriter=object())
    assert condensed_text("'Where?'") == "Where?" and condense_messages("q", [])[-1]["content"].endswith("Standalone question:")
