"""``StreamDetokenizer`` (models/decoding.py): the text a streamed answer adds per token, over a byte-level
tokenizer (each id one UTF-8 byte, decoded with replacement: what byte-level BPE does with an incomplete
sequence). An incomplete character is held back until a later token completes it; at the end (``flush``, a length
cut) it is dropped, never shown as U+FFFD (trial51 #3). Inputs: mixed-script strings and random byte cuts."""

from __future__ import annotations

import random

import pytest

from oprag_server.models.decoding import StreamDetokenizer


class _Bytes:
    """A tokenizer whose ids are the bytes of the UTF-8 text."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", "replace")


TEXTS = ["Что ест европейский омар?", "🦞 lobster 🦞", "naïve café 東京", "plain ascii", "ع" * 5 + "x"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_cut_streams_the_complete_characters_and_drops_a_cut_one(text):
    data = text.encode()
    for cut in range(1, len(data) + 1):
        d = StreamDetokenizer()
        pieces = [d.push(_Bytes, b) for b in data[:cut]]
        pieces.append(d.flush(_Bytes))
        got = "".join(pieces)
        want = data[:cut].decode("utf-8", "ignore")  # the whole characters of the cut
        assert got == want and d.text == got and "\ufffd" not in got, (text, cut, got)


def test_random_utf8_streams_the_same_text_as_a_whole_decode():
    rng = random.Random(5)
    alphabet = "aé東🦞ж\u0301 "
    for _ in range(200):
        data = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))).encode()
        cut = rng.randint(1, len(data))
        d = StreamDetokenizer()
        got = "".join(d.push(_Bytes, b) for b in data[:cut]) + d.flush(_Bytes)
        assert got == data[:cut].decode("utf-8", "ignore")
