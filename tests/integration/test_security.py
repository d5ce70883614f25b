"""TLS on the gRPC port and bearer-token authentication, with certificates made by openssl."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port, oprag_cli

pytestmark = pytest.mark.integration


def _certs(d):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=oprag-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "san.cnf")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.pem", "-days", "2",
        "-subj", "/CN=someone-else")
    return d / "ca.pem", d / "server.pem", d / "server.key", d / "other.pem"


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca, cert, key, other = _certs(d)
    (d / "tokens").write_text("# tokens\nsecret-one\nsecret-two\n")
    srv = ServerProcess(d / "data", free_port(), free_port(), "--generator", "none", "--tls-cert", str(cert),
                        "--tls-key", str(key), "--tokens-file", str(d / "tokens")).start()
    yield srv, ca, other
    srv.stop()


def test_token_required_over_tls(secure_server):
    srv, ca, other = secure_server
    target = f"localhost:{srv.port}"
    with OpRAGClient(target, tls_ca=ca, token="secret-two", timeout=30) as c:
        r = c.ingest([Doc("tls-doc", "Encrypted transport for kite festivals.")])
        assert r.documents_written == 1
        assert c.retrieve("kite festivals", top_k=1).hits[0].doc_id == "tls-doc"
    for token in (None, "wrong"):
        with OpRAGClient(target, tls_ca=ca, token=token, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as ei:
                c.retrieve("kite festivals")
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in ei.value.details()
            with pytest.raises(grpc.RpcError) as ei:
                c.ingest([Doc("sneaky", "should not be stored")])
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"  # health stays open for probes
    with OpRAGClient(target, tls_ca=ca, token="secret-one", timeout=30) as c:
        assert c.stats().documents == 1  # the refused ingest stored nothing


def test_untrusted_certificate_and_plaintext_are_refused(secure_server):
    srv, ca, other = secure_server
    with OpRAGClient(f"localhost:{srv.port}", tls_ca=other, token="secret-one", timeout=10) as c:
        with pytest.raises(grpc.RpcError) as ei:
            c.stats()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    with OpRAGClient(f"127.0.0.1:{srv.port}", token="secret-one", timeout=10) as c:
        with pytest.raises(grpc.RpcError):
            c.stats()


def test_cli_with_tls_and_token(secure_server):
    srv, ca, other = secure_server
    cli = oprag_cli()
    base = ["--server", f"localhost:{srv.port}", "--tls-ca", str(ca)]
    ok = subprocess.run(cli + ["stats", "--json", *base], capture_output=True, text=True, timeout=60,
                        env={**os.environ, "OPRAG_TOKEN": "secret-one"})
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(cli + ["stats", *base], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "OPRAG_TOKEN"})
    assert bad.returncode != 0 and "UNAUTHENTICATED" in bad.stderr


def test_plaintext_token_from_environment_sync_and_async(tmp_path, monkeypatch):
    import asyncio

    from oprag_client.client import AsyncOpRAGClient

    monkeypatch.setenv("OPRAG_TOKENS", "plain-token")
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none").start()
    monkeypatch.delenv("OPRAG_TOKENS")
    try:
        with OpRAGClient(srv.target, token="plain-token", timeout=30) as c:
            assert c.ingest([Doc("p", "plain text token")]).documents_written == 1
            assert list(c.query_stream("plain", top_k=1))[-1].WhichOneof("event") == "done"
        with OpRAGClient(srv.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as ei:
                c.retrieve("plain")
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED

        async def run():
            async with AsyncOpRAGClient(srv.target, token="plain-token", timeout=30) as c:
                r = await c.retrieve("plain text", top_k=1)
                assert r.hits[0].doc_id == "p"
                assert (await c.ingest([Doc("q", "more")])).documents_written == 1
            async with AsyncOpRAGClient(srv.target, token="nope", timeout=30) as c:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await c.stats()
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(run())
    finally:
        srv.stop()


def test_client_certificates_required_with_client_ca(tmp_path):
    ca, cert, key, other = _certs(tmp_path)

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=client")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "client.pem", "-days", "2")
    srv = ServerProcess(tmp_path / "data", free_port(), free_port(), "--generator", "none", "--tls-cert", str(cert),
                        "--tls-key", str(key), "--tls-client-ca", str(ca)).start()
    try:
        target = f"localhost:{srv.port}"
        with OpRAGClient(target, tls_ca=ca, tls_cert=tmp_path / "client.pem", tls_key=tmp_path / "client.key",
                         timeout=30) as c:
            assert c.stats().documents == 0
        with OpRAGClient(target, tls_ca=ca, timeout=10) as c:  # no client certificate
            with pytest.raises(grpc.RpcError) as ei:
                c.stats()
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()
