"""The index gauges after writes (engine/gauges.py): refreshes coalesce -- a burst of writes (a
session query records a turn each) costs a few STATS broadcasts, not one each -- and the gauges
end on the state after the last write. ``--snapshot-interval-s`` reaches the config and is checked."""

from __future__ import annotations

import asyncio
import types

from oprag_server.cli import build_parser, config_from_args, main
from oprag_server.engine.gauges import IndexGauges
from oprag_server.service.metrics import Metrics


class _Pool:
    """Answers STATS with the current ``records`` after a short delay (a shard round trip)."""

    def __init__(self) -> None:
        self.records, self.calls = 0, 0

    async def gather_partial(self, op, req):
        self.calls += 1
        seen = self.records
        await asyncio.sleep(0.01)
        return {0: types.SimpleNamespace(shard=0, chunks=1, documents=1, memory_records=seen, nbytes={"chunks": 8})}, []


def test_a_burst_of_writes_costs_a_few_broadcasts_and_ends_current(monkeypatch):
    monkeypatch.setattr(IndexGauges, "min_gap_s", 0.05)
    monkeypatch.setattr(IndexGauges, "settle_s", 0.1)  # (the refreshes that follow background work: a few more)
    monkeypatch.setattr(IndexGauges, "follow_s", 0.05)
    pool, metrics = _Pool(), Metrics()
    g = IndexGauges(pool, metrics)

    async def go():
        for _ in range(200):  # 200 memory writes, 1 ms apart
            pool.records += 1
            g.stale()
            await asyncio.sleep(0.001)
        await g._task  # noqa: SLF001

    asyncio.run(go())
    assert metrics.memory_records._value.get() == 200  # noqa: SLF001 - the last write is in
    assert 2 <= pool.calls <= 20, pool.calls  # ~0.25 s of writes / (50 ms gap + 10 ms STATS), not 200


def test_snapshot_interval_flag(capsys, tmp_path):
    assert config_from_args(build_parser().parse_args(["--snapshot-interval-s", "0.5"])).snapshot_interval_s == 0.5
    assert config_from_args(build_parser().parse_args([])).snapshot_interval_s == 30.0
    assert main(["--snapshot-interval-s", "0", "--data-dir", str(tmp_path / "d")]) == 2
    assert "--snapshot-interval-s must be > 0 seconds, got 0.0" in capsys.readouterr().err
