"""Pure query scheduler: state in, decision out. No sockets, threads, clocks or CUDA inside.

The executor (:mod:`oprag_server.engine.query`) feeds it the queue length and the age of the
oldest waiting request and carries out what it returns; tests drive it with made-up numbers.
It also compiles a request into its *plan*: the operator chain with each operator's resource
domain, as plain data that can be logged, traced and compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchDecision:
    """``take`` requests now (0 = none), else check again after ``wait_s`` seconds."""

    take: int
    wait_s: float


@dataclass(frozen=True)
class BatchPolicy:
    """A batch closes when ``max_batch`` requests wait or the oldest has waited ``max_wait_s``.

    :param max_batch: >= 1 requests per batch.
    :param max_wait_s: >= 0 seconds the first request of a batch may wait for company.
    """

    max_batch: int
    max_wait_s: float

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")

    def decide(self, queue_len: int, oldest_age_s: float, downstream_busy: bool = True,
               will_generate: bool = False) -> BatchDecision:
        """:param downstream_busy: whether the generator still works on an earlier batch.
        :param will_generate: whether the oldest waiting request goes on to the generator.

        A retrieval-only batch with an idle generator closes at once: waiting for company would
        only add latency to a few-millisecond request. A batch that will generate waits up to
        ``max_wait_s`` even when the generator is idle: a generation step costs the same for
        one row as for several on a compute-bound device, and closed-loop clients whose answers
        just finished together resubmit within milliseconds -- closing at once split them into
        a batch of 1 followed by a batch of the rest.
        """
        if queue_len <= 0:
            return BatchDecision(0, math.inf)
        if (queue_len >= self.max_batch or oldest_age_s >= self.max_wait_s
                or not (downstream_busy or will_generate)):
            return BatchDecision(min(queue_len, self.max_batch), 0.0)
        return BatchDecision(0, self.max_wait_s - oldest_age_s)


@dataclass(frozen=True)
class PlanStep:
    op: str
    domain: str


def compile_plan(*, memory: bool, generate: bool) -> tuple[PlanStep, ...]:
    """The operator chain of one query request (a workflow segment), in execution order."""
    steps = []
    if memory:
        steps.append(PlanStep("memory", "shard"))
    steps += [PlanStep("embed", "embed-worker"), PlanStep("retrieve", "shard+frontend")]
    if generate:
        steps += [PlanStep("reason", "frontend-cpu"), PlanStep("generate", "generator-worker")]
    if memory:
        steps.append(PlanStep("upsert", "shard"))  # promotion of the turn into memory
    return tuple(steps)
