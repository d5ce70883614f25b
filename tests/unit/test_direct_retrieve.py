"""A retrieval-only request that the prep loop would take alone at once runs in its caller's
task (``QueryEngine._direct``); what comes meanwhile is batched after it, as behind a batch of one
before; a generating request still goes through the prep loop."""

from __future__ import annotations

import asyncio

import pytest

from oprag_server.engine.query import QueryEngine
from test_scheduler import FakeGenerator, FakeRetriever, _engine, _job


class GatedRetriever(FakeRetriever):
    """Records the task each batch ran in; the first batch waits for ``gate``."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.tasks = []

    async def retrieve(self, vecs, texts, specs):
        self.tasks.append(asyncio.current_task())
        if len(self.tasks) == 1:
            await self.gate.wait()
        return await super().retrieve(vecs, texts, specs)


def test_an_idle_engine_runs_a_retrieve_in_the_callers_task_and_batches_what_comes_meanwhile():
    async def run():
        ret = GatedRetriever()
        eng = _engine(None, ret, max_batch=4)
        eng.start()
        first = asyncio.create_task(eng.submit(_job("r0", generate=False)))
        await asyncio.sleep(0.01)
        rest = [asyncio.create_task(eng.submit(_job(f"r{i}", generate=False))) for i in (1, 2, 3)]
        await asyncio.sleep(0.01)
        assert ret.batches == []  # r0 still in its retrieve; r1..r3 wait for it
        ret.gate.set()
        jobs = [await first, *[await t for t in rest]]
        metrics = eng.metrics
        await eng.stop()
        return ret, first, jobs, metrics

    ret, first, jobs, metrics = asyncio.run(run())
    assert ret.batches == [["r0"], ["r1", "r2", "r3"]]
    assert ret.tasks[0] is first and ret.tasks[1] is not first  # r0 direct, the batch in the prep loop's task
    assert [j.hits[0].doc_id for j in jobs] == ["r0", "r1", "r2", "r3"]
    assert jobs[0].batch_id < jobs[1].batch_id == jobs[2].batch_id == jobs[3].batch_id
    assert all({"queue", "retrieve", "total"} <= set(j.timings_ms) for j in jobs)
    assert sum(s.value for m in metrics.registry.collect() if m.name == "oprag_stage_seconds"
               for s in m.samples if s.name.endswith("_count") and s.labels["stage"] == "retrieve") == 4


def test_a_generating_request_goes_through_the_prep_loop():
    async def run():
        ret = GatedRetriever()
        ret.gate.set()
        eng = _engine(FakeGenerator(0.01), ret)
        eng.start()
        t = asyncio.create_task(eng.submit(_job("q")))
        job = await t
        await eng.stop()
        return ret, t, job

    ret, t, job = asyncio.run(run())
    assert job.answer == "q" and ret.tasks[0] is not t


def test_a_cancelled_direct_request_frees_its_slot_and_the_engine_serves_on():
    async def run():
        ret = GatedRetriever()
        eng: QueryEngine = _engine(None, ret)
        eng.start()
        t = asyncio.create_task(eng.submit(_job("slow", generate=False)))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert eng.inflight == 0
        ok = await asyncio.wait_for(eng.submit(_job("next", generate=False)), 5)
        await eng.stop()
        return ok

    assert asyncio.run(run()).hits[0].doc_id == "next"
