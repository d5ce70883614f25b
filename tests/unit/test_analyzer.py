"""Tests for oprag_server.index.analyzer.Analyzer."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from oprag_server.index.analyzer import Analyzer
except ImportError:  # package not installed in the venv: import from the source tree
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "server"))
    from oprag_server.index.analyzer import Analyzer

SERVER_DIR = str(pathlib.Path(__file__).resolve().parents[2] / "server")


def test_composed_decomposed_match():
    a = Analyzer()
    composed = "caf\u00e9 na\u00efve"
    decomposed = "cafe\u0301 nai\u0308ve"
    assert composed != decomposed
    assert a.tokens(composed) == a.tokens(decomposed) == ["caf\u00e9", "na\u00efve"]
    # Hangul: precomposed syllable vs conjoining jamo
    syl = "\ud55c"
    jamo = unicodedata.normalize("NFD", syl)
    assert len(jamo) == 3
    assert a.tokens(syl) == a.tokens(jamo) == [syl]


def test_case_folding_and_compat():
    a = Analyzer()
    assert a.tokens("Hello WORLD hello") == ["hello", "world", "hello"]
    assert a.tokens("CAF\u00c9") == a.tokens("caf\u00e9")
    assert a.tokens("Stra\u00dfe") == a.tokens("STRASSE") == ["strasse"]
    assert a.tokens("\uff21\uff22\uff23 \uff11\uff12") == ["abc", "12"]  # full-width
    assert a.tokens("\u0391\u0398\u0397\u039d\u0391") == a.tokens("\u03b1\u03b8\u03b7\u03bd\u03b1")


def test_word_splitting():
    a = Analyzer()
    assert a.tokens("snake_case, x-ray! 3.14") == ["snake", "case", "x", "ray", "3", "14"]
    assert a.tokens("") == []
    assert a.tokens("  ...!!  ") == []
    # combining vowel signs keep Devanagari words whole
    assert a.tokens("\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e") == [
        "\u0939\u093f\u0928\u094d\u0926\u0940",
        "\u092d\u093e\u0937\u093e",
    ]
    with pytest.raises(TypeError):
        a.tokens(b"bytes")  # type: ignore[arg-type]


def test_cjk_unigrams_and_bigrams():
    a = Analyzer()
    assert a.tokens("\u6771\u4eac\u90fd") == [
        "\u6771", "\u6771\u4eac", "\u4eac", "\u4eac\u90fd", "\u90fd"
    ]
    assert a.tokens("abc\u6771\u4eac def") == ["abc", "\u6771", "\u6771\u4eac", "\u4eac", "def"]


@pytest.mark.parametrize(
    "doc,query",
    [
        ("\u79c1\u306f\u6771\u4eac\u90fd\u306b\u4f4f\u3093\u3067\u3044\u307e\u3059", "\u4eac\u90fd"),
        ("\u6211\u559c\u6b22\u5b66\u4e60\u4e2d\u6587\u548c\u6570\u5b66", "\u4e2d\u6587"),
        ("\u30c7\u30fc\u30bf\u30d9\u30fc\u30b9\u691c\u7d22", "\u30d9\u30fc"),
        ("\ud55c\uad6d\uc5b4\ud14d\uc2a4\ud2b8\uac80\uc0c9", "\ud14d\uc2a4"),
        ("\uff83\uff9e\uff70\uff80\uff8d\uff9e\uff70\uff7d", "\u30d9\u30fc"),  # half-width doc
    ],
)
def test_cjk_substring_matchable(doc, query):
    a = Analyzer()
    d = set(a.tokens(doc))
    q = a.tokens(query)
    assert len(query) == 2
    assert query in d or unicodedata.normalize("NFKC", query) in d
    assert set(q) <= d  # every query token (unigrams + the bigram) occurs in the doc


def test_cjk_non_substring_bigram_misses():
    a = Analyzer()
    d = set(a.tokens("\u6771\u4eac\u90fd"))
    assert "\u90fd\u6771" not in d


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_deterministic_and_idempotent(text):
    a, b = Analyzer(), Analyzer()
    t = a.tokens(text)
    assert t == b.tokens(text) == a.tokens(text)
    assert all(t)
    # analysing the NFD / upper-cased form gives the same tokens
    assert a.tokens(unicodedata.normalize("NFD", text)) == t


def test_deterministic_across_processes():
    text = "Caf\u00e9 \u6771\u4eac\u90fd \u0939\u093f\u0928\u094d\u0926\u0940 ABC_def"
    code = (
        "import sys; sys.path.insert(0, %r);"
        "from oprag_server.index.analyzer import Analyzer;"
        "print(repr(Analyzer().tokens(%r)))" % (SERVER_DIR, text)
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert outs == {repr(Analyzer().tokens(text)) + "\n"}


def test_stemming():
    pytest.importorskip("snowballstemmer")
    a = Analyzer(stem=True)
    assert a.tokens("Running runs RUN") == ["run", "run", "run"]
    assert a.tokens("connections connected") == ["connect", "connect"]
    assert a.tokens("\u6771\u4eac running") == ["\u6771", "\u6771\u4eac", "\u4eac", "run"]
    assert Analyzer(stem=False).tokens("Running") == ["running"]
    assert a.tokens("caf\u00e9s") == a.tokens("cafe\u0301s")


def test_stem_missing_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "snowballstemmer", None)  # makes import fail
    with pytest.raises(ImportError, match="pip install snowballstemmer"):
        Analyzer(stem=True)
    Analyzer(stem=False).tokens("fine")  # no stemming needed: no error
