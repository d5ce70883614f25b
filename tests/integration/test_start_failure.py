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
