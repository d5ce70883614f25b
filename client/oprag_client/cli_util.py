"""Shared pieces of the ``oprag`` commands: the connection options every command takes, number
options that argparse checks, and how errors are printed (``oprag: ...`` on stderr, exit status)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from .channel import bearer_token, pem_problem, target_problem
from .cli_entry import INTERRUPTED, INTERRUPTED_STATUS, settle
from .client import OpRAGClient


def _add_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", type=_target, default=os.environ.get("OPRAG_SERVER", "127.0.0.1:50051"),
                   help="HOST:PORT (or $OPRAG_SERVER)")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="per-RPC deadline in seconds (finite, > 0; default: none, 5 for health)")
    p.add_argument("--token", default=os.environ.get("OPRAG_TOKEN"), help="bearer token (or OPRAG_TOKEN)")
    p.add_argument("--tls-ca", type=Path, default=None, help="connect with TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", dest="client_cert", type=Path, default=None, help="client certificate (PEM)")
    p.add_argument("--tls-key", dest="client_key", type=Path, default=None, help="client private key (PEM)")


def _target(text: str) -> str:
    """``--server``: a gRPC target, ``HOST:PORT`` (:func:`~oprag_client.channel.target_problem`)."""
    if (why := target_problem(text)) is not None:
        raise argparse.ArgumentTypeError(why)
    return text


_PEM = {"--tls-ca": "CA certificate", "--tls-cert": "client certificate", "--tls-key": "client private key"}
_KIND = {"--tls-ca": "certificate", "--tls-cert": "certificate", "--tls-key": "private key"}


def _client(a, **kw) -> OpRAGClient:
    for flag, path in (("--tls-ca", a.tls_ca), ("--tls-cert", a.client_cert), ("--tls-key", a.client_key)):
        if path is not None and Path(path).is_dir():  # (was a traceback: IsADirectoryError)
            raise ValueError(f"{flag} {path} is a folder: give the {_PEM[flag]} file (PEM)")
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"cannot read {flag} {path}: {'no such file' if not Path(path).exists() else 'permission denied'}")
        if path is not None and (why := pem_problem(Path(path).read_bytes(), _KIND[flag])):  # gRPC: "security handshaker"
            raise ValueError(f"{flag} {path} {why}")
    token = bearer_token(a.token, "--token or OPRAG_TOKEN")  # (a file's newline: gRPC's "Invalid metadata")
    return OpRAGClient(a.server, timeout=a.timeout, token=token, tls_ca=a.tls_ca, tls_cert=a.client_cert,
                       tls_key=a.client_key, **kw)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _count(text: str) -> int:
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive(text: str) -> int:
    v = _int(text, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _seconds(text: str) -> float:
    """A deadline: a finite number of seconds above 0 (0 or less expired before the call was sent)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return v


def _weight(text: str) -> float:
    """A fusion weight: a finite number >= 0 (the server checks its range: 0 or [1e-12, 1e6])."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (0 <= v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _fail(msg: str, code: int = 1) -> int:
    """``oprag: msg`` on stderr; ``code``, the exit status. The command has its result: a Ctrl-C from now on changes
    nothing (:func:`~.cli_entry.settle`)."""
    settle()
    print(f"oprag: {msg}", file=sys.stderr)
    return code


#: what to change, by the words of gRPC's connection errors (which say only what failed)
_HINTS = (("Connection refused", "no server listens there: start one (oprag serve), or give its address with "
                                 "--server HOST:PORT or OPRAG_SERVER"),
          ("WRONG_VERSION_NUMBER", "the server does not use TLS: drop --tls-ca, --tls-cert and --tls-key"),
          ("Socket closed", "if the server uses TLS, pass --tls-ca with the CA certificate that signed its certificate"),
          ("Failed parsing HTTP/2", "something other than a gRPC server answers there (an HTTP port, such as "
                                    "the server's metrics or HTTP API port?): give --server the gRPC port"),
          ("Hostname Verification", "the server's certificate does not name this host: give --server the name or "
                                    "IP address its certificate holds"))


def _rpc_message(exc: grpc.RpcError) -> str:
    """``CODE: details (what to change)`` of a failed call, as :func:`_rpc_error` prints it."""
    details = exc.details() or ""
    m = re.fullmatch(r"errors resolving (\S+): \[.*: ([^:\]]+)\]", details.strip())
    if exc.code() == grpc.StatusCode.UNAVAILABLE and m:  # gRPC named the address twice
        return (f"UNAVAILABLE: cannot resolve the host name of {m.group(1)} ({m.group(2).strip()}): give --server "
                "the server's host name or IP address, HOST:PORT, or set OPRAG_SERVER")
    hint = (" (give the server's token with --token TOKEN or the OPRAG_TOKEN environment variable)"
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED else "")
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details:  # not a call cut short
        hint = next((f" ({h})" for words, h in _HINTS if words in details), "")
    return f"{exc.code().name}: {details}{hint}"


def _rpc_error(exc: grpc.RpcError, a=None, msg: str | None = None) -> int:
    """Exit status 1 with the call's error (``msg``, default :func:`_rpc_message`) on stderr; with ``--json``
    (``a.json``) also one JSON object on stdout, ``{"error": {"code", "message"}}`` (trial39: ``oprag query --json``
    printed nothing when the call failed)."""
    settle()  # (the call's outcome is known: a Ctrl-C now neither adds a CANCELLED object nor changes the status)
    msg = _rpc_message(exc) if msg is None else msg
    if getattr(a, "json", False):
        _json_error(exc.code().name, msg)
    return _fail(msg)


def _json_error(code: str | None, message: str) -> None:
    """``{"error": {"code": code, "message": message}}`` on stdout (a ``--json`` command that fails)."""
    import json  # noqa: PLC0415

    settle()
    print(json.dumps({"error": {"code": code, "message": message}}))


def _interrupted(a=None, obj: dict | None = None) -> int:
    """Ctrl-C: ``oprag: interrupted (Ctrl-C)`` on stderr and exit status 130, with ``--json`` (``a.json``) also one
    object on stdout, ``obj`` or ``{"error": {"code": "CANCELLED", "message": "interrupted (Ctrl-C)"}}`` (trial51:
    ``oprag query`` printed a 32-line traceback ending in KeyboardInterrupt, and nothing on stdout with --json).
    The call in flight is cancelled as the command's client closes its channel, on the way here. (A Ctrl-C before
    the command started, while the interpreter imported it, is :mod:`.cli_entry`'s.)"""
    settle()  # (a second Ctrl-C while this is said changes nothing)
    if getattr(a, "json", False):
        if obj is None:
            _json_error("CANCELLED", INTERRUPTED)
        else:
            import json  # noqa: PLC0415

            print(json.dumps(obj))
    return _fail(INTERRUPTED, INTERRUPTED_STATUS)


class _ClosedOk:
    """``sys.stdout`` while a command runs: once the reader has gone (``oprag stats | head -c 10``:
    a write or flush raises ``BrokenPipeError``), the rest of the output goes to /dev/null, so
    the command runs to its end and exits with the status of what it found (a shard down: 1)
    instead of 0 (the error was caught at the top) or 120 with "Exception ignored ... BrokenPipeError"
    (the interpreter's last flush). A command writes on stdout once it has its result: from its first write, a
    Ctrl-C changes neither the output nor the exit status (:func:`~.cli_entry.settle`)."""

    def __init__(self, out) -> None:
        self._out = out

    def write(self, s: str) -> int:
        settle()
        try:
            return self._out.write(s)
        except BrokenPipeError:
            self._drop()
            return len(s)

    def flush(self) -> None:
        try:
            self._out.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        try:  # the file descriptor itself, so that no later flush (the interpreter's last) fails
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, self._out.fileno())
            os.close(fd)
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture): nothing to flush later
            pass

    def __getattr__(self, name: str):
        return getattr(self._out, name)


@contextlib.contextmanager
def _stdout_closed_ok() -> Iterator[_ClosedOk]:
    """Run a command with :class:`_ClosedOk` as ``sys.stdout`` (flushed at the end, inside)."""
    real = sys.stdout
    sys.stdout = out = _ClosedOk(real)
    try:
        yield out
    finally:
        out.flush()
        sys.stdout = real
