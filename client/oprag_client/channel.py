"""The gRPC channel of :class:`~oprag_client.client.OpRAGClient` and
:class:`~oprag_client.client.AsyncOpRAGClient`: message size limits, connection back-off,
credentials (TLS, bearer token)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

#: Connection back-off (gRPC core channel arguments, doc/connection-backoff.md). gRPC's defaults
#: (first retry after 1 s, x1.6 per failed attempt up to 120 s) left a client ~10 s behind a server
#: restarted on the same address; here a failed connection is tried again after 0.25 s, then at
#: most every 1 s (+-20% jitter), so a restarted server is reached within about a second of
#: listening. ``grpc.min_reconnect_backoff_ms`` is the time one connection attempt may take
#: (gRPC's MIN_CONNECT_TIMEOUT, default 20 s): 5 s, so an attempt whose packets were dropped
#: (a host coming back) is started again sooner, with room for a TLS handshake over a slow link.
RECONNECT_OPTIONS: dict[str, int] = {
    "grpc.initial_reconnect_backoff_ms": 250,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.min_reconnect_backoff_ms": 5000,
}


def channel_options(max_message_bytes: int,
                    overrides: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
    """The channel arguments: the message size limit both ways, :data:`RECONNECT_OPTIONS`, then
    ``overrides`` (gRPC channel arguments, a mapping or ``(name, value)`` pairs), which win."""
    opts: dict[str, Any] = {"grpc.max_receive_message_length": max_message_bytes,
                            "grpc.max_send_message_length": max_message_bytes, **RECONNECT_OPTIONS}
    opts.update(dict(overrides.items() if isinstance(overrides, Mapping) else overrides or ()))
    return list(opts.items())


def bearer_token(token: str | None, name: str = "token=") -> str | None:
    """The bearer token as it is sent: surrounding whitespace stripped (a token read from a file or
    a Kubernetes secret ends in a newline; the server strips the lines of its ``--tokens-file`` the
    same way); None when ``token`` is None or nothing is left.

    :param name: how the caller gave the token, for the message (``--token or OPRAG_TOKEN`` in the CLI).
    :raises ValueError: the token holds a character that a gRPC header cannot carry: a control
        character (a newline or tab inside it) or one outside printable ASCII (gRPC refused it as
        ``INTERNAL: Invalid metadata``, after C-core log lines)."""
    if token is None:
        return None
    token = token.strip()
    bad = next((i for i, ch in enumerate(token) if not " " <= ch <= "~"), None)
    if bad is not None:
        kind = "a control character" if token[bad].isascii() else "a character outside printable ASCII"
        raise ValueError(f"the bearer token ({name}) holds {kind}, {token[bad]!r}, at position {bad}: a token is "
                         "one line of printable ASCII; check the file or variable it was read from")
    return token or None


#: what each file must hold: a CERTIFICATE block, or a PRIVATE KEY block (RSA, EC, PKCS#8, encrypted)
_BLOCK = {"certificate": re.compile(rb"-----BEGIN CERTIFICATE-----"),
          "private key": re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")}


def pem_problem(data: bytes, kind: str) -> str | None:
    """Why ``data`` is not a PEM file holding a ``kind`` (``"certificate"`` or ``"private key"``),
    as the end of a sentence about the file; ``None`` when it is one. (gRPC answers a CA file that
    holds no certificate, e.g. the private key swapped with it, only with ``UNAVAILABLE: ... Failed
    to create security handshaker`` when it connects, trial22.)"""
    first = re.search(rb"-----BEGIN ([A-Z0-9 ]{1,40})-----", data)
    if first is None:
        return "is not a PEM file (no '-----BEGIN ...' line)"
    if _BLOCK[kind].search(data) is None:
        return (f"holds no {kind} (its PEM block is '{first.group(1).decode()}'; were the certificate and the "
                "private key files swapped?)")
    return None


def read_pem(path, kind: str, name: str) -> bytes:
    """The bytes of the PEM file ``path``.

    :raises ValueError: it does not hold a ``kind`` (:func:`pem_problem`); the message starts with
        ``name`` (the parameter or option) and the path.
    :raises OSError: it cannot be read.
    """
    data = Path(path).read_bytes()
    if (why := pem_problem(data, kind)) is not None:
        raise ValueError(f"{name} {path} {why}")
    return data


def credentials(token: str | None, tls_ca, tls_cert, tls_key) -> grpc.ChannelCredentials | None:
    """Channel credentials for TLS (trusting ``tls_ca``; optional client certificate) and/or a
    bearer token (None: a plain-text channel). A token without TLS is sent in plain text (for
    loopback use), as call metadata. :raises OSError: a certificate or key file cannot be read.
    :raises ValueError: a file does not hold what it should (:func:`read_pem`)."""
    if tls_ca is None and tls_cert is None:
        return None  # no TLS (a token alone is sent as call metadata on the plain-text channel)
    ssl = grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls_ca, "certificate", "tls_ca") if tls_ca else None,
        private_key=read_pem(tls_key, "private key", "tls_key") if tls_key else None,
        certificate_chain=read_pem(tls_cert, "certificate", "tls_cert") if tls_cert else None,
    )
    if token is None:
        return ssl
    return grpc.composite_channel_credentials(ssl, grpc.access_token_call_credentials(token))


def target_problem(target: str) -> str | None:
    """Why ``target`` is not a gRPC target to dial, as a sentence; ``None`` when it is one.
    ``HOST:PORT`` (``[v6]:PORT`` too) must carry both a host and a port in 1-65535: gRPC dials
    port 443 for a host without a port (or with an empty one, ``HOST:``), reads port 99999 as
    34463 (modulo 65536) and an ``http://`` URL as a host name that does not resolve (trial22/23).
    Targets with a gRPC scheme (``unix:/path``, ``dns:///HOST:PORT``, ``ipv4:ADDR:PORT``) are left
    to gRPC."""
    scheme = re.match(r"(https?|grpcs?)://", target)
    if scheme:
        return f"give HOST:PORT without {scheme.group(0)}, e.g. 127.0.0.1:50051, got {target!r}"
    if not target.strip():
        return f"give HOST:PORT, e.g. 127.0.0.1:50051, got {target!r}"
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]*)(?::(\d*))?", target.strip())
    if m is None:
        return None  # a gRPC scheme (unix:, dns:, ipv4:, ...) or a name gRPC itself reports on
    host, port = m.group(1), m.group(2)
    if not host:
        return f"the host is missing: give HOST:PORT, e.g. 127.0.0.1:{port or 50051}, got {target!r}"
    if not port:  # (gRPC dialled port 443, trial22 / trial23)
        return (f"the port is missing: give HOST:PORT, e.g. {host}:50051 (the server's default port), "
                f"got {target!r}")
    if not 1 <= int(port) <= 65535:
        return f"the port must be in 1-65535, got {port} in {target!r}"
    return None


def open_channel(target: str, *, aio: bool, max_message_bytes: int, options=None, token: str | None = None,
                 tls_ca=None, tls_cert=None, tls_key=None) -> tuple[Any, tuple[tuple[str, str], ...] | None]:
    """A channel to ``target`` (``grpc.aio`` when ``aio``) with :func:`channel_options` and
    :func:`credentials`. :returns: ``(channel, metadata)``: the call metadata that carries the
    token on a plain-text channel (None otherwise: TLS call credentials carry it).
    :raises ValueError: a token gRPC cannot send (:func:`bearer_token`); a target without a host
        or a port (:func:`target_problem`)."""
    if (why := target_problem(target)) is not None:
        raise ValueError(f"target {why}")
    token = bearer_token(token)
    creds = credentials(token, tls_ca, tls_cert, tls_key)
    opts = channel_options(max_message_bytes, options)
    mod = grpc.aio if aio else grpc
    if creds is not None:
        return mod.secure_channel(target, creds, options=opts), None
    return mod.insecure_channel(target, options=opts), ((("authorization", f"Bearer {token}"),) if token else None)
