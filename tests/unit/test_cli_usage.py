"""trial51 #3 and #4: a connection option given before the command (``oprag --server H:P query x``) was
"argument cmd: invalid choice: 'H:P'"; the positional arguments and ``--json`` of clear-session, delete and
stats had no help text, and ``oprag health`` had no ``--json`` or ``--service``."""

from __future__ import annotations

import json

import pytest

from oprag_client import cli


def _exit(argv) -> int:
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    return ei.value.code


@pytest.mark.parametrize("argv, fixed", [
    (["--server", "127.0.0.1:47101", "query", "lobster"], "oprag query --server 127.0.0.1:47101 lobster"),
    (["--timeout", "3", "--server", "h:1", "stats", "--json"], "oprag stats --timeout 3 --server h:1 --json"),
    (["--server", "h:1", "eval", "beir", "--queries", "q"], "oprag eval beir --server h:1 --queries q"),
    (["--token", "t t", "delete", "d"], "oprag delete --token 't t' d"),
])
def test_an_option_before_the_command_says_it_goes_after_the_command(argv, fixed, capsys):
    assert _exit(argv) == 2
    out, err = capsys.readouterr()
    assert f"options go after the command: {fixed}" in err, err
    assert "invalid choice" not in err
    assert json.loads(out)["error"]["code"] == "USAGE" if "--json" in argv else out == ""


def test_json_before_the_command_prints_the_usage_object(capsys):
    assert _exit(["--json", "query", "lobster"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == {"code": "USAGE", "message": "options go after the command: oprag query "
                                                                    "--json lobster"}
    assert "options go after the command" in err


def test_an_unknown_command_is_still_an_invalid_choice(capsys):
    assert _exit(["--server", "h:1", "nosuch"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture()
def help_of(capsys):
    def run(*argv: str) -> str:
        assert _exit([*argv, "--help"]) == 0
        return " ".join(capsys.readouterr().out.split())  # (argparse wraps its lines)
    return run


@pytest.mark.parametrize("cmd, words", [
    ("clear-session", ["session the session id", '--json print {"records_removed"']),
    ("delete", ["doc_ids ids of the documents", '--json print {"documents_deleted"']),
    ("stats", ["--json print the statistics as one JSON line"]),
    ("health", ["--service NAME", "oprag.v1.OpRAG.Ingest", '--json print {"service", "status"}']),
])
def test_every_argument_has_a_help_text(cmd, words, help_of):
    text = help_of(cmd)
    for w in words:
        assert w in text, text
