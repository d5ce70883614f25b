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
