"""``make serve SERVE_ARGS=...`` keeps the HTTP API on :8000 (the README's promise): the port is
its own variable (HTTP_PORT, 0 = off), SERVE_ARGS only adds options. ``make -n``: nothing runs."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from oprag_server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _serve_argv(*make_args: str) -> list[str]:
    out = subprocess.run(["make", "-n", "serve", *make_args], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    line = next(ln for ln in reversed(out.splitlines()) if " serve" in ln and "oprag" in ln)
    argv = shlex.split(line)
    return argv[argv.index("serve") + 1:]


@pytest.mark.parametrize("make_args, port, shards", [
    ((), 8000, None),
    (("SERVE_ARGS=--shards 4 --generator none",), 8000, 4),  # the README's example keeps the HTTP port
    (("HTTP_PORT=8080", "SERVE_ARGS=--shards 2"), 8080, 2),
    (("HTTP_PORT=0",), 0, None),  # off
    (("SERVE_ARGS=--http-port 9000",), 9000, None),  # an explicit flag in SERVE_ARGS wins (the last one)
])
def test_make_serve_passes_the_http_port_with_serve_args(make_args, port, shards):
    a = build_parser().parse_args(_serve_argv(*make_args))
    assert vars(a)[".http_port"] == port
    if shards is not None:
        assert vars(a)[".shards"] == shards


def test_the_readme_documents_the_port_variable():
    text = (ROOT / "README.md").read_text()
    assert 'make serve SERVE_ARGS="--shards 4 --generator none"' in text and "HTTP_PORT=0" in text
