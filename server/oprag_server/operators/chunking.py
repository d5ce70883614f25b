"""Chunking on natural boundaries, measured in the embedder's tokens.

The splitting itself is done by the ``semantic-text-splitter`` package (``TextSplitter``, Rust):
it cuts at the largest semantic unit that lets a chunk fit, in this order of preference

1. runs of newlines (a longer run is a higher level: ``"\\n\\n"`` paragraphs before ``"\\n"`` lines),
2. sentence boundaries (Unicode UAX #29),
3. word boundaries (UAX #29),
4. grapheme cluster boundaries, then code points -- reached only by a single word longer than
   a chunk, the one thing ever cut inside,

and merges neighbouring units up to the capacity. So ``"a " * 448 + "photosynthesis"`` keeps
``photosynthesis`` whole, and a code point (or an ``"e"`` + U+0301 cluster) is never split.

Size unit: with a ``tokenizers.Tokenizer`` (the embedder's, :meth:`Chunker.for_model`) a chunk's
size is its token count *as the embedder counts it, special tokens included* (``[CLS]``/``[SEP]``
for MiniLM), and no chunk exceeds ``min(size, max_tokens)``: nothing has to be split again or
truncated before embedding. Without a tokenizer sizes are Unicode code points.

Whitespace (documented, tested): chunks are trimmed (``chunk == chunk.strip()``), so ``"".join(chunks)`` equals the input
with the whitespace between chunks removed; every chunk is a substring of the input, and with
``overlap == 0`` the text between two consecutive chunks (and before the first / after the last)
is whitespace only. A piece with no visible character (only whitespace, control characters and
Unicode Default_Ignorable code points, :func:`~oprag_server.index.analyzer.has_visible_content`) is not
a chunk. No chunk is empty.

Large documents (windows): the splitter's time grows faster than a text's length (measured on
this project's 2-core machine, MiniLM at 256 tokens: CJK without spaces or punctuation 0.14 s for
8 K characters, 1.2 s for 32 K, 4.6 s for 64 K, 93 s for 256 K; one giant word 0.16 s for 256 K,
2.2 s for 1 M; prose stays at about 0.6 M characters/s). A text longer than
:data:`WINDOW_THRESHOLD` characters (code points) is therefore cut into windows of at most
:data:`WINDOW_CHARS` characters, each ending at the strongest boundary in its last half -- a
paragraph break (``"\n\n"``), else a line break, else a sentence end (``.!?`` before whitespace,
or ``。！？｡．``), else whitespace, else a grapheme cluster boundary (the splitter's own, found
on the window's last 1,024 characters; a single cluster longer than 256 code points is cut between
code points, as the splitter cuts it too) -- and each window is chunked by the same splitter, its
spans offset. Texts up to the threshold get exactly the chunks of one call. Every guarantee above
holds for windowed texts too (a window edge is a chunk edge, and the windows cover the text), but
chunk boundaries near a window's edge can differ from what one unwindowed call would give (a
window's last chunk can be short), and chunks do not overlap across a window edge. The time is then
linear in the text's length; :meth:`Chunker.spans` can also stop between windows (``should_stop``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from semantic_text_splitter import TextSplitter

from ..index.analyzer import has_visible_content

__all__ = ["Chunker", "ChunkingStopped", "chunk_text", "window_ends"]


#: Counted chunks hold at most this many characters per token of capacity (see Chunker).
CHARS_PER_TOKEN_CAP = 16
#: ... and never capped below this many characters (small chunk sizes keep whole words).
MIN_CHAR_CAP = 2048

#: Texts longer than this many code points are chunked in windows (module docstring). Up to it,
#: the worst kind measured (CJK without spaces or punctuation) takes 1.2 s in one call, and
#: windows would save little (0.8 s); every text up to it gets exactly one call's chunks.
WINDOW_THRESHOLD = 32_768
#: Largest window, code points; a window ends at the strongest boundary in its last half. 16 K
#: keeps CJK without punctuation at ~40 K characters/s (32 K windows: 28 K/s; 8 K: 58 K/s) while
#: prose windows hold ~16 chunks of 256 tokens (the edges add about one short chunk per window).
WINDOW_CHARS = 16_384

_PARAGRAPH = re.compile(r"\n[^\S\n]*\n")
_SENTENCE_END = re.compile(r"[.!?][\"'\u2019\u201d)\]]*(?=\s)|[\u3002\uff01\uff1f\uff61\uff0e]")
_SPACE = re.compile(r"\s")
_GRAPHEME_TAIL = 1024


class ChunkingStopped(Exception):
    """:meth:`Chunker.spans` was told to stop (``should_stop()`` returned true between windows)."""


def _last_end(pattern: re.Pattern[str], text: str, lo: int, hi: int) -> int:
    """End of the last match of ``pattern`` within ``text[lo:hi]``, or -1."""
    end = -1
    for m in pattern.finditer(text, lo, hi):
        end = m.end()
    return end


def window_ends(text: str, window: int = WINDOW_CHARS) -> list[int]:
    """Where :meth:`Chunker.spans` cuts a long ``text`` into windows: increasing ends, the last ``len(text)``.

    Each window ``text[a:b]`` has ``0 < b - a <= window`` code points and ends at the strongest
    boundary in its last half (module docstring): after a paragraph break, else after a line
    break, else after a sentence end, else after a whitespace character, else at a grapheme cluster
    boundary found by the splitter on the window's last 1,024 code points.

    :param text: ``str``. :param window: largest window, code points, ``>= 2 * 1024``.
    :returns: ``list[int]`` of window ends.
    """
    ends = []
    a, n = 0, len(text)
    while n - a > window:
        lo, hi = a + window // 2, a + window
        b = text.rfind("\n\n", lo, hi)
        b = b + 2 if b >= 0 else _last_end(_PARAGRAPH, text, lo, hi)
        if b < 0:
            b = text.rfind("\n", lo, hi)
            b = b + 1 if b >= 0 else -1
        if b < 0:
            b = _last_end(_SENTENCE_END, text, lo, hi)
        if b < 0:
            b = _last_end(_SPACE, text, lo, hi)
        if b <= a:  # no whitespace in the last half: the last grapheme boundary the splitter finds
            t0 = hi - _GRAPHEME_TAIL
            starts = [j for j, _ in TextSplitter(_GRAPHEME_TAIL // 4).chunk_indices(text[t0:hi]) if j > 0]
            b = t0 + starts[-1] if starts else hi
        ends.append(b)
        a = b
    ends.append(n)
    return ends


class Chunker:
    """Split texts into chunks of at most ``size`` units on natural boundaries (module docstring).

    Args:
        size: maximum chunk size, > 0: tokens including the embedder's special tokens (with
            ``tokenizer`` or ``counter``), else code points.
        overlap: units that consecutive chunks may share (upper bound; the splitter overlaps
            whole units), ``0 <= overlap < size``.
        tokenizer: a ``tokenizers.Tokenizer`` to count with, or None for code points. A copy is
            used, with truncation and padding switched off.
        max_tokens: the embedder's window in tokens, special tokens included; ``size`` above it
            is lowered to it. Only with ``tokenizer`` or ``counter``.
        counter: instead of ``tokenizer``, a function ``str -> int`` giving a text's token count
            without special tokens (slower: called from the splitter for every candidate).
        n_special: special tokens the embedder adds to each text, with ``counter``.

    Raises:
        TypeError: ``size`` / ``overlap`` / ``max_tokens`` not int.
        ValueError: ``size <= 0``, ``overlap`` not in ``[0, size)``, or no room left for text
            once the special tokens are counted (``min(size, max_tokens) <= n_special``).

    Attributes: ``size`` (int, effective maximum per chunk, special tokens included),
    ``overlap`` (int), ``n_special`` (int, 0 when counting code points), ``capacity`` (int, text units
    per chunk: ``size - n_special``).
    """

    def __init__(self, size: int, overlap: int = 0, *, tokenizer: Any = None, max_tokens: int | None = None,
                 counter: Callable[[str], int] | None = None, n_special: int = 0) -> None:
        for name, v in (("size", size), ("overlap", overlap), ("max_tokens", max_tokens), ("n_special", n_special)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{name} must be int, got {type(v).__name__}")
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        if not 0 <= overlap < size:
            raise ValueError(f"overlap must be in [0, size={size}), got {overlap}")
        self.n_special = n_special if counter is not None else 0
        if (tokenizer is not None or counter is not None) and max_tokens is not None:
            size = min(size, max_tokens)
        if tokenizer is not None:
            import copy

            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.no_truncation()
            tokenizer.no_padding()
            self.n_special = int(tokenizer.num_special_tokens_to_add(False))
        self.size = size
        self.capacity = size - self.n_special
        if self.capacity <= 0:
            raise ValueError(f"chunk size {size} leaves no room for text next to {self.n_special} special tokens")
        self.overlap = min(overlap, self.capacity - 1)
        # the splitter counts tokens without special tokens: hence capacity = size - n_special
        if tokenizer is not None:
            self._splitter = TextSplitter.from_huggingface_tokenizer(tokenizer, self.capacity, self.overlap, trim=True)
        elif counter is not None:
            self._splitter = TextSplitter.from_callback(counter, self.capacity, self.overlap, trim=True)
        else:
            self._splitter = TextSplitter(self.capacity, self.overlap, trim=True)
        # A token counter can see a long run of characters as one token (WordPiece maps a word
        # over 100 characters, e.g. base64 or a minified line, to a single [UNK]), so a chunk
        # could hold megabytes while counting a few tokens. Counted chunks are therefore also
        # capped at CHARS_PER_TOKEN_CAP characters per token of capacity (at least MIN_CHAR_CAP), far above natural text
        # (English runs about 4-5 characters per MiniLM token), and cut again on boundaries.
        self.max_chars = (max(self.capacity * CHARS_PER_TOKEN_CAP, MIN_CHAR_CAP)
                          if (tokenizer is not None or counter is not None) else 0)
        self._char_splitter = TextSplitter(self.max_chars, trim=True) if self.max_chars else None

    @classmethod
    def for_model(cls, path: Any, max_tokens: int, size: int, overlap: int = 0) -> Chunker:
        """Chunker counting with the fast tokenizer of the Hugging Face model directory ``path``
        (loaded as :class:`~oprag_server.models.encoder.TransformersEncoder` loads it).

        :param path: model directory (``TransformersEncoder.path``).
        :param max_tokens: the embedder's window (``TransformersEncoder.max_tokens``).
        :raises ValueError: the directory has no fast tokenizer, or as :class:`Chunker`.
        """
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(str(path))
        if not getattr(hf_tok, "is_fast", False):
            raise ValueError(f"{path}: no fast tokenizer (tokenizer.json) to count chunk tokens with")
        return cls(size, overlap, tokenizer=hf_tok.backend_tokenizer, max_tokens=max_tokens)

    @classmethod
    def for_encoder(cls, encoder: Any, size: int, overlap: int = 0) -> Chunker:
        """Chunker counting as ``encoder`` does: its Hugging Face tokenizer when it has a model
        directory (``encoder.path``, :meth:`for_model`), else its ``token_lengths`` (e.g.
        :class:`~oprag_server.models.encoder.HashingEncoder`).

        :param encoder: has ``max_tokens`` and ``path`` or ``token_lengths(list[str]) -> list[int]``
            (special tokens included).
        """
        path = getattr(encoder, "path", None)
        if path is not None:
            return cls.for_model(path, encoder.max_tokens, size, overlap)
        n_special = int(encoder.token_lengths([""])[0])
        return cls(size, overlap, max_tokens=encoder.max_tokens, n_special=n_special,
                   counter=lambda text: encoder.token_lengths([text])[0] - n_special)

    def __repr__(self) -> str:
        return f"Chunker(size={self.size}, overlap={self.overlap}, n_special={self.n_special})"

    def spans(self, text: str, should_stop: Callable[[], bool] | None = None) -> list[tuple[int, str]]:
        """``(start, chunk)`` pairs in text order, ``text[start:start + len(chunk)] == chunk``.

        A text over :data:`WINDOW_THRESHOLD` code points is chunked window by window (module docstring).

        :param text: any ``str``.
        :param should_stop: called before each window of a long text (not for a text up to the
            threshold, one native call that cannot be interrupted); when it returns true, stop.
        :returns: ``[]`` when ``text`` has no visible character.
        :raises TypeError: ``text`` is not a ``str``.
        :raises ChunkingStopped: ``should_stop()`` returned true.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if len(text) <= WINDOW_THRESHOLD:
            return self._spans(text)
        out: list[tuple[int, str]] = []
        a = 0
        for b in window_ends(text):
            if should_stop is not None and should_stop():
                raise ChunkingStopped(f"chunking stopped at character {a} of {len(text)}")
            out.extend((a + i, c) for i, c in self._spans(text[a:b]))
            a = b
        return out

    def _spans(self, text: str) -> list[tuple[int, str]]:
        """:meth:`spans` of one splitter call (no windows)."""
        out = []
        for i, c in self._splitter.chunk_indices(text):
            if self._char_splitter is not None and len(c) > self.max_chars:
                pieces = [(i + j, p) for j, p in self._char_splitter.chunk_indices(c)]
            else:
                pieces = [(i, c)]
            for k, p in pieces:
                if has_visible_content(p):
                    # the splitter trims Unicode White_Space; str.strip also takes U+001C..U+001F
                    out.append((k + len(p) - len(p.lstrip()), p.strip()))
        return out

    def chunks(self, text: str, should_stop: Callable[[], bool] | None = None) -> list[str]:
        """The chunks of ``text`` (see :meth:`spans`, also for ``should_stop``), ``list[str]``."""
        return [c for _, c in self.spans(text, should_stop)]

    __call__ = chunks


def chunk_text(text: str, size: int = 900, overlap: int = 0, tokenizer: Any = None) -> list[str]:
    """One-off :meth:`Chunker.chunks`: ``Chunker(size, overlap, tokenizer=tokenizer).chunks(text)``.

    With ``tokenizer=None`` sizes are code points (e.g. ``chunk_text("aa bb cc", 5)`` ->
    ``["aa bb", "cc"]``). Building a :class:`Chunker` once is cheaper for many texts.

    :raises TypeError, ValueError: as :class:`Chunker` and :meth:`Chunker.spans`.
    """
    return Chunker(size, overlap, tokenizer=tokenizer).chunks(text)
