"""Tests for oprag_server.index.analyzer.Analyzer."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from oprag_server.index.analyzer import Analyzer
except ImportError:  # package not installed in the venv: import from the source tree
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "server"))
    from oprag_server.index.analyzer import Analyzer

from oprag_server.index import bm25 as B  # noqa: E402
from oprag_server.index.analyzer import DEFAULT_IGNORABLE, has_visible_content, strip_ignorable  # noqa: E402

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


# --- Default_Ignorable_Code_Point (issue 15, items 1 and 6) ----------------------------------

# DerivedCoreProperties.txt 15.1.0, "Derived Property: Default_Ignorable_Code_Point", verbatim
# ranges ("Total code points: 4174"); the analyzer derives its set from the property's
# definition instead, and must arrive at exactly this list.
PUBLISHED_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180D), (0x180E, 0x180E), (0x180F, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
    (0x2060, 0x2064), (0x2065, 0x2065), (0x2066, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0000, 0xE0000), (0xE0001, 0xE0001), (0xE0002, 0xE001F), (0xE0020, 0xE007F),
    (0xE0080, 0xE00FF), (0xE0100, 0xE01EF), (0xE01F0, 0xE0FFF),
)

ISSUE_DOCS = [
    "Das Gesamt\u00adkonzept wurde gestern vorgestellt.",  # soft hyphen
    "Wiki\u200bpedia is a free online encyclopedia.",  # zero-width space
    "Inter\u2060national shipping rates changed on Tuesday.",  # word joiner
    "Please send the con\ufb01rmation letter today.",  # fi ligature (NFKC)
]
ISSUE_EXPECTED = {  # query -> (document index, rank_bm25 BM25Okapi score), from the issue
    "Gesamtkonzept": (0, 0.9001316762),
    "Wikipedia": (1, 0.8310384132),
    "International": (2, 0.8310384132),
}


def test_default_ignorable_set_matches_published_property():
    published = {cp for lo, hi in PUBLISHED_DEFAULT_IGNORABLE for cp in range(lo, hi + 1)}
    assert len(published) == 4174
    assert DEFAULT_IGNORABLE == published
    # the definition's subtractions stay visible: Arabic number sign, interlinear annotations,
    # Egyptian hieroglyph format controls, and whitespace
    for cp in (0x0600, 0x06DD, 0xFFF9, 0x13430, 0x0020, 0x00A0, 0x3000):
        assert cp not in DEFAULT_IGNORABLE


def test_issue_case_words_joined_and_scored_like_rank_bm25():
    from rank_bm25 import BM25Okapi

    a = Analyzer()
    corpus = [a.tokens(d) for d in ISSUE_DOCS]
    assert corpus[0][1] == "gesamtkonzept" and corpus[1][0] == "wikipedia"
    assert corpus[2][0] == "international" and "confirmation" in corpus[3]
    ref = BM25Okapi(corpus)  # rank_bm25 defaults k1=1.5, b=0.75, epsilon=0.25 = ours
    index = B.PostingsIndex()
    for slot, toks in enumerate(corpus):
        index.add(slot, toks)
    stats = B.CorpusStats.merge_full([index.full_stats()])
    slots = np.arange(len(corpus), dtype=np.int64)
    for q, (doc, want) in ISSUE_EXPECTED.items():
        qt = a.tokens(q)
        expected = np.zeros(len(corpus))
        expected[doc] = want
        np.testing.assert_allclose(ref.get_scores(qt), expected, rtol=0, atol=1e-10)
        got = index.score(slots, qt, stats.query_idf(qt, 0.25), stats.avgdl, 1.5, 0.75)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)


def test_every_ignorable_is_removed_everywhere_in_the_pipeline():
    a = Analyzer()
    for cp in sorted(DEFAULT_IGNORABLE):
        c = chr(cp)
        assert a.tokens(f"Wiki{c}pedia") == ["wikipedia"], hex(cp)
        assert a.tokens(f"\u6771{c}\u4eac") == ["\u6771", "\u6771\u4eac", "\u4eac"], hex(cp)
        assert not has_visible_content(c + " " + c)
    # a combining mark after an ignorable still composes with the letter before it
    assert a.tokens("cafe\u200b\u0301") == a.tokens("caf\u00e9") == ["caf\u00e9"]
    # NFKC maps HALFWIDTH HANGUL FILLER onto HANGUL FILLER: both ignorable
    assert a.tokens("\uffa0ab\u3164c") == ["abc"]


def test_strip_ignorable_and_visible_content():
    assert strip_ignorable("Gesamt\u00adkonzept\ufe0f") == "Gesamtkonzept"
    assert strip_ignorable("plain ascii") == "plain ascii"
    for empty in ("", " \n\t", "\u200b", "\u200b\u2060", "\u00ad\ufeff\u200b", "\U000e0041\ufe0f \u180e",
                  "\x00\x01\x02", "\x7f\x1b \x00", "\x85\x9f\u200b\x00"):  # control characters (Cc) too
        assert not has_visible_content(empty), ascii(empty)
    for visible in ("a", "...", "\u200ba", "\u0600", "\U0001f600", "\x00a", "\x01~", "\x9f\xa1"):
        assert has_visible_content(visible), ascii(visible)


_IGNORABLES = sorted(DEFAULT_IGNORABLE)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(max_size=40), min_size=1, max_size=5),
    st.text(max_size=20),
    st.data(),
)
def test_property_ignorable_insertions_change_nothing(docs, query, data):
    """Random text with random Default_Ignorable insertions analyses and scores exactly as
    without them (documents and query both)."""

    def sprinkle(text: str) -> str:
        n = data.draw(st.integers(0, 6))
        out = list(text)
        for _ in range(n):
            pos = data.draw(st.integers(0, len(out)))
            out.insert(pos, chr(data.draw(st.sampled_from(_IGNORABLES))))
        return "".join(out)

    a = Analyzer()
    clean = [a.tokens(strip_ignorable(d)) for d in docs]
    dirty = [a.tokens(sprinkle(d)) for d in docs]
    assert dirty == clean
    q_clean, q_dirty = a.tokens(strip_ignorable(query)), a.tokens(sprinkle(query))
    assert q_dirty == q_clean
    scores = []
    for corpus, q in ((clean, q_clean), (dirty, q_dirty)):
        index = B.PostingsIndex()
        for slot, toks in enumerate(corpus):
            index.add(slot, toks)
        stats = B.CorpusStats.merge_full([index.full_stats()])
        slots = np.arange(len(corpus), dtype=np.int64)
        scores.append(index.score(slots, q, stats.query_idf(q, 0.25), stats.avgdl, 1.5, 0.75))
    assert scores[0].tobytes() == scores[1].tobytes()  # bit-identical


def test_visible_content_stops_early_but_means_strip_then_strip():
    """``has_visible_content`` (an early-exit scan) equals its definition
    ``bool(strip_ignorable(text)`` less control characters ``.strip())`` on every code point
    alone, and on random mixes of whitespace, control characters, ignorables and visible
    characters (ASCII and not)."""
    import random

    ref = lambda t: bool("".join(c for c in strip_ignorable(t) if unicodedata.category(c) != "Cc").strip())  # noqa: E731
    for c in map(chr, range(0x110000)):
        assert has_visible_content(c) == ref(c), hex(ord(c))
    spaces = [c for c in map(chr, range(0x3001)) if c.isspace()]
    pool = (spaces + [chr(x) for x in sorted(DEFAULT_IGNORABLE)[:300]] + list("ab.é字") + ["\uffa0", "\u3164"]
            + list("\x00\x01\x1b\x7f\x85\x9f"))
    rng = random.Random(13)
    seen = set()
    for _ in range(50_000):
        t = "".join(rng.choice(pool) for _ in range(rng.randint(0, 6)))
        assert has_visible_content(t) == ref(t), repr(t)
        seen.add(ref(t))
    assert seen == {True, False}
