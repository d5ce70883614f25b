"""Bearer-token authentication as a grpc.aio server interceptor, and TLS credentials.

Clients send ``authorization: Bearer <token>`` metadata. Tokens come from a file (one per
line; ``#`` starts a comment at the start of a line or after a blank) and/or the ``OPRAG_TOKENS`` environment variable (comma-separated). The
standard health service stays open so that orchestrators can probe without a token.
"""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path

import grpc

OPEN_METHODS_PREFIX = ("/grpc.health.v1.Health/",)
_COMMENT = re.compile(r"\s+#")


def load_tokens(path: Path | None, env: str = "OPRAG_TOKENS") -> set[str]:
    """Tokens from ``path`` and the environment. :raises ValueError: a token file with no token."""
    tokens = {t.strip() for t in os.environ.get(env, "").split(",") if t.strip()}
    if path is not None:
        # a comment is a line starting with "#" or "#" after a blank: a token holding "#" stays whole
        # (it was cut there, so "abc#def" let the shorter token "abc" in and refused "abc#def" itself)
        lines = [_COMMENT.split(ln.strip(), 1)[0].strip() for ln in Path(path).read_text().splitlines()]
        found = {ln for ln in lines if ln and not ln.startswith("#")}
        if not found:
            raise ValueError(f"{path}: no token in the file")
        tokens |= found
    return tokens


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: set[str]) -> None:
        self.tokens = [t.encode() for t in tokens]

    def _ok(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                v = value.encode() if isinstance(value, str) else value
                if v[:7].lower() == b"bearer ":
                    got = v[7:].strip()
                    return any(hmac.compare_digest(got, t) for t in self.tokens)
        return False

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS_PREFIX) or self._ok(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        msg = "missing or invalid bearer token: send 'authorization: Bearer <token>' metadata"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
            yield  # pragma: no cover - makes this an async generator

        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny, **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny, **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca`` clients must present a certificate it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=Path(client_ca).read_bytes(),
                                       require_client_auth=True)
