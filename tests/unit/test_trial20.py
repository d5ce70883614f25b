"""Findings of the trial20 new-user run that unit tests can hold: an unknown ``--log-level`` is a
start-up error (it was a traceback, exit 1), and the service-time estimates behind a full
queue's retry-after hint start from their first sample (an EWMA from the start value crept
0.5 -> 1.4 -> 2.2 s while each generation batch took 5.2 s). The query engine with the fakes of
test_scheduler (no models, no shards)."""

from __future__ import annotations

import asyncio

import pytest
from oprag_server import cli

from test_scheduler import FakeEngineGenerator, FakeGenerator, FakeRetriever, _engine, _job  # (tests/unit is on sys.path)


def test_an_unknown_log_level_is_a_start_up_error_and_case_does_not_matter(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:  # (argparse's exit: status 2, as every bad option)
        cli.main(["--log-level", "LOUD", "--data-dir", str(tmp_path / "d")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--log-level: invalid choice: 'LOUD'" in err and "DEBUG" in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()
    assert cli.build_parser().parse_args(["--log-level", "debug"]).log_level == "DEBUG"


def test_the_first_batch_time_replaces_the_start_value():
    async def run():
        eng = _engine(FakeGenerator(0.9), FakeRetriever(), max_batch=1)
        eng.start()
        start = eng.generate_s
        await eng.submit(_job("one"))
        after_one = eng.generate_s
        await eng.submit(_job("two", generate=False))
        retrieve_one = eng.retrieve_s
        await eng.stop()
        return start, after_one, retrieve_one

    start, after_one, retrieve_one = asyncio.run(run())
    assert start == 0.5 and 0.85 <= after_one <= 1.5, after_one  # (an EWMA from 0.5 gave 0.58)
    assert retrieve_one < 0.05  # (the fake retrieval's own time, not the 0.05 s start value pulled down a fifth)


def test_the_first_engine_request_time_replaces_the_start_value():
    async def run():
        gen = FakeEngineGenerator(0.6)
        eng = _engine(gen, FakeRetriever(), max_batch=1)
        start = eng.dispatch.request_s_ewma
        eng.start()
        await eng.submit(_job("one"))
        after = eng.dispatch.request_s_ewma
        await eng.stop()
        return start, after

    start, after = asyncio.run(run())
    assert start == 2.0 and 0.55 <= after <= 1.2, after  # (an EWMA from 2.0 gave 1.72)


@pytest.mark.parametrize("opts, says", [
    (["--tokens-file", "{d}/none"], "--tokens-file {d}/none: No such file or directory"),
    (["--tokens-file", "{d}/comment"], "--tokens-file {d}/comment: no token in the file: put one token per line"),
    (["--tls-cert", "{d}/none", "--tls-key", "{d}/none"], "--tls-cert/--tls-key {d}/none, {d}/none: No such file or directory"),
    (["--tls-cert", "{d}/bad.pem", "--tls-key", "{d}/bad.pem"], "--tls-cert/--tls-key {d}/bad.pem, {d}/bad.pem: not a PEM certificate"),
])
def test_token_and_tls_files_are_read_before_anything_starts(opts, says, tmp_path, capsys):
    """trial20: a missing, empty or non-PEM --tokens-file / --tls-* file was found after the shards
    had started and written to --data-dir, as a bare [Errno 2] or "Failed to bind to address"."""
    (tmp_path / "comment").write_text("# only a comment\n")
    (tmp_path / "bad.pem").write_text("garbage\n")
    data = tmp_path / "data"
    argv = [o.format(d=tmp_path) for o in opts] + ["--data-dir", str(data), "--generator", "none", "--port", "0"]
    assert cli.main(argv) == 2
    assert says.format(d=tmp_path) in capsys.readouterr().err
    assert not data.exists() or not any(data.iterdir())  # nothing written
