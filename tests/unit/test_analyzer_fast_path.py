"""The analyzer's fast paths (``findall`` of ``[^\\W_]+`` on normalised text without CJK, marks
or astral characters; the default-ignorable substitution skipped when no candidate is present)
give exactly the tokens of the general path (``_TOKEN_RE.finditer`` after the full
normalisation), on every code point and on mixed random text."""

from __future__ import annotations

import random
import unicodedata

import pytest

from oprag_server.index import analyzer as A
from oprag_server.index.analyzer import Analyzer


def reference(text: str, stemmer=None) -> list[str]:
    """The general path as it was before the fast paths: always substitute, always finditer."""
    if text.isascii():
        norm = text.lower()
    else:
        t = unicodedata.normalize("NFKC", A._IGNORABLE_RE.sub("", text)).casefold()
        norm = t if t.isascii() else A._IGNORABLE_RE.sub("", unicodedata.normalize("NFKC", t))
    stem = (lambda w: stemmer.stemWord(w)) if stemmer is not None else (lambda w: w)
    if norm.isascii():
        return [stem(w) for w in A._ASCII_RE.findall(norm)]
    out: list[str] = []
    for m in A._TOKEN_RE.finditer(norm):
        w = m.group("w")
        if w is not None:
            out.append(stem(w))
            continue
        run = m.group("c")
        for i in range(len(run) - 1):
            out.append(run[i])
            out.append(run[i : i + 2])
        out.append(run[-1])
    return out


def _texts_of_every_code_point(width: int = 48, ranges=((0, 0x110000),)):
    """Every code point of ``ranges`` (surrogates included), ``width`` at a time, each inside a
    Latin word, a Greek word, alone between spaces and next to a digit, so a character that
    joins, splits or vanishes inside a word shows."""
    for start, end in ranges:
        for lo in range(start, end, width):
            cps = [chr(c) for c in range(lo, min(lo + width, end))]
            yield " ".join(f"a{c}b \u03b1{c}\u03b2 {c} 7{c}" for c in cps)


def test_every_code_point_of_the_assigned_planes_matches_the_general_path():
    """Planes 0-2 and the tags / variation selectors of plane 14 (every assigned letter, mark,
    digit, space and default-ignorable); the unassigned planes 3-13 and 15-16: slow test below."""
    a = Analyzer()
    texts = _texts_of_every_code_point(ranges=((0, 0x30000), (0xE0000, 0xE1000)))
    bad = [t for t in texts if a.tokens(t) != reference(t)]
    assert not bad, bad[:3]


@pytest.mark.slow
def test_every_code_point_matches_the_general_path():
    a = Analyzer()
    bad = [t for t in _texts_of_every_code_point() if a.tokens(t) != reference(t)]
    assert not bad, bad[:3]


def test_fast_path_taken_and_skips_only_plain_words():
    # plain non-ASCII words (composed accents, Greek, dashes, quotes) take the findall path
    norm = A._normalize("Caf\u00e9 \u03b2-cells \u2013 \u201cna\u00efve\u201d x\u00b2")
    assert not norm.isascii() and not A._NOT_WORDS_ONLY_RE.search(norm)
    # a combining mark that NFKC cannot compose, a CJK character, an astral letter: general path
    for s in ("ka\u0951b", "a\u6771b", "a\U00010428b", "a\U000101fdb"):
        assert A._NOT_WORDS_ONLY_RE.search(A._normalize(s)), s
    assert Analyzer().tokens("ka\u0951b \u0915\u093f\u0924\u093e\u092c") == ["ka\u0951b", "\u0915\u093f\u0924\u093e\u092c"]


def _random_texts(n: int, seed: int = 7):
    rng = random.Random(seed)
    pools = [
        [chr(c) for c in range(0x20, 0x7F)],
        [chr(c) for c in range(0xA0, 0x250)],  # Latin-1, Latin extended
        [chr(c) for c in range(0x370, 0x400)],  # Greek
        [chr(c) for c in range(0x300, 0x370)],  # combining diacritics
        [chr(c) for c in range(0x900, 0x980)],  # Devanagari (marks inside words)
        [chr(c) for c in range(0x2000, 0x2070)],  # punctuation, spaces, ignorables
        [chr(c) for c in range(0x3040, 0x3100)] + [chr(c) for c in range(0x4E00, 0x4E40)],  # kana, Han
        ["\u00ad", "\u200b", "\u200d", "\u2060", "\ufeff", "\ufe0f", "\u180e", "\u034f", "\uffa0"],
        ["\U0001d400", "\U0001f600", "\U00020000", "\U000e0041", "\U000e0100", "\U0001b001"],
        ["\uff21", "\uff41", "\uff10", "\u2160", "\u00b2", "\ufb01", "\u0130", "\u00df", "\u212b"],
    ]
    for _ in range(n):
        k = rng.randint(1, 60)
        ws = rng.sample(range(len(pools)), rng.randint(1, 3))
        yield "".join(rng.choice(pools[rng.choice(ws)]) for _ in range(k))


@pytest.mark.parametrize("stem", [False, True])
def test_random_mixed_text_matches_the_general_path(stem):
    a = Analyzer(stem=stem)
    stemmer = a._stemmer if stem else None
    bad = [t for t in _random_texts(20000 if not stem else 8000) if a.tokens(t) != reference(t, stemmer)]
    assert not bad, [ascii(t) for t in bad[:3]]


def test_ignorable_check_is_exact_on_every_code_point():
    # the pre-check never misses a character the substitution removes
    every = "".join(chr(c) for c in range(0x110000))
    assert A._drop_ignorable(every) == A._IGNORABLE_RE.sub("", every)
    missed = [c for c in A.DEFAULT_IGNORABLE if not A._MAYBE_IGNORABLE_RE.search(chr(c))]
    assert not missed


def test_ascii_translate_split_equals_the_regex():
    rng = random.Random(11)
    a = Analyzer()
    every = "".join(chr(c) for c in range(128))
    texts = [every, every[::-1], "", " ", "_a_b_", "ABC-def GHI\tjkl\x00mno\x7f9"]
    texts += ["".join(rng.choice(every) for _ in range(rng.randint(0, 80))) for _ in range(20000)]
    for t in texts:
        assert a.tokens(t) == A._ASCII_RE.findall(t.lower()) == reference(t), ascii(t)
