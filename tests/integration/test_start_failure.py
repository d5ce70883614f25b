"""A start that fails after the shards are up (here: the gRPC port was taken after the early
port check) exits with the error and leaves no shard process behind."""

from __future__ import annotations

import asyncio
import socket

import psutil
import pytest

from oprag_client.testing import free_port
from oprag_server.app import serve
from oprag_server.config import ServerConfig
from oprag_server.models.fakes import HashingEncoder

pytestmark = pytest.mark.integration


def test_port_taken_after_preflight_fails_the_start_and_stops_the_shards(tmp_path):
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cfg = ServerConfig(port=taken.getsockname()[1], metrics_port=free_port(), data_dir=tmp_path, shards=2)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        # models_loaded=True skips the early port check, as if the port was taken in between
        with pytest.raises(RuntimeError, match="bind"):
            asyncio.run(serve(cfg, encoder=HashingEncoder(dim=16), generator=None, models_loaded=True))
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own helper
        assert left == [], [p.cmdline() for p in left]
    finally:
        taken.close()


def test_shard_ready_timeout_fails_the_start_and_stops_every_shard(tmp_path):  # noqa: C901
    """A shard that does not report READY in time (the fresh-user case: the first kernel compile
    on a busy machine) fails the start with the timeout, and the shards already started are
    killed, so the process exits instead of waiting on them."""
    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards.transport import ShardError

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pool = ShardPool(2, 16, tmp_path)
    made, make = [], pool._make
    pool._make = lambda i: made.append(make(i)) or made[-1]  # held, as a serving process holds them
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ShardError, match="did not report READY within 0 s"):
            pool.start(loop, timeout_s=0.001)
    finally:
        loop.close()
    for _ in range(50):
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
        if not left:
            break
        import time

        time.sleep(0.1)
    assert left == [], [p.cmdline() for p in left]
