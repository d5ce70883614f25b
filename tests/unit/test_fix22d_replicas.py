"""trial22 (branch fix22d): a first start with ``--replicas 2`` on a directory that ran with one
replica logged ``ERROR shard 0 replica 1 is down: behind its siblings at start`` for a planned,
healthy catch-up; now a WARNING saying that it catches up. ReplicaSet over in-process shards with
real data directories (tests/unit/test_replicas.py's)."""

from __future__ import annotations

import asyncio
import logging

from oprag_server.shards.inprocess import InProcessTransport
from oprag_server.shards.pool import ShardPool

from test_replicas import DIM, _pool, _write


def test_a_replica_behind_at_start_is_a_warning_not_an_error(tmp_path, caplog):
    async def main():
        pool, cp = await _pool(tmp_path, replicas=1)
        await _write(pool, cp, "t1", ["a", "b"])
        await pool.shutdown(snapshot=True)
        pool2 = ShardPool(1, DIM, tmp_path, transport=InProcessTransport, replicas=2)
        with caplog.at_level(logging.INFO, logger="oprag_server.shards.replicas"):
            st = pool2.start(asyncio.get_running_loop(), committed=cp.committed_txns())
        assert st[0].documents == 2 and pool2.clients[0].serving == [True, False]
        await pool2.shutdown(snapshot=False)

    asyncio.run(main())
    mine = [r for r in caplog.records if r.name == "oprag_server.shards.replicas"]
    assert not [r for r in mine if r.levelno >= logging.ERROR], [r.getMessage() for r in mine]
    assert any(r.levelno == logging.WARNING and "shard 0 replica 1 is behind its siblings at start" in r.getMessage()
               and "catches up from them" in r.getMessage() for r in mine), [r.getMessage() for r in mine]


def test_the_supervisor_reviving_a_replica_of_a_serving_shard_warns(caplog):
    """Its "a replica is down; reviving it" was an ERROR also for the catch-up above; the shard serves
    meanwhile (a replica's unplanned death is the ERROR ``replica r is down: why``)."""
    from test_supervision import Health, Pool

    from oprag_server.service.metrics import Metrics
    from oprag_server.supervision import ShardSupervisor

    pool = Pool(2)
    pool.degraded_shards = lambda: [0] if not pool.restarted else []

    async def restart(i):
        pool.restart(i, None, set())

    with caplog.at_level(logging.INFO, logger="oprag"):
        assert asyncio.run(ShardSupervisor(pool, restart, Health(), ("",), Metrics()).check()) == [0]
    got = [(r.levelno, r.getMessage()) for r in caplog.records if "reviving" in r.getMessage()]
    assert got == [(logging.WARNING, "shard 0: a replica is down; reviving it")], got
