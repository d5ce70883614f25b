"""New-user trial 22 (branch fix22d), the client side: ``--tls-ca`` given a PEM private key said
only "Failed to create security handshaker" (after connecting); ``--server HOST`` without a port
dialled port 443 in silence."""

from __future__ import annotations

import subprocess

import pytest

from oprag_client import cli
from oprag_client.cli_util import _target
from oprag_client.client import OpRAGClient


@pytest.fixture(scope="module")
def pems(tmp_path_factory):
    d = tmp_path_factory.mktemp("pems")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "2", "-subj", "/CN=localhost"], check=True, capture_output=True, cwd=d)
    return d / "cert.pem", d / "key.pem"


@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-cert"])
def test_cli_a_certificate_option_given_a_private_key_says_so(pems, capsys, flag):
    cert, key = pems
    extra = ["--tls-key", str(key)] if flag == "--tls-cert" else []
    assert cli.main(["stats", "--server", "127.0.0.1:1", flag, str(key), *extra]) == 2
    err = capsys.readouterr().err
    assert f"oprag: {flag} {key} holds no certificate (its PEM block is 'PRIVATE KEY'" in err, err
    assert "swapped" in err and "handshaker" not in err, err


def test_cli_tls_key_given_a_certificate_says_so(pems, capsys):
    cert, key = pems
    assert cli.main(["stats", "--server", "127.0.0.1:1", "--tls-ca", str(cert), "--tls-cert", str(cert),
                     "--tls-key", str(cert)]) == 2
    assert f"oprag: --tls-key {cert} holds no private key (its PEM block is 'CERTIFICATE'" in capsys.readouterr().err


def test_client_library_tls_ca_given_a_private_key_raises_value_error(pems):
    cert, key = pems
    with pytest.raises(ValueError, match=r"^tls_ca .*key\.pem holds no certificate"):
        OpRAGClient("127.0.0.1:1", tls_ca=key)
    with OpRAGClient("127.0.0.1:1", tls_ca=cert, tls_cert=cert, tls_key=key):  # the right files: no complaint
        pass


@pytest.mark.parametrize("target", ["127.0.0.1", "localhost", "[::1]", " localhost "])
def test_cli_server_without_a_port_is_refused_naming_the_missing_port(capsys, monkeypatch, target):
    with pytest.raises(SystemExit) as ei:
        cli.main(["stats", "--server", target])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"--server: the port is missing: give HOST:PORT, e.g. {target.strip()}:50051" in err, err
    monkeypatch.setenv("OPRAG_SERVER", target)  # the same check for the environment variable
    with pytest.raises(SystemExit):
        cli.main(["stats"])
    assert "the port is missing" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["localhost:50051", "[::1]:50051", "my-host.example:1"])
def test_cli_server_with_a_port_is_accepted(target):
    assert _target(target) == target
