"""Deterministic, dependency-free test doubles for the model protocols.

* :class:`HashingEncoder` -- an :class:`~oprag_server.models.protocols.Encoder`: hashed
  bag-of-words vectors, BERT-like token counting (2 special tokens per text).
* :class:`EchoGenerator` -- a :class:`~oprag_server.models.protocols.Generator`: answers with
  the first words of the last ``[source ...]`` block of the prompt; one word is one token.

For unit tests and benches of components that need *some* model, not a particular one.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from .protocols import GenerationResult, OnToken, ShouldStop, validate_budgets

_WORD_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class HashingEncoder:
    """Deterministic fake encoder: lower-cased word/punctuation tokens hashed (blake2b) into
    ``dim`` signed buckets, L2-normalised. Implements
    :class:`~oprag_server.models.protocols.Encoder`.

    Token ids are ``[1] + [hash(tok) % 30000 + 2 ...] + [1]`` (1 plays both CLS and SEP), so
    ``token_lengths`` counts 2 special tokens like BERT.

    :param dim: vector dimension (> 0).
    :param max_tokens: limit in tokens, special tokens included (> 2).
    """

    name = "hashing"

    def __init__(self, dim: int = 64, max_tokens: int = 256) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be > 0, got {dim}")
        if max_tokens <= 2:
            raise ValueError(f"max_tokens must be > 2, got {max_tokens}")
        self.dim = int(dim)
        self.max_tokens = int(max_tokens)
        self.batch_size = 32
        self.device = "cpu"

    def warm_up(self) -> None:
        """No-op."""

    @staticmethod
    def _h(token: str) -> int:
        digest = hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Ids per text (specials included); ``truncate`` cuts to ``max_tokens``."""
        out = []
        for t in texts:
            body = [self._h(w) % 30000 + 2 for w in _WORD_RE.findall(t.lower())]
            if truncate:
                body = body[: self.max_tokens - 2]
            out.append([1] + body + [1])
        return out

    def token_lengths(self, texts: list[str]) -> list[int]:
        """Tokens per text, 2 special tokens included."""
        return [len(x) for x in self.tokenize(texts)]

    def split_to_fit(self, text: str) -> list[str]:
        """Consecutive non-empty pieces, each within ``max_tokens``; joined == text."""
        budget = self.max_tokens - 2
        spans = [m.start() for m in _WORD_RE.finditer(text)]
        if len(spans) <= budget:
            return [text]
        cuts = [spans[k] for k in range(budget, len(spans), budget)]
        bounds = [0] + cuts + [len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    def encode(self, texts: list[str], truncate: bool = False) -> np.ndarray:
        """``float32[len(texts), dim]``, L2-normalised; ValueError (index named) if too long."""
        return self.encode_tokenized(self.tokenize(texts, truncate=truncate))

    def encode_tokenized(self, ids: list[list[int]]) -> np.ndarray:
        """``float32[len(ids), dim]`` from ids of :meth:`tokenize`."""
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        for i, seq in enumerate(ids):
            if len(seq) > self.max_tokens:
                raise ValueError(
                    f"text {i} has {len(seq)} tokens > max_tokens={self.max_tokens}"
                )
            for t in seq[1:-1]:
                h = self._h(str(t))
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
            norm = float(np.linalg.norm(out[i]))
            if norm > 0:
                out[i] /= norm
            else:
                out[i, 0] = 1.0
        return out


_SOURCE_RE = re.compile(r"\[source[^\]]*\]\s*(.*?)(?=\n\s*\[source|\Z)", re.S | re.I)


class EchoGenerator:
    """Deterministic fake generator; implements
    :class:`~oprag_server.models.protocols.Generator`.

    The "answer" is the first words of the last ``[source ...]`` block in the prompt (or of
    the prompt's last line when there is none); one whitespace-separated word is one token.
    ``finish_reason`` is ``"stop"`` when the answer ran out before ``max_new_tokens``.

    :param answer_words: words taken from the source (default 12).
    :param max_context: reported context length in tokens (words).
    """

    name = "echo"

    def __init__(self, answer_words: int = 12, max_context: int = 8192) -> None:
        self.answer_words = answer_words
        self.max_context = max_context
        self.device = "cpu"

    def warm_up(self) -> None:
        """No-op."""

    def chat_prompt(self, system: str, user: str) -> str:
        """``"<system>\\n\\n<user>\\n\\nAnswer:"``."""
        return f"{system}\n\n{user}\n\nAnswer:" if system else f"{user}\n\nAnswer:"

    def count_tokens(self, text: str) -> int:
        """Whitespace-separated words."""
        return len(text.split())

    def truncate_to_tokens(self, text: str, n: int) -> str:
        """Prefix of ``text`` with at most ``n`` words."""
        if n <= 0:
            return ""
        words = list(re.finditer(r"\S+", text))
        if len(words) <= n:
            return text
        return text[: words[n].start()]

    def _answer(self, prompt: str) -> list[str]:
        blocks = _SOURCE_RE.findall(prompt)
        src = blocks[-1] if blocks else ""
        if not src.strip():
            lines = [ln for ln in prompt.replace("Answer:", "").splitlines() if ln.strip()]
            src = lines[-1] if lines else ""
        return src.split()[: self.answer_words]

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int | list[int],
        on_token: OnToken | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[GenerationResult]:
        """Same contract as :meth:`oprag_server.models.protocols.Generator.generate`
        (token ids are word indices)."""
        budgets = validate_budgets(len(prompts), max_new_tokens)
        out = []
        for i, p in enumerate(prompts):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
            words = self._answer(p)
            pieces: list[str] = []
            reason = "stop"
            for k, w in enumerate(words):
                if k >= budgets[i]:
                    reason = "length"
                    break
                if should_stop is not None and should_stop(i):
                    reason = "cancelled"
                    break
                delta = w if k == 0 else " " + w
                pieces.append(delta)
                if on_token is not None:
                    on_token(i, delta)
            else:
                if budgets[i] == 0:
                    reason = "length"
            ids = list(range(len(pieces)))
            out.append(
                GenerationResult(
                    text="".join(pieces),
                    token_ids=ids,
                    prompt_tokens=self.count_tokens(p),
                    completion_tokens=len(ids),
                    finish_reason=reason,
                )
            )
        return out
