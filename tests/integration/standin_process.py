"""The stand-in OpenAI-compatible engine (bench/standin_engine.py) as a test process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from oprag_client.testing import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def standin_engine(*args: str) -> Iterator[str]:
    """The stand-in engine (extras fastapi and uvicorn) as a process on a free loopback port,
    with its options ``args``; yields its root URL (``http://127.0.0.1:PORT``, the API under
    ``/v1``) once ``/health`` answers; terminated on exit."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "bench.standin_engine", "--port", str(port), *args],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"

    def up():
        try:
            urllib.request.urlopen(root + "/health", timeout=1).read()
            return True
        except OSError:
            return False

    try:
        assert wait_until(up, 30), "stand-in did not start"
        yield root
    finally:
        proc.terminate()
        proc.wait(10)
