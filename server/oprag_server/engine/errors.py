"""The query executor's refusals (:mod:`oprag_server.engine.query` re-exports them)."""

from __future__ import annotations


class Overloaded(Exception):
    """A bounded queue is full; the caller should retry after ``retry_after_s``."""

    def __init__(self, queue: str, retry_after_s: float) -> None:
        super().__init__(f"the {queue} queue is full; retry after {retry_after_s:.2f} s")
        self.queue, self.retry_after_s = queue, retry_after_s


class QueryRejected(ValueError):
    """One request cannot be served as asked (e.g. its question exceeds the prompt budget)."""
