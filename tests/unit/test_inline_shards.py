"""``--shard-workers inline`` (shards/inline.py): shard 0's one-query reads run on the event loop's
thread when the shard is idle, after the other shards' requests are sent; otherwise (a request
queued or running on the shard's thread, a batch of several queries) they are queued in order.
Results equal shards behind a pickling boundary. The whole server in this mode:
tests/integration/test_inline_shards_server.py."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from test_retrieval import DIM, _build, _corpus
from test_thread_shards import _queries, _retriever

from oprag_server.config import ServerConfig
from oprag_server.shards.inline import INLINE_OPS, InlineTransport, first_inline
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.pool import ShardPool, placement
from oprag_server.shards.protocol import Op, QueryBatch, SearchRequest, StatsRequest
from oprag_server.shards.threaded import ZERO_COPY, ThreadTransport
from oprag_server.shards.transport import PipeTransport, ShardError


def _pool(states) -> ShardPool:
    """Shard 0 inline, the others on threads (a process needs a spawned interpreter: the integration test)."""
    pool = ShardPool(len(states), DIM, None, transport=first_inline)
    pool.clients = [(InlineTransport if i == 0 else ThreadTransport).of(s) for i, s in enumerate(states)]
    return pool


def _where(t: ThreadTransport, op: Op, log: list, shard: bool = False) -> None:
    """Record ``(op, thread ident)`` (with ``shard``: ``(op, shard, thread ident)``) of each ``op`` the shard serves."""
    real = t._table[op]

    def wrapped(req, real=real):
        log.append((op, t.shard_id, threading.get_ident()) if shard else (op, threading.get_ident()))
        return real(req)
    t._table[op] = wrapped


@pytest.mark.parametrize("mode", ["hybrid", "full_hybrid", "dense", "lexical"])
def test_results_equal_shards_behind_a_pickling_boundary_and_shard_0_runs_on_the_loop(mode):
    rng = np.random.default_rng(11)
    states, stats = _build(_corpus(rng, 60))
    pool = _pool(states)
    log: list = []
    for c in pool.clients:
        for op in ZERO_COPY:  # (full_hybrid's exact rounds, fetches)
            _where(c, op, log, shard=True)
    inline, copied = _retriever(pool, stats), _retriever(in_process_pool(states, copy=True), stats)
    spec = [RetrieveSpecs(mode)]

    async def go():
        out = []
        for text, qv in _queries(rng):
            log.clear()
            a = (await inline.retrieve(qv[None, :], [text], spec))[0][0]
            out.append((a, (await copied.retrieve(qv[None, :], [text], spec))[0][0], list(log)))
        return out, threading.get_ident()

    got, loop_thread = asyncio.run(go())
    for a, b, seen in got:
        assert a == b and a  # every field of every hit
        # shard 0's searches and fetches ran on the loop (the pool sent it last), exact mode's rounds and
        # every op of shard 1 on their shard's thread
        mine = [(o, i) for o, s, i in seen if s == 0]
        assert all((i == loop_thread) == (o in INLINE_OPS) for o, i in mine), seen
        assert all(i != loop_thread for _, s, i in seen if s == 1) and any(s == 1 for _, s, _ in seen), seen
        assert mode == "full_hybrid" or any(o in INLINE_OPS for o, _ in mine), seen


def RetrieveSpecs(mode):  # noqa: N802 - a spec of the mode, top 10
    from oprag_server.operators.retrieve import RetrieveSpec

    return RetrieveSpec(mode=mode, top_k=10)


def _search(state, qv, n=2):
    q = np.repeat(qv[None, :], n, axis=0)
    batch = QueryBatch(q, [["alpha"]] * n, [np.ones(1)] * n, 5.0, 1.5, 0.75, None)
    return SearchRequest(batch, "dense", 5, 0, 0, 0, 0, None)


def test_a_read_waits_for_a_request_running_or_queued_and_a_batch_goes_to_the_thread():
    """A STATS running on the shard's thread (blocked on an event) holds the state: a search sent
    meanwhile is queued behind it (never run beside it on the loop), as is one sent while a
    request waits in the queue; once idle, a one-query search runs inline and a two-query batch on
    the shard's thread."""
    states, _ = _build(_corpus(np.random.default_rng(12), 20), n_shards=1)
    t = InlineTransport.of(states[0])
    log, started, go_on = [], threading.Event(), threading.Event()
    real_stats = t._table[Op.STATS]

    def slow_stats(req):
        log.append(("stats", threading.get_ident()))
        started.set()
        assert go_on.wait(10)
        return real_stats(req)
    t._table[Op.STATS] = slow_stats
    _where(t, Op.SEARCH, log)
    qv = np.ones(DIM, np.float32) / np.sqrt(DIM)

    async def go():
        me = threading.get_ident()
        st = t.call(Op.STATS, StatsRequest())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        assert t._queued == 0 and t._busy.locked()  # running, no longer counted as queued
        s1 = t.call(Op.SEARCH, _search(states[0], qv, 1))  # must not overtake nor run beside it
        assert not s1.done()
        go_on.set()
        await st
        await s1
        log.append(("idle", None))
        await asyncio.sleep(0.05)  # (the idle step after the requests)
        s2 = t.call(Op.SEARCH, _search(states[0], qv, 1))
        assert s2.done()  # inline: answered within the call
        s3 = await t.call(Op.SEARCH, _search(states[0], qv, 2))
        return me, (await s1), (await s2), s3

    me, r1, r2, r3 = asyncio.run(go())
    order = [(w, i == me) for w, i in log if w != "idle"]
    cut = log.index(("idle", None))
    assert [w for w, _ in order[:2]] == ["stats", Op.SEARCH] and not any(on_loop for _, on_loop in order[:2])
    after = [(w, i == me) for w, i in log[cut + 1:]]
    assert after == [(Op.SEARCH, True), (Op.SEARCH, False)]  # one query inline, a batch of two on the thread
    assert r1.candidates[0].chunk_ids == r2.candidates[0].chunk_ids == r3.candidates[1].chunk_ids


def test_errors_answer_the_call_inline_and_a_killed_shard_fails_calls():
    states, _ = _build(_corpus(np.random.default_rng(13), 10), n_shards=1)
    t = InlineTransport.of(states[0])

    async def go():
        with pytest.raises(ShardError, match="shard 0: .*takes a SearchRequest"):
            await t.call(Op.SEARCH, "not a request")
        st = await t.call(Op.STATS, StatsRequest())
        t.kill()
        with pytest.raises(ShardError, match="not running"):
            await t.call(Op.SEARCH, _search(states[0], np.ones(DIM, np.float32), 1))
        return st

    assert asyncio.run(go()).chunks == len(states[0].store.chunks)


def test_placement_and_config():
    assert placement(ServerConfig(shard_workers="inline"))["transport"] is first_inline
    assert type(first_inline(0, DIM, None)) is InlineTransport and type(first_inline(1, DIM, None)) is PipeTransport
    assert placement(ServerConfig(shard_workers="thread"))["transport"] is ThreadTransport
    assert placement(ServerConfig()) == {}
    with pytest.raises(ValueError, match="--shard-workers inline serves shard 0 in the server process"):
        ServerConfig(shard_workers="inline", replicas=2)
    with pytest.raises(ValueError, match="'process', 'thread' or 'inline'"):
        ServerConfig(shard_workers="fiber")
