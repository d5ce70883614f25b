"""New-user trial 22 (branch fix22b), the Python client's channel: it reconnects to a restarted
server within about a second (gRPC's default back-off grew to ~10 s while calls kept failing), and
a caller's ``channel_options`` win. The restart of a real server is in
tests/integration/test_fix22b_reconnect.py."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from oprag_client.channel import RECONNECT_OPTIONS, channel_options
from oprag_client.client import AsyncOpRAGClient, OpRAGClient
from oprag_client.testing import ConnectAttempts


def test_channel_options_reconnect_fast_and_the_caller_wins():
    opts = dict(channel_options(1024))
    assert opts["grpc.max_receive_message_length"] == opts["grpc.max_send_message_length"] == 1024
    assert opts["grpc.initial_reconnect_backoff_ms"] <= 500 and opts["grpc.max_reconnect_backoff_ms"] <= 1000
    assert RECONNECT_OPTIONS.items() <= opts.items()
    for over in ({"grpc.max_reconnect_backoff_ms": 120_000, "grpc.enable_retries": 0},
                 [("grpc.max_reconnect_backoff_ms", 120_000), ("grpc.enable_retries", 0)]):
        got = channel_options(1024, over)
        assert dict(got)["grpc.max_reconnect_backoff_ms"] == 120_000 and dict(got)["grpc.enable_retries"] == 0
        assert len(got) == len({k for k, _ in got})  # one value per argument


def _poll_sync(target: str, seconds: float, **kw) -> None:
    with OpRAGClient(target, **kw) as c:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            with pytest.raises(grpc.RpcError):
                c.health(timeout=1)
            time.sleep(0.2)


async def _poll_async(target: str, seconds: float) -> None:
    async with AsyncOpRAGClient(target) as c:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            with pytest.raises(grpc.RpcError):
                await c.health(timeout=1)
            await asyncio.sleep(0.2)


def test_a_client_that_keeps_calling_a_down_server_tries_to_connect_about_every_second():
    """gRPC's default back-off (1 s, x1.6 per attempt, to 120 s) spaced the attempts 1, 1.6,
    2.6, 4.1, 6.6 s... apart while calls kept failing, so a server back after ~10 s waited up to
    ~7 s more; the clients' channels now try at most ~1 s apart, and a caller's
    ``channel_options`` reach the channel (gRPC's defaults again)."""
    fast_sync, fast_async, slow = ConnectAttempts(), ConnectAttempts(), ConnectAttempts()
    seconds = 7.5
    runs = [threading.Thread(target=_poll_sync, args=(fast_sync.target, seconds)),
            threading.Thread(target=lambda: asyncio.run(_poll_async(fast_async.target, seconds))),
            threading.Thread(target=_poll_sync, args=(slow.target, seconds),
                             kwargs={"channel_options": {"grpc.initial_reconnect_backoff_ms": 1000,
                                                         "grpc.max_reconnect_backoff_ms": 120_000}})]
    for t in runs:
        t.start()
    for t in runs:
        t.join(60)
    for a in (fast_sync, fast_async, slow):
        a.close()
    for name, a in (("sync", fast_sync), ("async", fast_async)):
        gaps = a.gaps()
        assert len(gaps) >= 5 and max(gaps) < 2.0, (name, gaps)
    gaps = slow.gaps()
    assert max(gaps) >= 2.0, gaps  # 1, 1.6, 2.56 s (+-20%): the override took effect
