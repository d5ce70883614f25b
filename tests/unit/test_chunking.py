"""Tests for oprag_server.operators.chunking.chunk_text."""

from __future__ import annotations

import pathlib
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from oprag_server.operators.chunking import chunk_text
except ImportError:  # package not installed in the venv: import from the source tree
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "server"))
    from oprag_server.operators.chunking import chunk_text


def lens(pieces):
    return [len(p) for p in pieces]


def test_cjk_903():
    text = "".join(chr(0x4E00 + i) for i in range(903))
    pieces = chunk_text(text)
    assert lens(pieces) == [900, 3]
    assert "".join(pieces) == text


def test_ascii_1801():
    text = "".join("abcdefghij"[i % 10] for i in range(1801))
    pieces = chunk_text(text)
    assert lens(pieces) == [900, 900, 1]
    assert "".join(pieces) == text


def test_ascii_1800():
    text = "x" * 1800
    assert lens(chunk_text(text)) == [900, 900]


def test_empty_and_short():
    assert chunk_text("") == []
    assert chunk_text("a") == ["a"]
    assert chunk_text("a" * 900) == ["a" * 900]


def test_astral_never_split():
    emoji = "\U0001F600\U0001F680\U00020000"  # 2 emoji + CJK ext-B ideograph
    text = (emoji * 400)[:1000]
    pieces = chunk_text(text, size=7)
    assert "".join(pieces) == text
    for p in pieces:
        # every piece is valid UTF-8 without surrogates: no code point was split
        p.encode("utf-8")
        assert all(ord(c) >= 0x10000 for c in p)
    assert lens(pieces)[:-1] == [7] * (len(pieces) - 1)


def test_overlap():
    assert chunk_text("abcdefg", 4, 2) == ["abcd", "cdef", "efg"]
    assert chunk_text("abcdefgh", 4, 2) == ["abcd", "cdef", "efgh"]  # no tiny "gh" window
    assert chunk_text("abcde", 4, 3) == ["abcd", "bcde"]
    text = "".join(chr(0x61 + i % 26) for i in range(2000))
    pieces = chunk_text(text, 900, 100)
    assert lens(pieces) == [900, 900, 400]
    assert pieces[1][:100] == pieces[0][-100:]
    assert pieces[-1] == text[1600:]


@pytest.mark.parametrize("size,overlap", [(0, 0), (-1, 0), (10, 10), (10, -1), (10, 11)])
def test_bad_args(size, overlap):
    with pytest.raises(ValueError):
        chunk_text("abc", size, overlap)


def test_bad_types():
    with pytest.raises(TypeError):
        chunk_text(b"abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        chunk_text("abc", 2.5)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.integers(1, 50))
def test_property_no_overlap(text, size):
    pieces = chunk_text(text, size)
    assert all(pieces)
    assert all(len(p) <= size for p in pieces)
    assert "".join(pieces) == text
    assert all(len(p) == size for p in pieces[:-1])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.integers(1, 50), st.data())
def test_property_overlap(text, size, data):
    overlap = data.draw(st.integers(0, size - 1))
    pieces = chunk_text(text, size, overlap)
    assert all(pieces) and all(len(p) <= size for p in pieces)
    if not text:
        assert pieces == []
        return
    step = size - overlap
    for i, p in enumerate(pieces):
        assert p == text[i * step : i * step + size]
    assert pieces[-1] == text[(len(pieces) - 1) * step :]  # last window ends at len(text)
    if len(pieces) > 1:  # the last window adds something beyond the previous one
        assert (len(pieces) - 2) * step + size < len(text)
