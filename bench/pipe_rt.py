"""Frontend-to-shard round trip over the pipe transport, alone: a 2-shard :class:`ShardPool`
of empty shard processes, ``--rounds`` broadcasts of a null op (STATS) at c=1, timed at the pool
(nearest-rank percentiles), and the frontend process's CPU time per broadcast. No models, no
gRPC: the cost of the transport and the event-loop hand-offs only.

    python -m bench.pipe_rt --rounds 2000 --json

To compare source trees, run it with each tree's ``server`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from . import _internals
from ._common import emit_json, log, machine_info, percentile


async def _run(rounds: int) -> dict:
    S = _internals.shard_plane()
    loop = asyncio.get_running_loop()
    pool = S.ShardPool(2, 384, None)
    await loop.run_in_executor(None, lambda: pool.start(loop))
    req = S.protocol.StatsRequest()
    try:
        for _ in range(50):
            await pool.broadcast(S.protocol.Op.STATS, req)
        lat, c0 = [], os.times()
        for _ in range(rounds):
            t = time.perf_counter()
            await pool.broadcast(S.protocol.Op.STATS, req)
            lat.append((time.perf_counter() - t) * 1e6)
        c1 = os.times()
    finally:
        await pool.shutdown(snapshot=False)
    return {"server": os.path.dirname(S.records.__file__),
            "p50_us": round(percentile(lat, 50)), "p90_us": round(percentile(lat, 90)),
            "frontend_cpu_us": round((c1.user + c1.system - c0.user - c0.system) / rounds * 1e6),
            "load": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = {"machine": machine_info(), **asyncio.run(_run(a.rounds))}
    log(str(res))
    if a.json:
        emit_json(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
