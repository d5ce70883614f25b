"""The lone-retrieve fast path (``QueryEngine._lone``, engine/direct.py): a direct request whose
plan is the retrieve step alone runs that step without the batch machinery, with the same
results, timings, trace and metrics as through ``_prep_batch``; anything else takes the general
path."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from test_direct_retrieve import GatedRetriever
from test_scheduler import FakeGenerator, FakeMemory, FakeRetriever, _engine, _job

from oprag_server.domain import RetrievalInfo
from oprag_server.engine import query as query_mod
from oprag_server.engine.query import QueryEngine

VEC = np.full(4, 0.5, np.float32)


class InfoRetriever(FakeRetriever):
    """Hits, timings and a RetrievalInfo per query (what the real retriever returns)."""

    async def retrieve(self, vecs, texts, specs):
        hits, _, _ = await super().retrieve(vecs, texts, specs)
        return hits, {"retrieve": 0.003, "fusion": 0.001}, [RetrievalInfo(s.mode, "weighted_minmax", 0.5, 0.5, 0,
                                                                          s.candidates, 7) for s in specs]


def _samples(metrics) -> dict:
    """``{(metric, labels, sample name): value}`` of every metric, times left out (the sums and
    buckets of the ``*_seconds`` histograms: their counts stay)."""
    return {(m.name, tuple(sorted(s.labels.items())), s.name): s.value for m in metrics.registry.collect()
            for s in m.samples if not s.name.endswith(("_sum", "_created"))
            and not (m.name.endswith("_seconds") and s.name.endswith("_bucket"))}


def _run(jobs, *, lone: bool, retriever=None, monkeypatch=None):
    """Submit ``jobs`` one after another on a fresh engine; with ``lone`` False the fast path is
    switched off (its plan matches no request). :returns: the jobs, the metrics, the lone calls."""
    if not lone:
        monkeypatch.setattr(query_mod, "LONE", object())
    calls = []

    async def run():
        eng = _engine(None, retriever or InfoRetriever())
        inner = eng._lone

        async def spy(job):
            calls.append(job.question)
            return await inner(job)

        eng._lone = spy
        eng.start()
        out = [await eng.submit(j) for j in jobs]
        assert eng.inflight == 0 and not eng._busy and not eng._preparing
        await eng.stop()
        return out, eng.metrics

    out, metrics = asyncio.run(run())
    return out, metrics, calls


def _view(j):
    return (j.hits, j.info, j.documents, sorted(j.timings_ms), [(s.op, s.domain, s.batch_id) for s in j.stages],
            j.batch_id, j.future is None)


def test_a_lone_retrieve_equals_the_general_path_and_counts_once(monkeypatch):
    jobs = lambda: [_job(f"q{i}", generate=False, query_vector=VEC) for i in range(3)]  # noqa: E731
    fast, m_fast, calls = _run(jobs(), lone=True)
    assert calls == ["q0", "q1", "q2"]
    assert all(j.future is None for j in fast)  # no future, no shield: the old path made one per request
    slow, m_slow, calls_off = _run(jobs(), lone=False, monkeypatch=monkeypatch)
    assert calls_off == [] and all(j.future is not None for j in slow)
    assert [_view(a)[:-1] for a in fast] == [_view(b)[:-1] for b in slow]
    assert sorted(fast[0].timings_ms) == ["fusion", "queue", "rerank", "retrieve", "total"]
    assert [s.op for s in fast[0].stages] == ["retrieve"] and fast[0].timings_ms["retrieve"] == 3.0
    assert _samples(m_fast) == _samples(m_slow)  # every count and bucket: each request counted once
    stage = {k[1]: v for k, v in _samples(m_fast).items()
             if k[0] == "oprag_stage_seconds" and k[2].endswith("_count") and v}
    assert stage == {(("stage", "queue"),): 3, (("stage", "retrieve"),): 3, (("stage", "fusion"),): 3}


@pytest.mark.parametrize("case", ["embed", "memory", "generate", "events", "busy"])
def test_other_requests_take_the_general_path(case, monkeypatch):
    job = _job("q", generate=case == "generate", query_vector=None if case == "embed" else VEC,
               session_id="s" if case == "memory" else "")
    if case == "events":
        job.events = asyncio.Queue()
    calls, prep = [], []

    async def run():
        eng = _engine(FakeGenerator(0.0) if case == "generate" else None, InfoRetriever(), memory=FakeMemory())
        inner_lone, inner_prep = eng._lone, eng._prep_batch

        async def lone(j):
            calls.append(j)
            return await inner_lone(j)

        async def prep_batch(batch, batch_id):
            prep.append([j.question for j in batch])
            return await inner_prep(batch, batch_id)

        eng._lone, eng._prep_batch = lone, prep_batch
        eng.start()
        if case == "busy":  # a request already runs directly: the next one waits for the prep loop
            eng._busy = True
            t = asyncio.create_task(eng.submit(job))
            await asyncio.sleep(0.01)
            eng._busy = False
            eng._arrived.set()
            got = await t
        else:
            got = await eng.submit(job)
        await eng.stop()
        return got

    got = asyncio.run(run())
    assert calls == [] and prep == [["q"]]
    assert got.hits and got.future is not None


def test_a_failing_lone_retrieve_raises_logs_and_the_engine_serves_on(caplog):
    class Failing(InfoRetriever):
        n = 0

        async def retrieve(self, vecs, texts, specs):
            Failing.n += 1
            if Failing.n == 1:
                raise RuntimeError("shard on fire")
            return await super().retrieve(vecs, texts, specs)

    async def run():
        eng = _engine(None, Failing())
        eng.start()
        with pytest.raises(RuntimeError, match="shard on fire"):
            await eng.submit(_job("bad", generate=False, query_vector=VEC))
        state = (eng.inflight, eng._busy, eng._preparing)
        ok = await eng.submit(_job("good", generate=False, query_vector=VEC))
        await eng.stop()
        return state, ok, eng.metrics

    with caplog.at_level(logging.ERROR, logger="oprag_server.engine.query"):
        state, ok, metrics = asyncio.run(run())
    assert state == (0, False, 0)
    assert ok.hits[0].doc_id == "good"
    assert any(r.getMessage() == "query batch failed" for r in caplog.records)
    retrieve = [s.value for m in metrics.registry.collect() if m.name == "oprag_stage_seconds" for s in m.samples
                if s.name.endswith("_count") and s.labels["stage"] == "retrieve"]
    assert retrieve == [1]  # the failed step is not counted, as before


def test_a_cancelled_lone_retrieve_frees_its_slot_and_what_waited_runs_next():
    async def run():
        ret = GatedRetriever()
        eng: QueryEngine = _engine(None, ret)
        eng.start()
        first = _job("slow", generate=False, query_vector=VEC)
        t = asyncio.create_task(eng.submit(first))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(eng.submit(_job("next", generate=False, query_vector=VEC)))  # waits: one runs
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        ret.gate.set()
        nxt = await asyncio.wait_for(second, 5)
        state = (eng.inflight, eng._busy, eng._preparing)
        await eng.stop()
        return first, nxt, state

    first, nxt, state = asyncio.run(run())
    assert first.cancelled and nxt.hits[0].doc_id == "next" and state == (0, False, 0)
