"""The pure batch policy and the query executor with deterministic fakes (no models, no shards)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from oprag_server.config import BatchConfig, GenerateConfig
from oprag_server.engine.job import QueryJob
from oprag_server.engine.query import Overloaded, QueryEngine
from oprag_server.engine.rwlock import RWLock
from oprag_server.engine.scheduler import QUERY_OPERATORS, BatchPolicy, batch_steps, compile_plan, split_plan
from oprag_server.domain import Hit, MemoryContext, RetrieveSpec
from oprag_server.service.metrics import Metrics


def test_policy_waits_then_closes_on_size_or_age():
    p = BatchPolicy(max_batch=4, max_wait_s=0.01)
    assert p.decide(0, 0.0).take == 0 and math.isinf(p.decide(0, 0.0).wait_s)
    d = p.decide(2, 0.004)
    assert d.take == 0 and d.wait_s == pytest.approx(0.006)
    assert p.decide(2, 0.01).take == 2
    assert p.decide(9, 0.0).take == 4
    assert p.decide(2, 0.0, downstream_busy=False).take == 2  # nothing to overlap with: no waiting
    # a batch bound for an idle generator still waits for company (up to max_wait_s)
    d = p.decide(1, 0.004, downstream_busy=False, will_generate=True)
    assert d.take == 0 and d.wait_s == pytest.approx(0.006)
    assert p.decide(1, 0.01, downstream_busy=False, will_generate=True).take == 1
    assert p.decide(4, 0.0, downstream_busy=False, will_generate=True).take == 4
    with pytest.raises(ValueError):
        BatchPolicy(0, 0.1)


def _ops(plan):
    return [s.op for s in plan]


def test_plan_is_data():
    plan = compile_plan(memory=True, generate=True)
    assert compile_plan(memory=False, generate=False) == compile_plan(memory=False, generate=False)
    assert all(s.domain for s in plan)
    assert {s.op for s in QUERY_OPERATORS} == {"memory", "embed", "retrieve", "context", "generate", "promote"}


def test_plan_per_request_kind():
    # retrieve only
    assert _ops(compile_plan(memory=False, generate=False)) == ["embed", "retrieve"]
    # retrieve only, the client sent its query vector
    assert _ops(compile_plan(memory=False, generate=False, embed=False)) == ["retrieve"]
    # generate
    assert _ops(compile_plan(memory=False, generate=True)) == ["embed", "retrieve", "context", "generate"]
    # retrieve only, with session memory: looked up first, the turn promoted last
    assert _ops(compile_plan(memory=True, generate=False)) == ["memory", "embed", "retrieve", "promote"]
    # generate with session memory
    assert _ops(compile_plan(memory=True, generate=True)) == [
        "memory", "embed", "retrieve", "context", "generate", "promote"]


def test_plan_phases_and_batch_steps():
    full = compile_plan(memory=True, generate=True)
    prep, answer = split_plan(full)
    assert _ops(prep) == ["memory", "embed", "retrieve", "context"] and _ops(answer) == ["generate", "promote"]
    prep, answer = split_plan(compile_plan(memory=True, generate=False))
    assert _ops(prep) == ["memory", "embed", "retrieve"] and _ops(answer) == ["promote"]
    assert split_plan(compile_plan(memory=False, generate=False))[1] == ()
    # a mixed batch runs the union of its plans, in operator order
    mixed = [compile_plan(memory=False, generate=True), compile_plan(memory=True, generate=False, embed=False)]
    assert _ops(batch_steps(mixed)) == ["memory", "embed", "retrieve", "context", "generate", "promote"]
    assert batch_steps([]) == ()


class FakeEncoder:
    dim = 4
    max_tokens = 64
    name = "fake"

    def encode(self, texts, truncate=False):
        return np.ones((len(texts), self.dim), np.float32) / 2.0


class FakeEmbedder:
    async def embed_queries(self, texts):
        return FakeEncoder().encode(texts)


class FakeRetriever:
    def __init__(self):
        self.batches = []

    async def retrieve(self, vecs, texts, specs):
        self.batches.append(list(texts))
        hits = [[Hit(f"{t}#0", t, "", f"text of {t}", 1.0, 1.0, 0.0, 0)] for t in texts]
        return hits, {"retrieve": 0.0, "fusion": 0.0}, [None] * len(texts)


class FakeMemory:
    def __init__(self):
        self.promoted = []

    async def lookup(self, questions, sessions):
        return [MemoryContext(q, "", 0) for q in questions]

    async def promote(self, session_id, question, answer, *a, **kw):
        self.promoted.append((session_id, question, answer))


class FakeGenerator:
    """Records when each batch generates; takes `delay` seconds per batch."""

    name = "fake-gen"
    max_context = 4096

    def __init__(self, delay=0.05):
        self.delay = delay
        self.batches = []
        self.active = threading.Event()

    def chat_prompt(self, system, user):
        return user

    def count_tokens(self, text):
        return len(text.split())

    def truncate_to_tokens(self, text, n):
        return " ".join(text.split()[:n])

    def generate(self, prompts, max_new_tokens, on_token=None, should_stop=None):
        from oprag_server.models.generator import GenerationResult

        self.batches.append((time.perf_counter(), len(prompts)))
        time.sleep(self.delay)
        return [GenerationResult(p.split("Question: ")[-1], [1], 1, 1, "stop") for p in prompts]


def _engine(gen, retriever, overlap=True, capacity=64, max_batch=4, memory=None):
    return QueryEngine(
        generator=gen, retriever=retriever, memory=memory or FakeMemory(), lock=RWLock(),
        batch=BatchConfig(max_batch=max_batch, max_wait_ms=2.0, queue_capacity=capacity, overlap=overlap),
        gen_cfg=GenerateConfig(), embedder=FakeEmbedder(), metrics=Metrics(),
    )


def _job(q, generate=True, session_id="", query_vector=None):
    return QueryJob(question=q, spec=RetrieveSpec(top_k=1), generate=generate, max_new_tokens=4,
                    session_id=session_id, query_vector=query_vector)


def test_concurrent_queries_are_batched_and_answered_in_order():
    async def run():
        gen, ret = FakeGenerator(0.02), FakeRetriever()
        eng = _engine(gen, ret)
        eng.start()
        jobs = await asyncio.gather(*[eng.submit(_job(f"q{i}")) for i in range(10)])
        await eng.stop()
        return jobs, gen, ret

    jobs, gen, ret = asyncio.run(run())
    assert [j.answer for j in jobs] == [f"q{i}" for i in range(10)]
    assert all(j.hits[0].doc_id == f"q{i}" for i, j in enumerate(jobs))
    assert max(len(b) for b in ret.batches) == 4  # batches closed at max_batch
    assert sum(n for _, n in gen.batches) == 10
    assert len({j.batch_id for j in jobs}) < 10


def test_overlap_prepares_next_batch_while_generating():
    """With overlap the prep of batch n+1 happens before generation of batch n ends; without, after.

    Checked by the order of events (a retrieve call's start against the generation intervals),
    not by wall time: a busy CI machine stretches both runs unevenly.
    """

    class TimedRetriever(FakeRetriever):
        def __init__(self):
            super().__init__()
            self.starts = []

        async def retrieve(self, vecs, texts, specs):
            self.starts.append(time.perf_counter())
            return await super().retrieve(vecs, texts, specs)

    class TimedGenerator(FakeGenerator):
        def __init__(self, delay):
            super().__init__(delay)
            self.intervals = []

        def generate(self, prompts, max_new_tokens, on_token=None, should_stop=None):
            t0 = time.perf_counter()
            try:
                return super().generate(prompts, max_new_tokens, on_token, should_stop)
            finally:
                self.intervals.append((t0, time.perf_counter()))

    async def run(overlap):
        gen, ret = TimedGenerator(0.1), TimedRetriever()
        eng = _engine(gen, ret, overlap=overlap, max_batch=2)
        eng.start()
        jobs = await asyncio.gather(*[eng.submit(_job(f"q{i}")) for i in range(8)])
        await eng.stop()
        assert [j.answer for j in jobs] == [f"q{i}" for i in range(8)]
        # retrieve calls that began while a generation batch was running
        during = sum(any(a < s < b for a, b in gen.intervals) for s in ret.starts)
        return during, len(gen.batches), len(ret.starts)

    during_overlap, n1, r1 = asyncio.run(run(True))
    during_seq, n2, r2 = asyncio.run(run(False))
    assert n1 == n2 == 4 and r1 == r2 == 4
    assert during_seq == 0  # sequential: each prep waits for the previous generation
    assert during_overlap >= 1  # overlapped: some batch n+1 was retrieved while batch n generated


def test_admission_control_raises_overloaded():
    async def run():
        gen, ret = FakeGenerator(0.2), FakeRetriever()
        eng = _engine(gen, ret, capacity=3, max_batch=1)
        eng.start()
        tasks = [asyncio.create_task(eng.submit(_job(f"q{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as ei:
            await eng.submit(_job("extra"))
        assert ei.value.retry_after_s > 0
        await asyncio.gather(*tasks)
        await eng.stop()

    asyncio.run(run())


def test_cancelled_request_frees_its_slot():
    async def run():
        gen, ret = FakeGenerator(0.1), FakeRetriever()
        eng = _engine(gen, ret, capacity=2, max_batch=1)
        eng.start()
        t = asyncio.create_task(eng.submit(_job("slow")))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert eng.inflight == 0
        ok = await eng.submit(_job("next"))
        await eng.stop()
        return ok

    assert asyncio.run(run()).answer == "next"


def test_retrieve_only_jobs_skip_generation():
    async def run():
        gen, ret = FakeGenerator(0.01), FakeRetriever()
        eng = _engine(gen, ret)
        eng.start()
        j = await eng.submit(_job("r", generate=False))
        await eng.stop()
        return j, gen

    j, gen = asyncio.run(run())
    assert j.hits and j.answer == "" and gen.batches == []


def test_latency_admission_refuses_when_estimated_delay_exceeds_budget():
    async def run():
        gen, ret = FakeGenerator(0.2), FakeRetriever()
        eng = _engine(gen, ret, capacity=100, max_batch=2)
        eng.cfg = BatchConfig(max_batch=2, max_wait_ms=2.0, queue_capacity=100, max_queue_delay_ms=300.0)
        eng.generate_s = 0.2
        eng.start()
        tasks = [asyncio.create_task(eng.submit(_job(f"q{i}"))) for i in range(4)]
        await asyncio.sleep(0.01)
        t = time.perf_counter()
        with pytest.raises(Overloaded):  # 4 in flight = 2 batches x 0.2 s = 400 ms > 300 ms
            await eng.submit(_job("late"))
        assert time.perf_counter() - t < 0.05  # refused at once
        await asyncio.gather(*tasks)
        ok = await eng.submit(_job("after"))  # queue drained: admitted again
        await eng.stop()
        return ok

    assert asyncio.run(run()).answer == "after"


def test_executed_trace_equals_compiled_plan():
    """Every request kind, batched together: each one's trace is its compiled plan, step for step,
    its timings carry one key per executed operator, and promotion follows the answer."""

    async def run():
        gen, ret, mem = FakeGenerator(0.01), FakeRetriever(), FakeMemory()
        eng = _engine(gen, ret, memory=mem)
        eng.start()
        jobs = await asyncio.gather(
            eng.submit(_job("a")),
            eng.submit(_job("b", generate=False)),
            eng.submit(_job("c", session_id="s1")),
            eng.submit(_job("d", generate=False, session_id="s2")),
            eng.submit(_job("e", generate=False, query_vector=np.ones(4, np.float32) / 2)),
        )
        await eng.stop()
        return jobs, mem

    jobs, mem = asyncio.run(run())
    for j in jobs:
        trace = j.trace()
        assert [(t["op"], t["domain"]) for t in trace] == [(s.op, s.domain) for s in j.plan]
        assert all(t["batch_id"] == j.batch_id and t["run_ms"] >= 0 and t["queue_ms"] >= 0 for t in trace)
        assert {s.op for s in j.plan} <= set(j.timings_ms)
        assert {"queue", "total"} <= set(j.timings_ms)
    assert _ops(jobs[2].plan) == ["memory", "embed", "retrieve", "context", "generate", "promote"]
    assert _ops(jobs[4].plan) == ["retrieve"]
    assert "rerank" in jobs[0].timings_ms and jobs[0].timings_ms["fusion"] == jobs[0].timings_ms["rerank"]
    assert sorted(mem.promoted) == [("s1", "c", "c"), ("s2", "d", "")]


def test_stage_metric_labels_are_the_operator_names():
    from oprag_server.service.metrics import STAGES

    assert {s.op for s in QUERY_OPERATORS} <= set(STAGES)
    assert "rerank" not in STAGES and "reason" not in STAGES


class FakeEngineGenerator(FakeGenerator):
    """An engine backend (``is_engine``): each request streams for ``delay`` seconds; records
    the [start, end] of every stream."""

    is_engine = True
    max_inflight = 16

    def __init__(self, delay=0.05):
        super().__init__(delay)
        self.streams = []

    def chat_messages(self, system, user):
        return [{"role": "user", "content": user}]

    async def stream(self, messages, max_new_tokens, usage, stop=()):
        t = time.perf_counter()
        await asyncio.sleep(self.delay)
        yield messages[-1]["content"].split("Question: ")[-1]
        self.streams.append((t, time.perf_counter()))

    async def aclose(self):
        pass


class TimedRetriever(FakeRetriever):
    def __init__(self, delay=0.01):
        super().__init__()
        self.delay, self.times, self.ends = delay, [], []

    async def retrieve(self, vecs, texts, specs):
        self.times.append(time.perf_counter())
        await asyncio.sleep(self.delay)
        self.ends.append(time.perf_counter())
        return await super().retrieve(vecs, texts, specs)


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_backend_overlap_off_prepares_only_with_the_engine_stage_empty(overlap):
    """Engine backend: with overlap the prep of newer arrivals runs while older requests stream
    from the engine; with ``overlap=False`` no prep starts while a request is in the engine."""

    async def run():
        gen, ret = FakeEngineGenerator(0.08), TimedRetriever()
        eng = _engine(gen, ret, overlap=overlap, max_batch=8)
        eng.start()

        async def later(i):
            await asyncio.sleep(0.02 * i)  # staggered arrivals
            return await eng.submit(_job(f"q{i}"))

        jobs = await asyncio.gather(*[later(i) for i in range(6)])
        await eng.stop()
        return jobs, gen, ret

    jobs, gen, ret = asyncio.run(run())
    assert [j.answer for j in jobs] == [f"q{i}" for i in range(6)]
    during = sum(1 for t in ret.times for s, e in gen.streams if s < t < e)
    if overlap:
        assert during > 0 and len(ret.times) >= 3
    else:
        assert during == 0


def test_engine_backend_empty_engine_gets_a_small_first_slice():
    """16 requests at once with the engine empty: a quarter is prepared first and is in the
    engine while the rest are prepared; slices go on while the engine holds fewer requests than
    wait (4 of 16, 3 of 12, 2 of 9, then all 7 with the first two slices in the engine). Without
    the slices all 16 were one prep batch. Two prep batches run at once (``PREP_INFLIGHT``).

    Both orderings are checked with gates, not clocks (a loaded CI machine's late timers once
    started the engine 145 ms after the last retrieval returned): the first prep's retrieval
    returns only once the second prep's has begun, and the last prep's retrieval only once the
    engine has started a stream; a scheduler without either overlap makes the gate time out."""

    class GatedRetriever(TimedRetriever):
        def __init__(self, gen):
            super().__init__(0.08)
            self.gen, self.second, self.waited, self.sizes = gen, asyncio.Event(), {}, []

        async def retrieve(self, vecs, texts, specs):
            call = len(self.times)
            self.times.append(time.perf_counter())
            self.sizes.append(len(texts))  # in call order (``batches`` is in completion order)
            if call == 1:
                self.second.set()
            gate = {0: self.second, 3: self.gen.started}.get(call)
            if gate is None:
                await asyncio.sleep(self.delay)
            else:
                try:
                    await asyncio.wait_for(gate.wait(), 10)
                    self.waited[call] = True
                except asyncio.TimeoutError:
                    self.waited[call] = False
            self.ends.append(time.perf_counter())
            return await FakeRetriever.retrieve(self, vecs, texts, specs)

    class StartedGenerator(FakeEngineGenerator):
        def __init__(self, delay):
            super().__init__(delay)
            self.started = asyncio.Event()

        async def stream(self, messages, max_new_tokens, usage, stop=()):
            self.started.set()
            async for piece in super().stream(messages, max_new_tokens, usage, stop):
                yield piece

    async def run():
        gen = StartedGenerator(0.4)  # the first slice is still in the engine when the last prep takes
        ret = GatedRetriever(gen)
        eng = _engine(gen, ret, max_batch=16)
        eng.start()
        jobs = await asyncio.gather(*[eng.submit(_job(f"q{i}")) for i in range(16)])
        await eng.stop()
        return jobs, gen, ret

    jobs, gen, ret = asyncio.run(run())
    assert [j.answer for j in jobs] == [f"q{i}" for i in range(16)]
    assert ret.sizes == [4, 3, 2, 7]
    assert ret.waited[0], "the second prep did not begin while the first one's retrieval was pending"
    assert ret.waited[3], "the engine started no stream while the last prep's retrieval was pending"


def test_engine_backend_admission_counts_requests_in_prep():
    """The estimated delay counts the requests the prep loop holds (they will need engine slots
    too): with 2 slots, 0.1 s per request and 8 requests in prep or waiting for it (0.35 s ahead)
    a new request is refused by
    ``max_queue_delay_ms``; once they drained it is admitted."""

    class SlowPrep(TimedRetriever):
        async def retrieve(self, vecs, texts, specs):
            await asyncio.sleep(0.2)
            return await super().retrieve(vecs, texts, specs)

    async def run():
        gen = FakeEngineGenerator(0.1)
        gen.max_inflight = 2
        eng = QueryEngine(
            generator=gen, retriever=SlowPrep(), memory=FakeMemory(), lock=RWLock(),
            batch=BatchConfig(max_batch=8, max_wait_ms=2.0, queue_capacity=64, max_queue_delay_ms=320.0),
            gen_cfg=GenerateConfig(), embedder=FakeEmbedder(), metrics=Metrics())
        eng.dispatch.request_s_ewma = 0.1
        eng.start()
        first = [asyncio.create_task(eng.submit(_job(f"q{i}"))) for i in range(8)]
        await asyncio.sleep(0.05)  # the prep loop holds the first slice of them now
        assert eng.estimated_delay_s() > eng.dispatch.estimated_delay_s(len(eng._waiting)) > 0.05
        with pytest.raises(Overloaded):
            await eng.submit(_job("late"))
        await asyncio.gather(*first)
        ok = await eng.submit(_job("after"))
        await eng.stop()
        return ok

    assert asyncio.run(run()).answer == "after"


class SlowPromptEngine(FakeEngineGenerator):
    """An engine backend whose prompt building takes 30 ms of blocking work per request (the
    frontend's CPU); records when each prompt was built and which thread streamed."""

    def __init__(self, delay=0.05):
        super().__init__(delay)
        self.prompts, self.threads = {}, set()

    def chat_prompt(self, system, user):
        time.sleep(0.03)
        self.prompts[user.split("Question: ")[-1]] = time.perf_counter()
        return super().chat_prompt(system, user)

    async def stream(self, messages, max_new_tokens, usage, stop=()):
        self.threads.add(threading.get_ident())
        async for d in super().stream(messages, max_new_tokens, usage):
            yield d


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_request_leaves_as_soon_as_its_prompt_is_built(overlap):
    """With overlap a request streams from the engine before the next prompt of its own prep
    batch is built (the context step hands each one over, and the stream runs on the engine
    thread while the frontend's loop is busy); with overlap off the batch goes only once all of
    its prompts exist. Either way the streams run on the engine thread, not the frontend's."""

    async def run():
        gen = SlowPromptEngine(0.05)
        eng = _engine(gen, TimedRetriever(), overlap=overlap, max_batch=8)
        eng.start()
        jobs = await asyncio.gather(*[eng.submit(_job(f"q{i}")) for i in range(8)])
        await eng.stop()
        return jobs, gen

    jobs, gen = asyncio.run(run())
    assert [j.answer for j in jobs] == [f"q{i}" for i in range(8)]
    assert threading.get_ident() not in gen.threads and len(gen.threads) == 1
    first_stream = min(s for s, _ in gen.streams)
    same_batch = [gen.prompts[j.question] for j in jobs if j.batch_id == jobs[0].batch_id]
    assert len(same_batch) >= 2
    if overlap:
        assert first_stream < max(same_batch)
    else:
        assert first_stream > max(same_batch)


def test_engine_streams_on_the_frontend_loop_without_the_io_thread():
    """``io_thread=False`` (``--no-generator-io-thread``): the baseline streams on the caller's loop."""

    async def run():
        gen = SlowPromptEngine(0.01)
        eng = QueryEngine(generator=gen, retriever=TimedRetriever(), memory=FakeMemory(), lock=RWLock(),
                          batch=BatchConfig(max_batch=4, max_wait_ms=2.0), gen_cfg=GenerateConfig(io_thread=False),
                          embedder=FakeEmbedder(), metrics=Metrics())
        eng.start()
        jobs = await asyncio.gather(*[eng.submit(_job(f"q{i}")) for i in range(3)])
        await eng.stop()
        return jobs, gen

    jobs, gen = asyncio.run(run())
    assert [j.answer for j in jobs] == ["q0", "q1", "q2"] and gen.threads == {threading.get_ident()}
