"""`oprag serve` options: defaults read from the config dataclasses, values reach the config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from oprag_server import cli
from oprag_server.config import ServerConfig


def cfg(*argv: str) -> ServerConfig:
    return cli.config_from_args(cli.build_parser().parse_args(list(argv)))


def test_no_option_gives_the_dataclass_defaults():
    assert cfg() == ServerConfig()


def test_help_shows_the_dataclass_defaults():
    text = cli.build_parser().format_help()
    d = ServerConfig()
    for flag, value in (("--candidates", d.retrieval.candidates), ("--chunk-size", d.chunking.size),
                        ("--port", d.port), ("--queue-capacity", d.batch.queue_capacity)):
        assert flag in text and f"(default: {value})" in " ".join(text.split())


def test_options_reach_their_fields(tmp_path):
    c = cfg("--host", "0.0.0.0", "--port", "6000", "--metrics-host", "::1", "--data-dir", str(tmp_path), "--shards", "3",
            "--chunk-size", "100", "--chunk-overlap", "10", "--candidates", "64", "--monitor-fraction", "0.5",
            "--max-batch", "4", "--max-wait-ms", "2.5", "--no-overlap", "--no-embed-query-thread", "--stem",
            "--ingest-barriers", "--embed-compile", "--generator", "none", "--max-new-tokens", "32",
            "--tokens-file", "t.txt", "--shutdown-grace", "1.5")
    assert (c.host, c.port, c.metrics_host, c.data_dir, c.shards) == ("0.0.0.0", 6000, "::1", tmp_path, 3)
    assert (c.chunking.size, c.chunking.overlap, c.retrieval.candidates, c.retrieval.monitor_fraction) == (100, 10, 64, 0.5)
    assert (c.batch.max_batch, c.batch.max_wait_ms, c.batch.overlap, c.batch.embed_query_thread) == (4, 2.5, False, False)
    assert c.bm25.stem and c.ingest.barriers and c.embed.compile
    assert (c.generate.model, c.generate.default_max_new_tokens) == ("none", 32)
    assert c.security.tokens_file == Path("t.txt") and c.shutdown_grace_s == 1.5


def test_no_default_literal_is_repeated_in_the_cli():
    """Option defaults come from the dataclasses: no argument default in cli.py is a literal
    (but the log level, which is no config field)."""
    tree = ast.parse(Path(cli.__file__).read_text())
    literal = [kw.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for kw in n.keywords
               if kw.arg == "default" and isinstance(kw.value, ast.Constant)]
    assert literal == ["INFO"]


def test_a_bad_value_fails_with_status_2(capsys):
    assert cli.main(["--chunk-size", "0"]) == 2
    assert "--chunk-size must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--chunk-overlap", "300"], "--chunk-overlap 300 must be at least 0 and below --chunk-size 256: "
                                 "give a smaller --chunk-overlap or a larger --chunk-size"),
    (["--chunk-size", "100", "--chunk-overlap", "100"], "--chunk-overlap 100 must be at least 0 and below --chunk-size 100"),
    (["--chunk-overlap", "-1"], "--chunk-overlap -1 must be at least 0"),
])
def test_a_chunk_overlap_out_of_range_names_both_options_and_their_values(capsys, argv, words):
    """trial26 #4: ``--chunk-overlap 300`` said "chunk overlap must be in [0, size), got 300",
    naming neither option nor the size it must stay below."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oprag: {words}") and err.count("\n") == 1, err


def test_replicas_reach_the_config_and_are_bounded(capsys):
    assert cfg().replicas == 1 and cfg("--replicas", "2").replicas == 2
    assert cli.main(["--replicas", "0"]) == 2
    assert "replicas must be in [1, 8]" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--shards", "0"], "--shards must be in [1, 64], got 0"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--widen-rounds", "17"], "--widen-rounds must be in [0, 16], got 17"),
    (["--candidates", "0"], "--candidates must be in [1, 4096], got 0"),
    (["--snapshot-interval-s", "-1"], "--snapshot-interval-s must be > 0 seconds, got -1.0"),
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--queue-capacity", "0"], "--queue-capacity must be >= 1, got 0"),
])
def test_a_server_wide_option_out_of_range_is_named_as_its_flag(argv, words, capsys, tmp_path):
    """trial39 #6: "shards must be in [1, 64]" named the config field, "widen_rounds must be in [0, 1073741824]
    (--widen-rounds)" both and a meaningless bound; every refusal now names the flag as --chunk-size's does."""
    assert cli.main([*argv, "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert words in err and "_" not in err.split(" got ")[0], err  # (no config field name)
    assert not (tmp_path / "d").exists()
