"""Shards on threads (``--shard-workers thread``, shards/threaded.py): the two shards of a query
work at the same time, results equal those of shards behind a pickling boundary (what a shard
process sees), errors and a killed shard fail calls as a shard process does, and acknowledged
writes are in the snapshot and log a restart loads. The whole server in this mode: the
parametrised integration tests (test_documents_and_edges.py, test_durability.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from test_retrieval import DIM, VOCAB, _build, _corpus

from oprag_server.config import BM25Config, RetrievalConfig
from oprag_server.index.analyzer import Analyzer
from oprag_server.operators.retrieve import Retriever, RetrieveSpec
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.pool import ShardPool
from oprag_server.shards.protocol import Op, StatsRequest
from oprag_server.shards.threaded import ThreadTransport
from oprag_server.shards.transport import ShardError


def _thread_pool(states) -> ShardPool:
    pool = ShardPool(len(states), DIM, None, transport=ThreadTransport)
    pool.clients = [ThreadTransport.of(s) for s in states]
    return pool


def _retriever(pool, stats) -> Retriever:
    return Retriever(pool, stats, Analyzer(), BM25Config(), RetrievalConfig())


def _queries(rng, n=6):
    out = []
    for _ in range(n):
        qv = rng.normal(size=DIM)
        out.append((" ".join(rng.choice(VOCAB, size=3).tolist()), (qv / np.linalg.norm(qv)).astype(np.float32)))
    return out


def test_two_shards_search_at_the_same_time():
    """Each shard's search waits at a two-party barrier before searching: only shards that run
    at the same time get past it (serialised, the first waits for a second that never comes and
    the barrier breaks after 10 s; the shard then answers an error and is missing)."""
    rng = np.random.default_rng(0)
    states, stats = _build(_corpus(rng, 40))
    pool = _thread_pool(states)
    barrier, seen = threading.Barrier(2, timeout=10), []
    for c in pool.clients:
        real = c._table[Op.SEARCH]

        def search(req, real=real):
            barrier.wait()
            seen.append(threading.get_ident())
            return real(req)
        c._table[Op.SEARCH] = search
    text, qv = _queries(rng, 1)[0]

    async def go():
        return await _retriever(pool, stats).retrieve(qv[None, :], [text], [RetrieveSpec(mode="hybrid", top_k=5)])

    hits, _, infos = asyncio.run(go())
    assert len(seen) == 2 and seen[0] != seen[1] and threading.get_ident() not in seen
    assert hits[0] and not infos[0].missing_shards


@pytest.mark.parametrize("mode", ["hybrid", "full_hybrid", "dense", "lexical"])
def test_results_equal_shards_behind_a_pickling_boundary(mode):
    rng = np.random.default_rng(1)
    states, stats = _build(_corpus(rng, 60))
    threaded, copied = _retriever(_thread_pool(states), stats), _retriever(in_process_pool(states, copy=True), stats)
    spec = [RetrieveSpec(mode=mode, top_k=10)]

    async def go():  # one loop, as in the server
        return [((await threaded.retrieve(qv[None, :], [text], spec))[0][0],
                 (await copied.retrieve(qv[None, :], [text], spec))[0][0]) for text, qv in _queries(rng)]

    for a, b in asyncio.run(go()):
        assert a == b and a  # every field of every hit (chunk id, score, both scores and ranks, text)


def test_errors_answer_the_call_and_a_killed_shard_fails_calls():
    states, _ = _build(_corpus(np.random.default_rng(2), 10), n_shards=1)
    t = ThreadTransport.of(states[0])

    async def go():
        with pytest.raises(ShardError, match="takes a SearchRequest"):
            await t.call(Op.SEARCH, "not a request")
        st = await t.call(Op.STATS, StatsRequest())  # still serving
        t.kill()
        with pytest.raises(ShardError, match="not running"):
            await t.call(Op.STATS, StatsRequest())
        return st

    assert asyncio.run(go()).chunks == len(states[0].store.chunks)
    assert not t.is_alive()
