"""Answers only from retrieved evidence: a request whose prompt has no sources is not generated.

OpRAG answers from the numbered sources the ``context`` operator places in the prompt. When a
request gets none (an empty store, every document deleted, a filter that matches nothing, or no
hit that fits the prompt budget) a generator would answer from its own weights alone, which is
an answer without evidence (trial16: "completed in 1999" with zero sources, where the deleted
document said 1887). With ``--answer-without-sources refuse`` (the default) such a request
skips ``generate``: its reply has an empty ``answer``, no sources, ``prompt_tokens`` and
``completion_tokens`` 0 and ``finish_reason`` :data:`NO_SOURCES`; its other steps (session
memory promotion) run as for a retrieval-only request. ``generate`` keeps the former behaviour.

Either way each such request is counted in ``oprag_answers_without_sources_total{action}``
(``refused`` or ``generated``); a refused one is not counted by any generate-stage metric (it
never runs the ``generate`` step).
"""

from __future__ import annotations

from typing import Any

from .job import QueryJob
from .scheduler import GENERATE

#: ``finish_reason`` of a request that was not generated because its prompt had no sources.
NO_SOURCES = "no_sources"
#: Values of ``--answer-without-sources``: refuse (the default) or generate anyway.
POLICIES = ("refuse", "generate")


def without_sources(job: QueryJob, policy: str, metrics: Any) -> bool:
    """After the ``context`` step: when ``job`` would generate from a prompt with no sources,
    count it and, under ``policy`` ``"refuse"``, drop ``generate`` from its plan and answer it
    as :data:`NO_SOURCES` (answer "", 0 tokens, no prompt: ``payload`` None).

    :param policy: one of :data:`POLICIES` (``GenerateConfig.answer_without_sources``).
    :param metrics: has ``answers_without_sources`` (a Counter labelled ``action``).
    :returns: whether the request was refused (it will not generate).
    """
    if job.payload is None or job.payload.sources or not job.runs(GENERATE):
        return False
    refuse = policy != "generate"
    metrics.answers_without_sources.labels(action="refused" if refuse else "generated").inc()
    if refuse:
        job.plan = tuple(s for s in job.plan if s.op != GENERATE)
        job.payload, job.answer, job.completion_tokens, job.finish_reason = None, "", 0, NO_SOURCES
    return refuse
