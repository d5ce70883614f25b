"""The shared server launcher (oprag_client.testing) without starting a real server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oprag_client.testing import ServerProcess, free_port, wait_until


def test_imports_nothing_from_the_server() -> None:
    code = ("import sys, oprag_client.testing; "
            "bad = [m for m in sys.modules if m.startswith('oprag_server')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_free_ports_and_command(tmp_path) -> None:
    srv = ServerProcess.on_free_ports(tmp_path / "d", "--generator", "none")
    assert srv.port != srv.metrics_port and srv.port > 0
    assert srv.target == f"127.0.0.1:{srv.port}"
    cmd = srv.command()
    assert cmd[:3] == [sys.executable, "-m", "oprag_server"]
    assert cmd[cmd.index("--port") + 1] == str(srv.port)
    assert cmd[cmd.index("--metrics-port") + 1] == str(srv.metrics_port)
    assert cmd[cmd.index("--data-dir") + 1] == str(tmp_path / "d")
    assert cmd[-2:] == ["--generator", "none"]
    fixed = ServerProcess(tmp_path, 5555, 5556, "--shards", "2")
    assert (fixed.port, fixed.metrics_port, fixed.extra) == (5555, 5556, ("--shards", "2"))
    assert free_port() > 0


def test_stop_before_start_is_a_no_op(tmp_path) -> None:
    srv = ServerProcess(tmp_path)
    assert srv.stop() is None and not srv.alive()
    srv.kill9()  # nothing to kill


def test_a_server_that_exits_early_raises_with_its_output(tmp_path) -> None:
    # an unknown option: the real server's argument parser exits at once (no models loaded)
    srv = ServerProcess.on_free_ports(tmp_path, "--no-such-option", log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="did not become ready"):
        srv.start(timeout=120)
    assert not srv.alive()
    assert "no-such-option" in (tmp_path / "server.log").read_text()


def test_wait_until() -> None:
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 3, timeout=5, interval=0.01)
    assert not wait_until(lambda: False, timeout=0.05, interval=0.01)
