"""Pure query scheduler: state in, decision out. No sockets, threads, clocks or CUDA inside.

The executor (:mod:`oprag_server.engine.query`) feeds it the queue length and the age of the
oldest waiting request and carries out what it returns; tests drive it with made-up numbers.
It also compiles a request into its *plan*: the operator chain with each operator's resource
domain, as plain data that can be logged, traced and compared.
"""

from __future__ import annotations

import functools
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
    """One operator of a query plan.

    ``op`` is the operator's one name: the plan, the trace, the key in ``timings_ms`` and the
    ``stage`` label of ``oprag_stage_seconds`` all use it (README: operator table).
    ``domain`` is the resource the operator runs on (shard processes, a worker thread, the
    frontend's event loop).
    """

    op: str
    domain: str


#: Prep batches in flight at once with an engine backend and overlap (1 otherwise): while one
#: waits for the shards the next builds its prompts on the frontend, so a slow shard round
#: trip does not leave the engine without prepared requests.
PREP_INFLIGHT = 2

MEMORY, EMBED, RETRIEVE, CONTEXT, GENERATE, PROMOTE = "memory", "embed", "retrieve", "context", "generate", "promote"

#: Every query operator, in execution order.
QUERY_OPERATORS: tuple[PlanStep, ...] = (
    PlanStep(MEMORY, "shard"),  # session memory lookup
    PlanStep(EMBED, "embed-worker"),  # query embedding
    PlanStep(RETRIEVE, "shard+frontend"),  # shard search, global merge, fusion, hit fields
    PlanStep(CONTEXT, "frontend-cpu"),  # the prompt: numbered sources under the token budget
    PlanStep(GENERATE, "generator-worker"),  # batched decoding
    PlanStep(PROMOTE, "shard"),  # the answered turn written into session memory
)
_ORDER = {s.op: i for i, s in enumerate(QUERY_OPERATORS)}


@functools.lru_cache(maxsize=None)  # (8 argument combinations: the plans are built once)
def compile_plan(*, memory: bool, generate: bool, embed: bool = True) -> tuple[PlanStep, ...]:
    """The operator chain of one query request, in execution order.

    :param memory: the request has a session with memory on: look it up first, promote the
        turn last.
    :param generate: the request wants an answer (context + generate).
    :param embed: the request needs its query embedded (False when it brings its own vector).
    """
    want = {MEMORY: memory, EMBED: embed, RETRIEVE: True, CONTEXT: generate, GENERATE: generate, PROMOTE: memory}
    return tuple(s for s in QUERY_OPERATORS if want[s.op])


@functools.lru_cache(maxsize=64)  # (a plan is one of compile_plan's few)
def split_plan(plan: tuple[PlanStep, ...]) -> tuple[tuple[PlanStep, ...], tuple[PlanStep, ...]]:
    """``(prep, answer)``: the steps before ``generate`` (run by the prep loop, overlapping the
    previous batch's generation) and the steps from ``generate`` on (run once the answer exists;
    for a request that does not generate, right after prep)."""
    cut = _ORDER[GENERATE]
    return tuple(s for s in plan if _ORDER[s.op] < cut), tuple(s for s in plan if _ORDER[s.op] >= cut)


def batch_steps(plans: list[tuple[PlanStep, ...]]) -> tuple[PlanStep, ...]:
    """The steps a batch runs: the union of its requests' plans in operator order. Each step
    runs once for the batch, over the requests whose plan lists it."""
    return _union_steps(frozenset(plans))


@functools.lru_cache(maxsize=256)
def _union_steps(plans: frozenset) -> tuple[PlanStep, ...]:
    ops = {s.op for p in plans for s in p}
    return tuple(s for s in QUERY_OPERATORS if s.op in ops)
