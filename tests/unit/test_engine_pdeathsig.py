"""The managed engine's launcher (models/managed_engine.py ``WITH_PDEATHSIG``): the command runs (PATH lookup, its
arguments intact) and dies with the process that started it (SIGTERM, Linux ``PR_SET_PDEATHSIG``), set by an exec'd
``python -c`` wrapper instead of a ``preexec_fn`` (which forced fork() under the server's gRPC: grpc/grpc#43157)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from oprag_server.models.managed_engine import WITH_PDEATHSIG

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_command_runs_with_its_arguments():
    out = subprocess.run([sys.executable, "-c", WITH_PDEATHSIG, "echo", "a b", "c"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "a b c\n"


def test_the_command_dies_with_its_parent(tmp_path):
    """A middle process starts ``sleep`` through the wrapper and is killed: the sleep gets SIGTERM."""
    pidfile = tmp_path / "pid"
    middle = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {WITH_PDEATHSIG!r}, 'sleep', '300'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(300)\n")])
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        time.sleep(1.0)  # (the wrapper has exec'd sleep)
        assert _alive(pid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].endswith(b"sleep")
    finally:
        middle.kill()
        middle.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
