"""Client-side errors a new user meets name what to change."""

import re

import grpc
import pytest

from oprag_client import cli
from oprag_client.client import query_request


@pytest.mark.parametrize("field, value", [("top_k", -1), ("candidates", 2**32), ("max_new_tokens", -5),
                                          ("ef_search", -1), ("min_seq", -1)])
def test_a_count_out_of_range_names_the_field_and_the_range(field, value):
    with pytest.raises(ValueError) as ei:
        query_request("q", **{field: value})
    msg = str(ei.value)
    assert msg.startswith(f"{field} must be between 0 and ") and str(value) in msg
    assert query_request("q", **{field: 0}) is not None


@pytest.mark.parametrize("field, value", [("top_k", "3"), ("candidates", 2.5), ("min_seq", "5"), ("nprobe", [1])])
def test_a_count_that_is_not_an_integer_names_the_field(field, value):
    """trial14: protobuf's "'str' object cannot be interpreted as an integer" named no field."""
    with pytest.raises(TypeError) as ei:
        query_request("q", **{field: value})
    assert str(ei.value).startswith(f"{field} must be an integer (0 = the server's default), got {type(value).__name__}")


def test_numpy_integer_counts_are_accepted_and_range_checked():
    import numpy as np

    assert query_request("q", top_k=np.int64(3)).top_k == 3 and query_request("q", top_k=None).top_k == 0
    with pytest.raises(ValueError, match="^top_k must be between 0 and"):
        query_request("q", top_k=np.int64(-1))


class _Err(grpc.RpcError):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


def test_cli_unauthenticated_points_to_token_flag_and_env(capsys):
    assert cli._rpc_error(_Err(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")) != 0
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--token" in err and "OPRAG_TOKEN" in err
    cli._rpc_error(_Err(grpc.StatusCode.NOT_FOUND, "no such document"))
    assert "--token" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["eval", "beir", "--limit", "-1"], "--limit: must be >= 0, got -1"),  # judged[:-1]: all but the last, silently
    (["eval", "beir", "--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
    (["eval", "beir", "--candidates", "-3"], "--candidates: must be >= 0, got -3"),
    (["query", "--timeout", "0", "q"], "--timeout: must be a finite number of seconds above 0, got 0"),  # was DEADLINE_EXCEEDED
    (["stats", "--timeout", "-1"], "--timeout: must be a finite number of seconds above 0, got -1"),
    (["query", "--timeout", "nan", "q"], "--timeout: must be a finite number of seconds above 0, got nan"),
    # fix25: "must be a number of seconds above 0, got inf" (infinity is above 0)
    (["query", "--timeout", "inf", "q"], "--timeout: must be a finite number of seconds above 0, got inf"),
    (["eval", "beir", "--timeout", "Infinity"], "--timeout: must be a finite number of seconds above 0, got Infinity"),
    (["ingest", "--docs-per-stream", "0", "x.jsonl"], "--docs-per-stream: must be >= 1, got 0"),
    # trial14: argparse said "invalid _count value: 'abc'" (a function's name); gRPC read port
    # 99999 as 34463 and an http:// URL as a host name ("Misformatted domain name")
    (["query", "--top-k", "abc", "q"], "--top-k: must be an integer >= 0, got 'abc'"),
    (["query", "--ef-search", "65537", "q"], "--ef-search: must be at most 65536, got 65537"),  # trial36: no such option
    (["query", "--nprobe", "-1", "q"], "--nprobe: must be >= 0, got -1"),
    (["eval", "beir", "--top-k", "9"], "--top-k: must be in [10, 100] (nDCG@10 and MRR@10 rank the top 10 documents"),
    (["eval", "beir", "--top-k", "101"], "the server returns at most 100), got 101"),
    (["ingest", "--docs-per-stream", "1.5", "x.jsonl"], "--docs-per-stream: must be an integer >= 1, got '1.5'"),
    (["stats", "--timeout", "soon"], "--timeout: must be a finite number of seconds above 0, got soon"),
    (["stats", "--server", "127.0.0.1:99999"], "--server: the port must be in 1-65535, got 99999"),
    (["stats", "--server", "http://127.0.0.1:50051"], "--server: give HOST:PORT without http://"),
    (["stats", "--server", ""], "--server: give HOST:PORT"),
])
def test_cli_refuses_counts_and_deadlines_out_of_range_before_sending(tmp_path, capsys, argv, words):
    """A negative --limit evaluated all but the last N queries and a --timeout of 0 or less failed
    every call with DEADLINE_EXCEEDED; now argparse refuses them (exit status 2) naming the flag."""
    (tmp_path / "q.jsonl").write_text('{"_id": "1", "text": "q"}\n')
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n1\td\t1\n")
    if argv[0] == "eval":
        argv = argv + ["--queries", str(tmp_path / "q.jsonl"), "--qrels", str(tmp_path / "qrels.tsv")]
    with pytest.raises(SystemExit) as ei:
        cli.main(argv + ["--server", "127.0.0.1:1"] if argv[0] != "query" else
                 argv[:-1] + ["--server", "127.0.0.1:1", argv[-1]])
    assert ei.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["query", "lob\udcedster"], "question has an unpaired surrogate"),
    (["delete", "a\udcff"], "doc_ids[0] has an unpaired surrogate"),
    (["clear-session", "a\udcff"], "session_id has an unpaired surrogate"),
    (["query", "--session", "a\udcff", "q"], "session_id has an unpaired surrogate"),
])
def test_cli_arguments_that_are_not_utf8_are_an_error_message_not_a_traceback(capsys, argv, words):
    """trial14: bytes that are not UTF-8 on the command line (Python reads them as lone surrogates)
    raised the client's ValueError out of main(): a traceback."""
    assert cli.main(argv[:1] + ["--server", "127.0.0.1:1"] + argv[1:]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oprag: ") and words in err and "not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-cert", "--tls-key"])
def test_cli_tls_file_that_cannot_be_read_is_named(tmp_path, capsys, flag):
    """trial14: a missing --tls-ca was a FileNotFoundError traceback."""
    missing = tmp_path / "none.pem"
    assert cli.main(["stats", "--server", "127.0.0.1:1", flag, str(missing)]) == 2
    assert f"oprag: cannot read {flag} {missing}: no such file" in capsys.readouterr().err


def test_cli_query_help_says_what_0_means(capsys):
    """trial14: `oprag query --help` listed --top-k, --candidates and --max-new-tokens without a
    word; 0 (their default) means the server's default, which only the HTTP section said."""
    with pytest.raises(SystemExit):
        cli.main(["query", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--top-k", "5"), ("--candidates", "256"), ("--max-new-tokens", "64")):
        meta = flag[2:].upper().replace("-", "_")
        assert re.search(rf"{flag} {meta} [^(]*\(0 = the server's default, {default};", out), (flag, out)


@pytest.mark.parametrize("details, hint", [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
     "Connection refused", "no server listens there: start one (oprag serve), or give its address with --server"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:50625: Socket closed",
     "if the server uses TLS, pass --tls-ca"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50624: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
     "WRONG_VERSION_NUMBER", "the server does not use TLS: drop --tls-ca"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50625: Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed.",
     "the server's certificate does not name this host"),
])
def test_cli_connection_errors_say_what_to_change(capsys, details, hint):
    """trial14: gRPC's connection errors say what failed, not what to change (the words are
    those of grpcio 1.85 against a stopped server, a TLS server without --tls-ca, a plain-text
    server with --tls-ca, and a certificate for another host name)."""
    assert cli._rpc_error(_Err(grpc.StatusCode.UNAVAILABLE, details)) == 1
    assert f"({hint}" in capsys.readouterr().err


def test_cli_a_call_cut_short_gets_no_connection_hint(capsys):
    # the server killed during an ingest: its socket closed, but no TLS setting is at fault
    cli._rpc_error(_Err(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"))
    assert capsys.readouterr().err == "oprag: UNAVAILABLE: Stream removed (Socket closed)\n"


def test_cli_tls_file_that_is_not_pem_is_named(tmp_path, capsys):
    bad = tmp_path / "ca.pem"
    bad.write_text("garbage\n")
    assert cli.main(["stats", "--server", "127.0.0.1:1", "--tls-ca", str(bad)]) == 2
    assert f"oprag: --tls-ca {bad} is not a PEM file" in capsys.readouterr().err


def test_the_clients_beam_bound_is_the_servers():
    """trial36: the client said ef_search 'must be between 0 and 4294967295' and let 65537 through
    to the server's INVALID_ARGUMENT ([0, 65536])."""
    from oprag_client.client import query_request
    from oprag_server.service.convert import MAX_KNOB

    assert query_request("q", ef_search=MAX_KNOB, nprobe=MAX_KNOB).ef_search == MAX_KNOB
    for name in ("ef_search", "nprobe"):
        with pytest.raises(ValueError, match=f"{name} must be between 0 and {MAX_KNOB}"):
            query_request("q", **{name: MAX_KNOB + 1})


def test_ingest_json_refused_before_sending_prints_one_object(tmp_path, capsys):
    """trial36: `oprag ingest --json` on a missing path printed no JSON (a script read nothing). trial51: an
    argument refused, as a wrong --format: code USAGE and exit status 2 (was null and 1)."""
    import json

    missing = str(tmp_path / "nosuch.jsonl")
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--json", missing]) == 2
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["documents"] == 0 and got["error"]["stored"] is False and missing in got["error"]["message"]
    assert got["error"]["code"] == "USAGE"
    assert "no such file or directory" in err
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", missing]) == 2
    assert capsys.readouterr().out == ""  # without --json: the message alone, on stderr
