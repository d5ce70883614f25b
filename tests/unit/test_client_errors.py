"""Client-side errors a new user meets name what to change."""

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
    (["query", "--timeout", "0", "q"], "--timeout: must be a number of seconds above 0, got 0"),  # was DEADLINE_EXCEEDED
    (["stats", "--timeout", "-1"], "--timeout: must be a number of seconds above 0, got -1"),
    (["query", "--timeout", "nan", "q"], "--timeout: must be a number of seconds above 0, got nan"),
    (["ingest", "--docs-per-stream", "0", "x.jsonl"], "--docs-per-stream: must be >= 1, got 0"),
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
