"""A repeated best-effort failure logged as a few lines, not one per request (trial57: a store that refused writes
gave 480 "memory promotion failed" WARNINGs, one per session turn, in a few minutes)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("oprag")


class FailureLog:
    """WARNING ``"<what> failed: <error>"`` for the first failure, then at most once per ``period_s`` seconds with the
    number of failures left out since; one INFO line when it succeeds again.

    :param what: what failed, e.g. ``"memory promotion"``.
    :param period_s: the shortest time between two WARNING lines (seconds)."""

    def __init__(self, what: str, period_s: float = 60.0) -> None:
        self.what, self.period_s = what, period_s
        self.last: float | None = None  # monotonic time of the last WARNING; None: not failing
        self.left_out = 0  # failures since that line
        self.total = 0  # failures since it started failing

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.total += 1
        if self.last is not None and now - self.last < self.period_s:
            self.left_out += 1
            return
        more = f" ({self.left_out} more since the last such line)" if self.left_out else ""
        log.warning("%s failed: %s%s", self.what, exc, more)
        self.last, self.left_out = now, 0

    def ok(self) -> None:
        if self.last is not None:
            log.info("%s succeeds again (after %d failures)", self.what, self.total)
        self.last, self.left_out, self.total = None, 0, 0
