"""A shard process ends at once when its frontend dies (issue 17 trial: after ``kill -9`` of the
server process its shard processes stayed 2-4 s). The shard's loop saw the pipe close at once;
the time went to tearing the interpreter down (freeing a large shard's Python objects). It now
ends with ``os._exit`` once the pipe closes between requests (a snapshot being written is
finished first, and every file it writes is written to a temporary name and renamed)."""

from __future__ import annotations

import multiprocessing as mp
import time

from oprag_server.shards import worker

_BIG = None


def big_shard(*args):
    """worker.run in a process that also holds many Python objects (as a large shard does)."""
    global _BIG
    _BIG = {f"doc-{i}": [i, str(i)] for i in range(3_000_000)}
    worker.run(*args)


def test_a_shard_ends_at_once_when_its_pipe_closes():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    p = ctx.Process(target=big_shard, args=(0, child, 4, None, False, set()), daemon=True)
    p.start()
    child.close()
    try:
        assert parent.poll(120)
        assert parent.recv()[1] is True  # READY
        t = time.perf_counter()
        parent.close()  # the frontend is gone (kill -9 closes its end the same way)
        p.join(30)
        took = time.perf_counter() - t
    finally:
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert took < 1.0, f"the shard process lived {took:.2f} s after its frontend (before: 2.2 s here)"
