"""``startup.warm_beside``: the models warm up while the shard start runs, both run to the end,
and the first failure is raised only then (``serve`` cleans up a fully started pool)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from oprag_server.startup import warm_beside


class _Model:
    def __init__(self, log: list, name: str, delay: float = 0.0, fail: bool = False) -> None:
        self.log, self.name, self.delay, self.fail = log, name, delay, fail

    def warm_up(self) -> None:
        self.log.append((self.name, "begin", threading.current_thread() is threading.main_thread()))
        time.sleep(self.delay)
        if self.fail:
            raise ValueError(f"{self.name} failed")
        self.log.append((self.name, "end", None))


def _run(encoder, generator, start_delay: float, start_fail: bool = False):
    log: list = []
    encoder.log = log
    if generator is not None:
        generator.log = log

    def start() -> str:
        log.append(("shards", "begin", None))
        time.sleep(start_delay)
        if start_fail:
            raise RuntimeError("shard start failed")
        log.append(("shards", "end", None))
        return "started"

    async def main():
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        try:
            await warm_beside(encoder, generator, loop.run_in_executor(None, start))
            return None, time.perf_counter() - t, log
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            return exc, time.perf_counter() - t, log

    return asyncio.run(main())


def test_warm_up_runs_beside_the_shard_start_off_the_event_loop() -> None:
    err, took, log = _run(_Model([], "enc", 0.3), _Model([], "gen", 0.2), start_delay=0.5)
    assert err is None
    assert took < 0.85  # beside: ~max(0.5, 0.3 + 0.2) = 0.5 s, not their sum 1.0 s
    assert [e[:2] for e in log if e[0] != "shards"] == [("enc", "begin"), ("enc", "end"), ("gen", "begin"), ("gen", "end")]
    assert all(main is False for _n, what, main in log if what == "begin" and _n != "shards")
    assert ("shards", "end", None) in log


def test_a_failed_warm_up_waits_for_the_shard_start_then_raises() -> None:
    err, took, log = _run(_Model([], "enc", 0.05, fail=True), _Model([], "gen"), start_delay=0.4)
    assert isinstance(err, ValueError) and "enc failed" in str(err)
    assert ("shards", "end", None) in log  # the pool finished starting: serve's clean-up stops it
    assert took >= 0.4
    assert not [e for e in log if e[0] == "gen"]  # no generator warm-up after a failed encoder


def test_a_failed_shard_start_is_raised_after_the_warm_up() -> None:
    err, _took, log = _run(_Model([], "enc", 0.3), None, start_delay=0.05, start_fail=True)
    assert isinstance(err, RuntimeError) and "shard start failed" in str(err)
    assert ("enc", "end", None) in log


@pytest.mark.parametrize("warm_fails", [True, False])
def test_the_warm_up_failure_comes_first_when_both_fail(warm_fails: bool) -> None:
    err, _took, _log = _run(_Model([], "enc", 0.1, fail=warm_fails), None, start_delay=0.1, start_fail=True)
    assert isinstance(err, ValueError if warm_fails else RuntimeError)
