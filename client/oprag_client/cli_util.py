"""Shared pieces of the ``oprag`` commands: the connection options every command takes, number
options that argparse checks, and how errors are printed (``oprag: ...`` on stderr, exit status)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc

from .client import OpRAGClient


def _add_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=os.environ.get("OPRAG_SERVER", "127.0.0.1:50051"), help="HOST:PORT")
    p.add_argument("--timeout", type=_seconds, default=None, help="per-RPC deadline in seconds (> 0)")
    p.add_argument("--token", default=os.environ.get("OPRAG_TOKEN"), help="bearer token (or OPRAG_TOKEN)")
    p.add_argument("--tls-ca", type=Path, default=None, help="connect with TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", dest="client_cert", type=Path, default=None, help="client certificate (PEM)")
    p.add_argument("--tls-key", dest="client_key", type=Path, default=None, help="client private key (PEM)")


def _client(a, **kw) -> OpRAGClient:
    return OpRAGClient(a.server, timeout=a.timeout, token=a.token, tls_ca=a.tls_ca, tls_cert=a.client_cert,
                       tls_key=a.client_key, **kw)


def _count(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _seconds(text: str) -> float:
    """A deadline: a finite number of seconds above 0 (0 or less expired before the call was sent)."""
    v = float(text)
    if not (0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return v


def _fail(msg: str, code: int = 1) -> int:
    print(f"oprag: {msg}", file=sys.stderr)
    return code


def _rpc_error(exc: grpc.RpcError) -> int:
    hint = (" (give the server's token with --token TOKEN or the OPRAG_TOKEN environment variable)"
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED else "")
    return _fail(f"{exc.code().name}: {exc.details()}{hint}")
