"""Retry with backoff for unary RPCs, the usual gRPC client convention: retry ``UNAVAILABLE`` and
``RESOURCE_EXHAUSTED`` only, waiting the server's ``retry-after-ms`` trailer when it sent one
(plus a random share of up to as much again, so that clients refused together do not all come
back together and be refused together again), else an exponential backoff with full jitter
(``uniform(0, min(max_backoff_s, initial_backoff_s * multiplier**attempt))``, the AWS "full
jitter" scheme). Streaming calls (Ingest, QueryStream)
are never retried: their request stream cannot be replayed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import grpc

T = TypeVar("T")
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """:param max_attempts: calls in all (1 = no retry). Times in seconds."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0

    def delay(self, exc: Exception, attempt: int) -> float | None:
        """Seconds to wait before retry number ``attempt + 1`` (0-based ``attempt``), or None when
        ``exc`` is not retryable or the attempts are spent."""
        code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
        if code not in RETRYABLE or attempt + 1 >= self.max_attempts:
            return None
        trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        for key, value in trailers or ():
            if key == "retry-after-ms":
                try:
                    after = int(value) / 1000
                except ValueError:
                    break
                return min(self.max_backoff_s, after + random.uniform(0, after))
        return random.uniform(0, min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt))


NO_RETRY = RetryPolicy(max_attempts=1)


def call(policy: RetryPolicy, fn: Callable[[], T], sleep: Callable[[float], Any] = time.sleep) -> T:
    """``fn()``, retried under ``policy``. :raises grpc.RpcError: the last failure."""
    attempt = 0
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            d = policy.delay(exc, attempt)
            if d is None:
                raise
            sleep(d)
            attempt += 1


async def acall(policy: RetryPolicy, fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()``, retried under ``policy``. :raises grpc.aio.AioRpcError: the last failure."""
    attempt = 0
    while True:
        try:
            return await fn()
        except grpc.RpcError as exc:
            d = policy.delay(exc, attempt)
            if d is None:
                raise
            await asyncio.sleep(d)
            attempt += 1


def nothing_stored(exc: Any) -> bool:
    """Whether a failed Ingest call provably stored nothing: its status carries the server's trailer
    ``oprag-stored: none`` (the stream failed before its commit began, whatever the status code: an
    ``UNAVAILABLE`` shard refused it; trial48 #18), the connection was never made (``UNAVAILABLE``
    "failed to connect"), or gRPC refused a message over its size limit ("larger than max": the stream
    cannot commit without it; trial50b). False otherwise (a connection lost: the outcome may be unknown)."""
    try:
        code, details = exc.code(), exc.details() or ""
    except Exception:  # noqa: BLE001 - (an error without a status)
        return False
    if (code.name == "UNAVAILABLE" and "failed to connect" in details.lower()) or \
            (code.name == "RESOURCE_EXHAUSTED" and "larger than max" in details):
        return True
    try:
        md = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - (an error without trailers: a transport's own)
        return False
    return any(k == "oprag-stored" and v == "none" for k, v in md)
