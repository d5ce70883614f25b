"""``oprag serve`` flags the new-user trial of issue 15 tried: a --host that is not an address of
this machine was reported as the port's fault ("gRPC port (--port) 999.1.1.1:50170 is not available
(Name or service not known): choose another port"), after the models had loaded; it is now named
before anything loads. A negative --shutdown-grace was accepted ("shutting down (grace -1 s)")."""

from __future__ import annotations

import pytest

from oprag_server.cli import main
from oprag_server.config import ServerConfig


@pytest.mark.parametrize("flag,host", [("--host", "999.1.1.1"), ("--host", "nohost.invalid"),
                                       ("--metrics-host", "nohost.invalid"), ("--host", "192.0.2.1")])
def test_a_host_that_is_not_local_is_named_as_the_host_not_the_port(flag, host, capsys, tmp_path):
    assert main([flag, host, "--port", "0", "--metrics-port", "0", "--data-dir", str(tmp_path / "d"),
                 "--generator", "none"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {host} is not an address of this machine" in err and "choose another port" not in err, err
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_a_negative_shutdown_grace_is_refused(capsys, tmp_path):
    assert main(["--shutdown-grace", "-1", "--data-dir", str(tmp_path / "d")]) == 2
    assert "--shutdown-grace must be >= 0 seconds, got -1.0" in capsys.readouterr().err
    assert ServerConfig(shutdown_grace_s=0).shutdown_grace_s == 0


def test_a_token_holding_a_hash_stays_whole_and_its_prefix_is_no_token(tmp_path, monkeypatch):
    """--tokens-file cut every line at its first "#": the token ``abc#def`` became ``abc``, so
    ``abc`` was let in and ``abc#def`` itself refused. A comment now starts a line or follows a blank."""
    from oprag_server.service.auth import load_tokens

    monkeypatch.delenv("OPRAG_TOKENS", raising=False)
    p = tmp_path / "tokens"
    p.write_text("# the tokens\nabc#def\n  second  # the second one\n\t#indented comment\r\nthird\r\n")
    assert load_tokens(p) == {"abc#def", "second", "third"}


@pytest.mark.parametrize("flag,value", [("--ann-check", "-1"), ("--hnsw-m", "1"), ("--ef-search", "0"),
                                        ("--ann-tail", "-2"), ("--nprobe", "0")])
def test_a_dense_index_value_out_of_range_names_its_option(flag, value, capsys, tmp_path):
    """trial36: 'ann_check must be >= 0' named the config field, not the option to change."""
    assert main([flag, value, "--dense-index", "hnsw", "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert f"{flag} must be " in err and f"got {value}" in err, err  # (the flag in place of the field: trial38b)
    assert not (tmp_path / "d").exists()
