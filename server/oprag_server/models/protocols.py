"""What the engine needs from an embedding model and from a text generator.

Two structural interfaces (``typing.Protocol``, runtime-checkable):

* :class:`Encoder` -- text -> L2-normalised ``float32`` vectors, with the tokenizer-level
  operations ingest needs (token counting, splitting over-long text). Implemented by
  :class:`~oprag_server.models.encoder.TransformersEncoder` and the fake
  :class:`~oprag_server.models.fakes.HashingEncoder`.
* :class:`Generator` -- prompt rendering, token counting and batched greedy decoding with a
  streaming callback. Implemented by :class:`~oprag_server.models.generator.HFGenerator` and
  the fake :class:`~oprag_server.models.fakes.EchoGenerator`.

Also the value types of the generator interface: :class:`GenerationResult` and the callback
types :data:`OnToken` and :data:`ShouldStop`. ``isinstance(x, Encoder)`` checks only that the
members exist (Python's runtime protocol check), not their signatures.

This module imports nothing heavy (no torch, no transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol, runtime_checkable

import numpy as np

#: ``on_token(row, text_delta)``: ``row`` is the prompt's index in the batch, ``text_delta``
#: the newly decoded text (never holds an incomplete UTF-8 sequence).
OnToken = Callable[[int, str], None]
#: ``should_stop(row) -> bool``: True cancels that row (its tokens so far are kept).
ShouldStop = Callable[[int], bool]

#: The ``finish_reason`` values of :class:`GenerationResult`.
FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class GenerationResult:
    """One row's completion.

    :param text: decoded completion (special tokens skipped; EOS not included).
    :param token_ids: generated token ids, EOS excluded.
    :param prompt_tokens: prompt length in tokens.
    :param completion_tokens: ``len(token_ids)``.
    :param finish_reason: ``"stop"`` (EOS produced), ``"length"`` (hit max_new_tokens) or
        ``"cancelled"`` (``should_stop(row)`` returned True).
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"


def validate_budgets(n: int, max_new_tokens: int | list[int]) -> list[int]:
    """Expand ``max_new_tokens`` (one int for all rows, or one per row) to ``n`` budgets.

    :returns: ``list[int]`` of length ``n``, each >= 0 (tokens).
    :raises ValueError: a list whose length is not ``n``, or a negative budget (row named).
    """
    if isinstance(max_new_tokens, int):
        budgets = [max_new_tokens] * n
    else:
        budgets = [int(x) for x in max_new_tokens]
        if len(budgets) != n:
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    for i, b in enumerate(budgets):
        if b < 0:
            raise ValueError(f"prompt {i}: max_new_tokens must be >= 0, got {b}")
    return budgets


@runtime_checkable
class Encoder(Protocol):
    """A sentence encoder as used by ingest (tokenize, split, embed) and by queries (embed).

    Attributes: ``name`` (str, reported by ``Stats`` and stored with the index), ``dim``
    (int, vector width), ``max_tokens`` (int, longest accepted input in tokens, special tokens
    included). An implementation may also set ``last_padded_tokens`` (int: token slots computed,
    padding included, by the last :meth:`encode_tokenized`); the embed worker's padding metric
    falls back to the real token count without it.

    Token ids are whatever the implementation's :meth:`tokenize` returns; they are only ever
    fed back to the same encoder's :meth:`encode_tokenized`.
    """

    name: str
    dim: int
    max_tokens: int

    def warm_up(self) -> None:
        """Load weights and tokenizer now (idempotent); every other method calls it lazily."""
        ...

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text, special tokens included, no padding; ``truncate`` cuts each
        to ``max_tokens``."""
        ...

    def token_lengths(self, texts: list[str]) -> list[int]:
        """Tokens per text, special tokens included, no truncation."""
        ...

    def split_to_fit(self, text: str) -> list[str]:
        """Consecutive non-empty pieces with ``"".join(pieces) == text``, each at most
        ``max_tokens`` tokens (``[text]`` if it fits)."""
        ...

    def encode(self, texts: list[str], truncate: bool = False) -> np.ndarray:
        """``float32[len(texts), dim]``, rows L2-normalised, input order.

        :raises ValueError: a text over ``max_tokens`` tokens and ``truncate`` False.
        """
        ...

    def encode_tokenized(self, ids: list[list[int]]) -> np.ndarray:
        """``float32[len(ids), dim]``, rows L2-normalised, from :meth:`tokenize` output.

        :raises ValueError: an id list longer than ``max_tokens`` (index named).
        """
        ...


@runtime_checkable
class Generator(Protocol):
    """A text generator as used by the reason operator (prompt building under a token
    budget) and the query engine's generator worker (batched greedy decoding).

    Attributes: ``name`` (str), ``max_context`` (int, prompt + completion tokens the model
    accepts; valid after :meth:`warm_up`).
    """

    name: str
    max_context: int

    def warm_up(self) -> None:
        """Load weights and tokenizer now (idempotent); every other method calls it lazily."""
        ...

    def chat_prompt(self, system: str, user: str) -> str:
        """Render a system + user turn as the model's prompt text (generation prompt added)."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` as :meth:`generate` counts prompt tokens."""
        ...

    def truncate_to_tokens(self, text: str, n: int) -> str:
        """Longest prefix of ``text`` with at most ``n`` tokens (``""`` for ``n <= 0``)."""
        ...

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int | list[int],
        on_token: OnToken | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[GenerationResult]:
        """Greedy-decode every prompt; rows finish independently.

        :param max_new_tokens: cap in tokens, one for all rows or one per row (see
            :func:`validate_budgets`).
        :param on_token: called from the decoding thread as each row's text grows; a row's
            deltas concatenate to its ``text``.
        :param should_stop: polled for unfinished rows; True finishes the row "cancelled".
        :returns: one :class:`GenerationResult` per prompt, in order.
        :raises ValueError: an empty prompt, a bad budget, or prompt + budget over
            ``max_context``.
        """
        ...


class EngineUnavailable(Exception):
    """The inference engine is down, unreachable or overloaded; retry after ``retry_after_s``
    seconds (gRPC ``UNAVAILABLE`` with trailer ``retry-after-ms``)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineRejected(ValueError):
    """The inference engine refused this request (HTTP 400/413/422: e.g. the prompt is too long
    for it); only this request fails (``INVALID_ARGUMENT``)."""


class EngineTimeout(Exception):
    """The inference engine did not finish within the per-request limit (``DEADLINE_EXCEEDED``)."""


@dataclass
class EngineUsage:
    """What an engine reported for one request (OpenAI ``usage``), in tokens.

    :param cached_tokens: prompt tokens the engine served from its prefix cache
        (``usage.prompt_tokens_details.cached_tokens``; 0 when it does not say).
    :param finish_reason: ``"stop"`` or ``"length"`` (``""`` until the engine said).
    :param attempts: HTTP requests made (> 1 when retried before the first token).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    attempts: int = 0


@runtime_checkable
class EngineGenerator(Protocol):
    """A generator backed by an inference engine that batches by itself (continuous batching):
    requests are streamed one by one (:meth:`stream`), at most ``max_inflight`` at once.

    Besides the text helpers of :class:`Generator` (``warm_up``, ``chat_prompt``,
    ``count_tokens``, ``truncate_to_tokens``, ``name``, ``max_context``) it has
    ``chat_messages(system, user) -> list[dict]`` (what is sent), ``healthy`` (bool),
    ``async probe() -> bool``, ``async aclose()`` and ``is_engine = True``.
    Implemented by :class:`~oprag_server.models.openai_engine.OpenAIGenerator` and
    :class:`~oprag_server.models.managed_engine.TransformersServeGenerator`.
    """

    name: str
    max_context: int
    max_inflight: int
    is_engine: bool

    def stream(self, messages: list[dict[str, str]], max_new_tokens: int, usage: EngineUsage,
               stop: tuple[str, ...] = ()) -> AsyncIterator[str]:
        """Text deltas as the engine produces them; ``usage`` filled in on the way; ``stop``: the request's stop
        strings, for the engine to end the answer at (the caller cuts the stream at them too: :mod:`..engine.stops`).

        :raises EngineUnavailable | EngineTimeout | ValueError: engine down or overloaded,
            too slow, or the request refused.
        """
        ...
