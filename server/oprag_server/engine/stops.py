"""Stop sequences: an answer ends where the first of its stop strings is complete, cut just before that string.

"First" is in the order the text is generated: the occurrence that ends earliest (generation stops there, so no
later text exists); of two that end at the same character, the longer one (the earlier start) is cut. This
depends only on the text, not on how it was split into deltas.

The semantics of OpenAI's chat ``stop`` (up to 4 strings; the returned text does not contain the stop string, and
``finish_reason`` is ``"stop"``), for every generator: the builtin one's rows are cut here as their text grows (and
leave the batch at the next poll of ``should_stop``); an engine (``--generator openai`` / ``transformers-serve``) gets
the strings in its request, and its stream is cut here too, so an engine that ignores them still ends the answer.

Streaming: a text delta is passed on only up to where no stop string can begin; the tail that could be the start of
one is held until the next delta decides it (or the end of the answer releases it). So the concatenated stream is
always exactly the final answer, and no part of a stop string is ever sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: at most this many stop strings a request (OpenAI's limit)
MAX_STOPS = 4
#: characters a stop string may have at most
MAX_STOP_CHARS = 256


def stop_strings(values: Sequence[str], error: type[Exception] = ValueError) -> tuple[str, ...]:
    """Validated stop strings (``GenerationOptions.stop``), duplicates dropped, order kept.

    :raises error: more than :data:`MAX_STOPS`, an empty one, or one over :data:`MAX_STOP_CHARS` characters (the
        message says what to change; the service passes its ``INVALID_ARGUMENT`` error).
    """
    if len(values) > MAX_STOPS:
        raise error(f"stop has {len(values)} strings; at most {MAX_STOPS} are allowed: send fewer")
    out = tuple(dict.fromkeys(values))
    for s in out:
        if not s:
            raise error("stop must not hold an empty string: remove it")
        if len(s) > MAX_STOP_CHARS:
            raise error(f"stop has a string of {len(s)} characters; the limit is {MAX_STOP_CHARS}: shorten it")
    return out


class StopCut:
    """One answer's text cut at its first stop string (see the module docstring).

    :param stops: the stop strings (non-empty; none: the text passes unchanged).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # the answer so far (cut at the stop string once :attr:`hit`)
        self.sent = 0  # characters of it passed on
        self.hit = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; :returns: the text that may be passed on now (possibly "")."""
        if self.hit or not delta:
            return ""
        if not self.stops:
            self.text += delta
            self.sent = len(self.text)
            return delta
        self.text += delta
        # a stop string cannot begin in the text passed on (its held tail covered every possible start); the
        # earliest occurrence of each string is its earliest end: the first to end wins, the longer on a tie
        ends = [(i + len(s), i) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if ends:
            self.hit, self.text = True, self.text[:min(ends)[1]]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def _held(self) -> int:
        """Characters at the end of the text that are a proper prefix of some stop string (held back)."""
        t, most = self.text, 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(t) - self.sent), most, -1):
                if t.endswith(s[:n]):
                    most = n
                    break
        return most

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def flush(self) -> str:
        """The end of the answer: :returns: the held text (the answer was not cut there)."""
        return self._release(len(self.text))


class StopCuts:
    """The builtin generator's batch: one :class:`StopCut` a row, between the decoding thread and ``on_text``.

    :param stops: each row's stop strings. :param on_text: ``on_text(row, text)`` for the text to pass on (called
        from the decoding thread). :param cancelled: ``cancelled(row)``: the request went away.
    """

    def __init__(self, stops: Sequence[Sequence[str]], on_text: Callable[[int, str], None],
                 cancelled: Callable[[int], bool]) -> None:
        self.rows = [StopCut(s) for s in stops]
        self.on_text, self.cancelled = on_text, cancelled

    def emit(self, row: int, delta: str) -> None:
        """The generator's ``on_token``."""
        out = self.rows[row].feed(delta)
        if out:
            self.on_text(row, out)

    def should_stop(self, row: int) -> bool:
        """The generator's ``should_stop``: cancelled, or cut at a stop string."""
        return self.rows[row].hit or self.cancelled(row)

    def result(self, row: int, text: str, finish_reason: str) -> tuple[str, str, str]:
        """``(answer, finish_reason, held text to pass on)`` of a row the generator returned with ``text``."""
        cut = self.rows[row]
        if cut.hit:
            return cut.text, "stop", ""
        return text, finish_reason, cut.flush()
