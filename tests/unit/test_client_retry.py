"""Client retry/backoff (oprag_client.retry): which codes are retried, retry-after-ms, attempts."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from oprag_client.retry import NO_RETRY, RetryPolicy, acall, call


class Err(grpc.RpcError):
    def __init__(self, code, trailers=()):
        self._code, self._trailers = code, trailers

    def code(self):
        return self._code

    def trailing_metadata(self):
        return self._trailers


def _flaky(errors, result="ok"):
    errs = list(errors)

    def fn():
        if errs:
            raise errs.pop(0)
        return result

    return fn


def test_retries_unavailable_and_exhausted_honouring_retry_after():
    slept = []
    fn = _flaky([Err(grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after-ms", "250"),)), Err(grpc.StatusCode.UNAVAILABLE)])
    assert call(RetryPolicy(max_attempts=3, initial_backoff_s=0.1), fn, sleep=slept.append) == "ok"
    assert 0.25 <= slept[0] <= 0.5 and 0 <= slept[1] <= 0.2  # retry-after plus jitter; then backoff 0.1 * 2**1


def test_other_codes_and_spent_attempts_raise():
    with pytest.raises(Err) as ei:
        call(RetryPolicy(), _flaky([Err(grpc.StatusCode.INVALID_ARGUMENT)]), sleep=lambda s: None)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Err):
        call(RetryPolicy(max_attempts=2), _flaky([Err(grpc.StatusCode.UNAVAILABLE)] * 2), sleep=lambda s: None)
    with pytest.raises(Err):
        call(NO_RETRY, _flaky([Err(grpc.StatusCode.UNAVAILABLE)]))


def test_async_retry():
    fn = _flaky([Err(grpc.StatusCode.UNAVAILABLE)])

    async def afn():
        return fn()

    assert asyncio.run(acall(RetryPolicy(initial_backoff_s=0.001), afn)) == "ok"
