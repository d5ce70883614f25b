"""The shard protocol types: every request and reply survives pickle (the pipe), the op table
serves every op, and an unknown op or a wrong request type is a clear error."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import numpy as np
import pytest

from oprag_server.shards import protocol as P
from oprag_server.shards.inprocess import InProcessTransport, in_process_pool
from oprag_server.shards.pool import ShardError, ShardPool
from oprag_server.shards.state import ShardState, dispatch, op_table

DIM = 4


def _cands(m: int = 3) -> P.Candidates:
    return P.Candidates(np.arange(m, dtype=np.int64), [f"d#{i}" for i in range(m)], np.linspace(0, 1, m),
                        np.linspace(1, 2, m))


def _batch() -> P.QueryBatch:
    return P.QueryBatch(np.ones((2, DIM), np.float32), [["a"], ["b", "c"]], [np.ones(1), np.ones(2)], 3.5, 1.5, 0.75,
                        [[("lang", ("en",))], None])


SAMPLES = {
    P.Op.SEARCH: (P.SearchRequest(_batch(), "hybrid", 8),
                  P.SearchReply([_cands(), _cands(0)], [3, 0], [0.1, np.inf])),
    P.Op.EXACT_MINMAX: (P.ExactMinmaxRequest(_batch(), [10, 3], 20, [(0.5, 0.5), (0.0, 1.0)]),
                        P.ExactMinmaxReply([3, 0], [0.1, 0.0], [0.9, 0.0], [0.0, 0.0], [2.5, 0.0], [_cands(), _cands(0)],
                                           [_cands(), _cands(0)], [_cands(1), _cands(0)])),
    P.Op.EXACT_LISTS: (P.ExactListsRequest(_batch(), 20), P.ExactListsReply([3], [_cands()], [_cands()])),
    P.Op.FETCH: (P.FetchRequest([1, 2]),
                 P.FetchReply([True, False], ["d", ""], ["t", ""], ["x", ""], ["{}", ""])),
    P.Op.FIELDS: (P.FieldsRequest(3), P.FieldsReply([P.FetchReply([True], ["d"], ["t"], ["x"], ["{}"]), None])),
    P.Op.REUSE: (P.ReuseRequest(["d"]), P.ReuseReply({"d": {"h": np.ones(DIM, np.float32)}})),
    P.Op.STAGE: (P.StageRequest("t1", b"\x00ipc"), P.StageReply(5)),
    P.Op.PREPARE: (P.PrepareRequest("t1", 3, "delete", ["d"]), P.PrepareReply()),
    P.Op.APPLY: (P.ApplyRequest("t1"), P.ApplyReply(["d"], 2, 1, 1, 0, (1, 5, {"a": 1}))),
    P.Op.ABORT: (P.AbortRequest("t1"), P.AbortReply(4)),
    P.Op.PROMOTE: (P.PromoteRequest("s", "q", "a", ["d#0"], ["T"], np.ones(DIM, np.float32), 5, 10, 60.0),
                   P.PromoteReply(1)),
    P.Op.MEMORY_LOOKUP: (P.MemoryLookupRequest(["s", "u"], 2, 0.0),
                         P.MemoryLookupReply([[P.MemoryTurn(0, "q", "a", ["d#0"], ["T"])], []])),
    P.Op.MEMORY_CLEAR: (P.MemoryClearRequest("s"), P.MemoryClearReply(1)),
    P.Op.STATS: (P.StatsRequest(True), P.StatsReply(0, 1, 2, 3, 4, (1, 5, {"a": 1}), 2)),
    P.Op.SNAPSHOT: (P.SnapshotRequest(), P.SnapshotReply(True, 9)),
    P.Op.SHUTDOWN: (P.ShutdownRequest(False), P.ShutdownReply(P.SnapshotReply(False))),
}


def _equal(a, b) -> bool:
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_samples_cover_every_op_with_its_declared_types():
    assert set(SAMPLES) == set(P.Op) == set(P.TYPES)
    for op, (req, rep) in SAMPLES.items():
        assert (type(req), type(rep)) == P.TYPES[op], op


@pytest.mark.parametrize("op", list(P.Op), ids=lambda o: o.value)
def test_request_and_reply_round_trip_through_pickle(op):
    for obj in SAMPLES[op]:
        assert not hasattr(obj, "__dict__"), "protocol types are slots dataclasses"
        back = pickle.loads(pickle.dumps((7, op, obj), protocol=pickle.HIGHEST_PROTOCOL))
        assert back[0] == 7 and back[1] is op and _equal(back[2], obj)


def test_op_table_serves_every_op():
    assert set(op_table(ShardState(0, DIM, None))) == set(P.Op)


def test_unknown_op_and_wrong_request_type_are_clear_errors():
    table = op_table(ShardState(0, DIM, None))
    with pytest.raises(P.UnknownOp, match=r"unknown shard op 'upsert'.*serves search"):
        dispatch(table, "upsert", {})
    with pytest.raises(P.UnknownOp, match="stats takes a StatsRequest, got dict"):
        dispatch(table, P.Op.STATS, {"lexical": True})
    assert dispatch(table, P.Op.STATS, P.StatsRequest()).chunks == 0


def test_in_process_pool_answers_errors_as_shard_errors_and_scatter_groups_by_owner():
    async def go():
        pool = in_process_pool([ShardState(i, DIM, None) for i in range(3)], copy=True)
        with pytest.raises(ShardError, match="shard 1: UnknownOp"):
            await pool.call(1, "ping", None)
        sids = [f"s{i}" for i in range(12)]
        got, missing = await pool.scatter(P.Op.MEMORY_LOOKUP, sids, pool.owner,
                                          lambda mine: P.MemoryLookupRequest(mine, 1))
        assert missing == [] and sorted(i for idx, _ in got.values() for i in idx) == list(range(12))
        for s, (idx, rep) in got.items():
            assert all(pool.owner(sids[i]) == s for i in idx) and len(rep.turns) == len(idx)
        pool.clients[2].kill()
        assert pool.down_shards() == [2]
        got, missing = await pool.scatter(P.Op.MEMORY_LOOKUP, sids, pool.owner,
                                          lambda mine: P.MemoryLookupRequest(mine, 1))
        assert missing == [2] and 2 not in got
        with pytest.raises(ShardError, match="not running"):
            await pool.scatter(P.Op.REUSE, sids, pool.owner, P.ReuseRequest, partial=False)

    asyncio.run(go())


def test_in_process_transport_starts_like_a_shard_process(tmp_path):
    async def go():
        pool = ShardPool(2, DIM, tmp_path, transport=InProcessTransport)
        ready = pool.start(asyncio.get_running_loop())
        assert [r.shard for r in ready] == [0, 1] and all(r.lexical == (0, 0, {}) for r in ready)
        stats = await pool.broadcast(P.Op.STATS, P.StatsRequest())
        assert [s.applied_seq for s in stats] == [0, 0]
        await pool.shutdown(snapshot=True)
        assert pool.down_shards() == [0, 1]
        assert all((tmp_path / f"shard-{i}" / "CURRENT").exists() for i in range(2))

    asyncio.run(go())
