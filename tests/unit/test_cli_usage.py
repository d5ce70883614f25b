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


# -- trial51b F3: the moved command line is suggested only when the command takes every option given before it

def _refused(argv, capsys) -> tuple[str, str]:
    assert _exit(argv) == 2
    out, err = capsys.readouterr()
    return out, err


@pytest.mark.parametrize("argv, said", [
    (["-v", "query", "x"], "unknown option -v before the command query: see oprag query --help"),
    (["--bogus", "query", "x"], "unknown option --bogus before the command query: see oprag query --help"),
    (["-v", "--bogus=1", "stats"], "unknown options -v, --bogus before the command stats: see oprag stats --help"),
    (["--top-k", "3", "stats"], "oprag stats has no option --top-k: see oprag stats --help"),
    (["--server", "h:1", "-v", "eval", "beir"], "unknown option -v before the command eval beir: see oprag eval beir"),
])
def test_an_option_the_command_has_not_is_named_not_moved(argv, said, capsys):
    out, err = _refused(argv, capsys)
    assert said in err, err
    assert "options go after the command: oprag" not in err and "invalid choice" not in err
    assert out == ""


def test_an_unknown_option_before_the_command_with_json_prints_the_usage_object(capsys):
    out, err = _refused(["--json", "-v", "query", "x"], capsys)
    assert json.loads(out)["error"] == {"code": "USAGE",
                                        "message": "unknown option -v before the command query: see oprag query --help"}


@pytest.mark.parametrize("argv", [["--server", "127.0.0.1:47200"], ["--json"], ["--timeout", "3", "--json"],
                                  ["--server", "h:1", "--help"]])
def test_options_without_a_command_say_the_command_is_missing(argv, capsys):
    out, err = _refused(argv, capsys)
    assert "a command is missing" in err and "invalid choice" not in err, err
    assert all(c in err for c in ("ingest", "query", "delete", "clear-session", "stats", "eval", "health")), err
    assert json.loads(out)["error"]["code"] == "USAGE" if "--json" in argv else out == ""


def test_a_server_option_before_serve_is_not_moved_after_it(capsys):
    """``oprag serve`` has no --server (was "options go after the command: oprag serve --server 1:2")."""
    out, err = _refused(["--server", "1:2", "serve"], capsys)
    assert "oprag serve --server" not in err and "invalid choice" not in err, err
    assert "oprag serve has no option --server" in err or "comes with the server" in err, err


def test_a_serve_option_before_serve_is_moved_after_it(capsys):
    pytest.importorskip("oprag_server")
    if "serve" not in cli._plugins():
        pytest.skip("no oprag.commands entry point for serve in this environment")
    out, err = _refused(["--port", "1", "serve", "--shards", "2"], capsys)
    assert "options go after the command: oprag serve --port 1 --shards 2" in err, err


def test_a_plugin_whose_options_cannot_be_checked_gets_its_help_named(monkeypatch, capsys):
    from types import SimpleNamespace

    def main(argv):  # (its module, this test's, has no build_parser)
        return 0

    monkeypatch.setattr(cli, "_plugins", lambda: {"fake": SimpleNamespace(load=lambda: main)})
    out, err = _refused(["--server", "h:1", "fake"], capsys)
    assert "options go after the command: see oprag fake --help" in err, err


def test_an_unknown_command_after_options_is_named(capsys):
    out, err = _refused(["--server", "h:1", "nosuch"], capsys)
    assert "invalid choice: 'nosuch'" in err and "'h:1'" not in err, err
