"""trial23 #2: a gRPC target with an empty port (``HOST:``) or an empty host (``:PORT``) is refused
by the CLI (``--server`` and ``OPRAG_SERVER``) and by the Python client (ValueError), not dialled on
port 443 / answered with a resolver error; gRPC scheme targets (unix:, dns:) still pass."""

import pytest

from oprag_client import cli
from oprag_client.cli_util import _target
from oprag_client.client import AsyncOpRAGClient, OpRAGClient


@pytest.mark.parametrize("target, want", [("127.0.0.1:", "the port is missing: give HOST:PORT, e.g. 127.0.0.1:50051"),
                                          ("localhost:", "the port is missing: give HOST:PORT, e.g. localhost:50051"),
                                          ("[::1]:", "the port is missing: give HOST:PORT, e.g. [::1]:50051"),
                                          (":50051", "the host is missing: give HOST:PORT, e.g. 127.0.0.1:50051")])
def test_cli_server_with_an_empty_port_or_host_is_refused(capsys, monkeypatch, target, want):
    with pytest.raises(SystemExit) as ei:
        cli.main(["stats", "--server", target])
    assert ei.value.code == 2
    assert f"--server: {want}" in capsys.readouterr().err
    monkeypatch.setenv("OPRAG_SERVER", target)  # the same check for the environment variable
    with pytest.raises(SystemExit) as ei:
        cli.main(["health"])
    assert ei.value.code == 2 and want in capsys.readouterr().err


@pytest.mark.parametrize("target", ["127.0.0.1", "127.0.0.1:", ":50051", "localhost:0", "h:99999", "http://h:1"])
def test_python_client_refuses_a_target_without_host_or_port(target):
    with pytest.raises(ValueError, match=r"^target (the port|the host|give HOST:PORT)"):
        OpRAGClient(target)
    with pytest.raises(ValueError, match=r"^target "):
        AsyncOpRAGClient(target)


@pytest.mark.parametrize("target", ["unix:/tmp/oprag.sock", "unix-abstract:oprag", "dns:///localhost:50051",
                                    "ipv4:127.0.0.1:50051", "localhost:50051", "[::1]:50051"])
def test_grpc_scheme_targets_still_accepted(target):
    assert _target(target) == target
    OpRAGClient(target).close()
