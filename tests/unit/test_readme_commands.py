"""Every ``oprag ...`` command line in README.md's code blocks parses: client commands with the
client's parser, ``oprag serve`` with the server's (flags after the subcommand, known options)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from oprag_client.cli import _parser
from oprag_server.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _commands() -> list[str]:
    out, block = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            block = not block
            continue
        s = line.strip()
        if block and re.match(r"oprag\s", s):
            s = re.split(r"\s+#\s", s, maxsplit=1)[0].replace("...", "x").rstrip(" &\\")
            out.append(s)
    return out


CMDS = _commands()


def test_the_readme_has_commands():
    assert len(CMDS) > 20


@pytest.mark.parametrize("line", CMDS)
def test_a_readme_command_parses(line, monkeypatch):
    argv = shlex.split(line)[1:]
    monkeypatch.setattr("sys.exit", lambda code=0: (_ for _ in ()).throw(AssertionError(f"{line!r}: exit {code}")))
    if argv[0] == "serve":
        build_parser().parse_args(argv[1:])
    else:
        _parser({}).parse_args(argv)
