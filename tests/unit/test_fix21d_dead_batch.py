"""fix21d: requests whose caller left before their batch reaches the generator are not prefilled.

(Guard: the executor already drops them -- ``_run`` takes only live jobs and the decoding loop
polls ``should_stop`` before the prefill; trial21's batch was still alive when its prefill
began, which the chunked prefill covers: tests/unit/test_fix21d_prefill.py.)
"""

from __future__ import annotations

import asyncio

from test_scheduler import FakeGenerator, FakeRetriever, _engine, _job  # (tests/unit is on sys.path)


class CountingGenerator(FakeGenerator):
    """FakeGenerator that also records each batch's prompts (the rows it would prefill)."""

    def __init__(self, delay):
        super().__init__(delay)
        self.prompts = []

    def generate(self, prompts, max_new_tokens, on_token=None, should_stop=None):
        self.prompts.append(list(prompts))
        return super().generate(prompts, max_new_tokens, on_token, should_stop)


def test_dead_members_leave_a_waiting_batch_and_an_all_dead_batch_never_reaches_the_generator():
    async def run():
        gen = CountingGenerator(0.4)
        eng = _engine(gen, FakeRetriever(), max_batch=3)
        eng.start()
        first = asyncio.create_task(eng.submit(_job("busy")))
        await asyncio.sleep(0.1)  # "busy" generates for 0.4 s; the next batches wait for it
        mixed = [asyncio.create_task(eng.submit(_job(q))) for q in ("live", "gone1", "gone2")]
        await asyncio.sleep(0.1)
        dead = [asyncio.create_task(eng.submit(_job(q))) for q in ("gone3", "gone4", "gone5")]
        await asyncio.sleep(0.1)  # both batches prepared, waiting behind "busy"
        for t in mixed[1:] + dead:
            t.cancel()  # their deadline passes
        done = await asyncio.gather(first, *mixed, *dead, return_exceptions=True)
        nxt = await eng.submit(_job("next"))
        await eng.stop()
        return gen, done, nxt

    gen, done, nxt = asyncio.run(run())
    assert [b[-1].split("Question: ")[-1] for b in gen.prompts] == ["busy", "live", "next"]
    assert [len(b) for b in gen.prompts] == [1, 1, 1], gen.prompts
    assert done[1].answer == "live" and nxt.answer == "next"
    assert all(isinstance(d, asyncio.CancelledError) for d in done[2:])
