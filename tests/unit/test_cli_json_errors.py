"""trial39 #5: every ``--json`` invocation prints one JSON object on stdout, also when it fails:
refused arguments (argparse's own checks and the client's), and a call that fails (here a port no
server listens on: a real gRPC channel). ``oprag ingest --json`` keeps its summary's keys."""

from __future__ import annotations

import json
import socket

import pytest

from oprag_client import cli


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _one_object(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


@pytest.mark.parametrize("argv, code, status", [
    (["query", "--json", "--no-generate", "--top-k", "abc", "q"], "USAGE", 2),
    (["query", "--json", "--no-memory", "q"], "USAGE", 2),
    (["query", "--json", "--bogus", "q"], "USAGE", 2),
    (["query", "--json", "--no-generate", "q"], "UNAVAILABLE", 1),
    (["stats", "--json"], "UNAVAILABLE", 1),
    (["delete", "--json", "d1"], "UNAVAILABLE", 1),
])
def test_a_failing_json_command_prints_an_error_object(argv, code, status, capsys):
    try:
        got = cli.main([argv[0], "--server", _closed_port(), *argv[1:]])
    except SystemExit as exc:  # (argparse's own refusals exit)
        got = exc.code
    assert got == status
    obj = _one_object(capsys)
    assert obj["error"]["code"] == code and obj["error"]["message"], obj


def test_ingest_with_an_unknown_format_prints_the_summary_keys(tmp_path, capsys):
    f = tmp_path / "d.txt"
    f.write_text("hello")
    with pytest.raises(SystemExit) as ei:
        cli.main(["ingest", "--server", _closed_port(), "--json", "--format", "bogus", str(f)])
    assert ei.value.code == 2
    obj = _one_object(capsys)
    assert {"documents", "chunks", "seq", "streams", "chunks_per_s", "error"} <= set(obj)
    assert "--format" in obj["error"]["message"] and obj["error"]["stored"] is False


def test_query_json_has_sources_whatever_the_generation(capsys, monkeypatch):
    """``sources`` is in every ``oprag query --json`` object: None with --no-generate (as finish_reason)."""
    from types import SimpleNamespace

    r = SimpleNamespace(hits=[], timings_ms={}, request_id="r", memory_context="", memory_used=False,
                        resolved_query="q", retrieval=SimpleNamespace(missing_shards=[], partial=False), finish_reason="", sources=[])

    class _C:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def retrieve(self, q, **kw):
            return r

    monkeypatch.setattr(cli, "_client", lambda a: _C())
    monkeypatch.setattr(cli, "_retrieval_json", lambda r: {})
    assert cli.main(["query", "--json", "--no-generate", "q"]) == 0
    obj = _one_object(capsys)
    assert "sources" in obj and obj["sources"] is None and obj["finish_reason"] is None
