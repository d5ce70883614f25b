"""A request the prep cannot serve fails alone, not the requests batched with it (trial16: a
hybrid RRF request whose filter matched nothing raised inside the batch's retrieval, and every
request of the batch was answered INTERNAL)."""

from __future__ import annotations

import asyncio

import pytest

from test_scheduler import FakeGenerator, FakeRetriever, _engine, _job


class PickyRetriever(FakeRetriever):
    """Fails any batch holding the question "bad"."""

    async def retrieve(self, vecs, texts, specs):
        await asyncio.sleep(0.02)  # (so that requests queue behind the one in flight and batch)
        if "bad" in texts:
            self.batches.append(list(texts))
            raise IndexError("list index out of range")
        return await super().retrieve(vecs, texts, specs)


def _run(generate: bool):
    """8 good requests and a "bad" one, batched: (names, replies or errors, retriever, metrics)."""
    async def run():
        ret = PickyRetriever()
        eng = _engine(FakeGenerator(0.01), ret, max_batch=8)
        eng.start()
        names = [f"q{i}" for i in range(4)] + ["bad"] + [f"q{i}" for i in range(4, 8)]
        got = await asyncio.gather(*[eng.submit(_job(n, generate=generate)) for n in names], return_exceptions=True)
        await eng.stop()
        return names, got, ret, eng.metrics

    return asyncio.run(run())


@pytest.mark.parametrize("generate", [False, True])
def test_one_failing_request_fails_alone(generate):
    names, got, ret, _ = _run(generate)
    assert isinstance(got[4], IndexError)
    for n, j in zip(names, got):
        if n != "bad":
            assert not isinstance(j, BaseException), (n, j)
            assert j.hits[0].doc_id == n and (j.answer == n if generate else j.answer == "")
    assert any("bad" in b and len(b) > 1 for b in ret.batches), ret.batches  # batched with others first


def test_a_request_prepared_again_alone_has_its_queue_and_steps_recorded_once():
    """Issue 17 trial: the requests of a failed prep batch, prepared again one by one, had their
    queue time and prep steps recorded twice (trace entries, oprag_stage_seconds counts)."""
    _, got, ret, m = _run(False)
    assert any("bad" in b and len(b) > 1 for b in ret.batches), ret.batches  # a batch failed and was retried
    jobs = [j for j in got if not isinstance(j, BaseException)]
    assert len(jobs) == 8
    for j in jobs:
        ops = [s["op"] for s in j.trace()]
        assert len(ops) == len(set(ops)), ops
        assert "retrieve" in ops

    def count(stage):
        return m.registry.get_sample_value("oprag_stage_seconds_count", {"stage": stage}) or 0.0

    assert count("queue") == 9  # every request once ("bad" too: it was queued)
    assert count("retrieve") == 8 and count("fusion") == 8
    for op in {s["op"] for j in jobs for s in j.trace()} - {"retrieve"}:
        assert count(op) == 9, op  # the steps before the failed one: once per request
