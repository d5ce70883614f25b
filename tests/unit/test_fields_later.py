"""A search's carried fields sent right behind its reply (``SearchRequest.fields_later`` and the
FIELDS op: shards/carried.py ``Later``, shards/gather.py ``fields_later``): the fields equal those
the reply would have carried; a token that is not the last search's, or a write in between, gets
None (the frontend then fetches); the pool defers only for process shards beside an inline one,
and a retrieve through that path answers as shards behind a pickling boundary, with no FETCH."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from test_inline_shards import RetrieveSpecs, _where
from test_retrieval import DIM, _build, _corpus
from test_thread_shards import _queries, _retriever

from oprag_server.shards.gather import fields_later
from oprag_server.shards.inline import InlineTransport, first_inline
from oprag_server.shards.inprocess import in_process_pool
from oprag_server.shards.pool import ShardPool
from oprag_server.shards.protocol import FieldsRequest, Op, QueryBatch, SearchRequest
from oprag_server.shards.threaded import ThreadTransport


def _request(qv: np.ndarray, mode: str = "hybrid", b: int = 2) -> SearchRequest:
    q = np.repeat(qv[None, :], b, axis=0)
    batch = QueryBatch(q, [["alpha", "beta"]] * b, [np.array([1.2, 0.7])] * b, 5.0, 1.5, 0.75, None)
    return SearchRequest(batch, mode, 8, 0, 0, 3, 4 if mode == "hybrid" else 0,
                         [(0.5, 0.5), None] if mode == "hybrid" else None)


def _cols(fields) -> list:
    return [(list(f.slots), list(f.found), list(f.doc_ids), list(f.titles), list(f.texts), list(f.metadata))
            for f in fields]


@pytest.mark.parametrize("mode", ["hybrid", "dense", "lexical"])
def test_fields_later_equal_the_fields_the_reply_would_carry(mode):
    states, _ = _build(_corpus(np.random.default_rng(21), 40), n_shards=1)
    s = states[0].search
    qv = np.ones(DIM, np.float32) / np.sqrt(DIM)
    req = _request(qv, mode)
    whole = s.search(req)
    assert whole.fields is not None and any(f.slots for f in whole.fields)
    later = s.search(dataclasses.replace(req, fields_later=7))
    assert later.fields is None
    assert [c.chunk_ids for c in later.candidates] == [c.chunk_ids for c in whole.candidates]
    assert s.fields_later(FieldsRequest(6)).fields is None  # another search's token
    s.search(dataclasses.replace(req, fields_later=8))
    got = s.fields_later(FieldsRequest(8)).fields
    assert _cols(got) == _cols(whole.fields)
    assert s.fields_later(FieldsRequest(8)).fields is None  # given once


def test_a_write_between_the_search_and_its_fields_gets_none():
    states, _ = _build(_corpus(np.random.default_rng(22), 30), n_shards=1)
    st = states[0]
    qv = np.ones(DIM, np.float32) / np.sqrt(DIM)
    st.search.search(dataclasses.replace(_request(qv), fields_later=3))
    st.store.version += 1  # (what any write does)
    assert st.search.fields_later(FieldsRequest(3)).fields is None


class _Client:
    def __init__(self, defers: bool = False, inline: bool = False) -> None:
        self.defers_fields, self.inline = defers, inline


def test_the_pool_defers_only_for_process_shards_beside_an_inline_one():
    qv = np.ones(DIM, np.float32)
    req = _request(qv)
    # inline shard 0, two process shards: both get one copy with a token, each its FIELDS right behind
    per, clients = [req] * 3, [_Client(inline=True), _Client(True), _Client(True)]
    out = fields_later(Op.SEARCH, per, clients, [])
    assert out[0] is None and per[0] is req
    assert per[1] is per[2] and per[1].fields_later > 0 and per[1].fetch_k == req.fetch_k
    assert out[1] == out[2] == FieldsRequest(per[1].fields_later)
    assert dataclasses.replace(per[1], fields_later=0) == req
    again = [req] * 3
    fields_later(Op.SEARCH, again, clients, [])
    assert again[1].fields_later != per[1].fields_later  # a new token per request
    for per, clients, op, into, r in (
            ([req] * 2, [_Client(True), _Client(True)], Op.SEARCH, [], req),  # no inline shard
            ([req] * 2, [_Client(inline=True), _Client(True)], Op.SEARCH, None, req),  # not asked for
            ([req] * 2, [_Client(inline=True), _Client(True)], Op.EXACT_LISTS, [], req),
            ([dataclasses.replace(req, fetch_k=0)] * 2, [_Client(inline=True), _Client(True)], Op.SEARCH, [], None)):
        r = per[1]
        assert fields_later(op, per, clients, into) == [None, None] and per[1] is r


def _inline_beside_process(rng):
    """``(states, stats, pool)``: two shards of 60 chunks, shard 0 inline, shard 1 on its thread posing
    as a process shard (``defers_fields``: its requests are served in order, as a process's are)."""
    states, stats = _build(_corpus(rng, 60))
    pool = ShardPool(len(states), DIM, None, transport=first_inline)
    pool.clients = [InlineTransport.of(states[0]), ThreadTransport.of(states[1])]
    pool.clients[1].defers_fields = True
    return states, stats, pool


@pytest.mark.parametrize("mode", ["hybrid", "dense", "lexical"])
def test_a_retrieve_with_fields_behind_the_reply_answers_as_before_without_a_fetch(mode):
    """Shard 0 inline, shard 1 on its thread posing as a process shard (``defers_fields``: its
    requests are served in order, as a process's are): its fields come in the FIELDS reply, no
    FETCH follows, and every field of every hit equals the hits of shards behind a pickling
    boundary (which carry the fields in the reply)."""
    rng = np.random.default_rng(23)
    states, stats, pool = _inline_beside_process(rng)
    log: list = []
    for op in (Op.SEARCH, Op.FIELDS, Op.FETCH):
        _where(pool.clients[1], op, log)
    ours, copied = _retriever(pool, stats), _retriever(in_process_pool(states, copy=True), stats)
    spec = [RetrieveSpecs(mode)]

    async def go():
        out = []
        for text, qv in _queries(rng, 8):
            log.clear()
            a = (await ours.retrieve(qv[None, :], [text], spec))[0][0]
            out.append((a, (await copied.retrieve(qv[None, :], [text], spec))[0][0], [o for o, _ in log]))
        return out

    got = asyncio.run(go())
    assert any(any(h.shard == 1 for h in a) for a, _, _ in got)
    for a, b, ops in got:
        assert a == b and a
        assert ops[:2] == [Op.SEARCH, Op.FIELDS] and Op.FETCH not in ops, ops

