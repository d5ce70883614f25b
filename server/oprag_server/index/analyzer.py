"""Text analyzer shared by indexing and querying (BM25 lexical side).

One :class:`Analyzer` instance (or two with the same ``stem`` flag) must be used for
both the documents and the queries: the BM25 score only matches tokens that are equal
strings, so every normalisation step below applies identically on both sides.

Pipeline of :meth:`Analyzer.tokens`:

0. Removal of every ``Default_Ignorable_Code_Point`` (Unicode property, UAX #44; see
   :func:`strip_ignorable`): soft hyphen U+00AD, zero-width space U+200B, ZWNJ/ZWJ, word
   joiner U+2060, BOM U+FEFF, bidi controls, variation selectors, U+180E, U+034F, tag
   characters, ...  They are invisible and do not separate words, so ``"Wiki\\u200Bpedia"``
   analyses as ``["wikipedia"]`` (NFKC_Casefold of UAX #15/#31 also maps them to nothing,
   and the embedder's tokenizer drops them too).
1. Unicode normalisation ``NFKC`` (``unicodedata.normalize``), then ``str.casefold``,
   then ``NFKC`` again (casefolding can produce non-normalised sequences, e.g.
   ``"İ".casefold() == "i\u0307"``; the second pass makes the result stable).  This is
   the "NFKC_Casefold" idea of Unicode TR #15 / TR #31, approximated with the standard
   library.  Consequences: ``"é"`` written as U+00E9 and as ``"e"`` + U+0301 yield the
   same token (NFKC composes), full-width ``"ＡＢＣ"`` == ``"abc"``, ``"Straße"`` ==
   ``"strasse"``, half-width katakana == full-width katakana.
2. Tokenisation.  A *word* token is a maximal run of Unicode letters/digits (Python's
   ``[^\\W_]``, i.e. ``\\w`` without the underscore) that may also contain combining
   marks (general category ``M*``, so Devanagari/Thai vowel signs do not split words).
   Everything else (whitespace, punctuation, symbols, ``_``) separates tokens.
3. Scripts written without spaces -- Han (CJK ideographs), Hiragana, Katakana and
   Hangul -- are cut out of the letter runs.  Each maximal run of such characters is
   emitted as character unigrams AND adjacent-character bigrams, interleaved by
   position: ``"東京都"`` -> ``["東", "東京", "京", "京都", "都"]``.  A query that is any
   substring (of length >= 1) of an indexed run therefore shares tokens with it.
   A letter run that mixes scripts (``"abc東京"``) is split at the script boundary
   into ``"abc"`` and the CJK run.
4. Optional English stemming (``stem=True``): word tokens (not the CJK n-grams) go
   through the Snowball English (Porter2) stemmer of the ``snowballstemmer`` package,
   imported lazily.  It is an optional dependency: constructing ``Analyzer(stem=True)``
   without it raises ``ImportError``.

The output is a ``list[str]`` in text order; it is a pure function of ``(text, stem)``
(deterministic across runs and processes: no hashing, no locale dependence).  The
length of that list is the BM25 document length ``|D|`` (unit: tokens).

Fast paths: pure-ASCII text skips normalisation (NFKC and casefold are the identity /
``str.lower`` on ASCII) and uses an ASCII-only precompiled regex; normalised text without CJK,
combining marks or astral characters is split by one ``findall`` of ``[^\\W_]+`` (the same
tokens as step 2 there), and the default-ignorable removal is skipped when a BMP-bitmap check
finds no candidate. Both give exactly the general path's tokens
(tests/unit/test_analyzer_fast_path.py: every code point, mixed random text, stemmed or not).
"""

from __future__ import annotations

import re
import sys
import unicodedata

__all__ = ["Analyzer", "DEFAULT_IGNORABLE", "has_visible_content", "strip_ignorable"]

# Scripts written without spaces between words.  NFKC maps half-width katakana
# (U+FF66..U+FF9F) and compatibility ideographs to these blocks before matching.
_CJK_RANGES = (
    "\u1100-\u11ff"  # Hangul Jamo
    "\u2e80-\u2fdf"  # CJK radicals supplement, Kangxi radicals (NFKC maps most away)
    "\u3005\u3007"  # ideographic iteration mark, ideographic number zero
    "\u3021-\u3029\u3038-\u303b"  # Hangzhou numerals, more iteration marks
    "\u3040-\u309f"  # Hiragana
    "\u30a0-\u30ff"  # Katakana (includes prolonged sound mark U+30FC)
    "\u3130-\u318f"  # Hangul compatibility Jamo
    "\u31f0-\u31ff"  # Katakana phonetic extensions
    "\u3400-\u4dbf"  # CJK unified ideographs extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\ua960-\ua97f"  # Hangul Jamo extended-A
    "\uac00-\ud7af"  # Hangul syllables
    "\ud7b0-\ud7ff"  # Hangul Jamo extended-B
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\uff66-\uff9f"  # half-width katakana (normally removed by NFKC)
    "\uffa0-\uffdc"  # half-width Hangul (normally removed by NFKC)
)
_CJK_BMP = _CJK_RANGES
_CJK_RANGES += (
    "\U0001b000-\U0001b16f"  # Kana supplement / extended-A / small kana extension
    "\U00020000-\U0003134f"  # CJK extensions B..G, compatibility supplement
)


def _mark_cps() -> list[int]:
    """Every combining mark (Unicode category ``M*``), ascending.

    Marks only occur in planes 0, 1 and 14 (U+E0100..U+E01EF variation selectors), so
    only those are scanned (~25 ms once, at import).
    """
    return [
        cp
        for lo, hi in ((0, 0x20000), (0xE0000, 0xE1000))
        for cp in range(lo, min(hi, sys.maxunicode + 1))
        if unicodedata.category(chr(cp))[0] == "M"
    ]


def _range(a: int, b: int) -> str:
    return re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"


# --- Default_Ignorable_Code_Point -------------------------------------------------------
# Unicode DerivedCoreProperties.txt (15.0/15.1/16.0) defines the property as
#   # Derived Property: Default_Ignorable_Code_Point
#   #  Generated from
#   #    Other_Default_Ignorable_Code_Point
#   #  + Cf (Format characters)
#   #  + Variation_Selector
#   #  - White_Space
#   #  - FFF9..FFFB (Interlinear annotation format characters)
#   #  - 13430..1343F (Egyptian hieroglyph format characters)
#   #  - Prepended_Concatenation_Mark (Exceptional format characters that should be visible)
# Python's unicodedata has no property lookup, so the set is built from that definition:
# Cf comes from unicodedata.category (the interpreter's Unicode version), the contributory
# properties are copied from PropList.txt (Unicode 15.1, unchanged in 16.0).
_OTHER_DEFAULT_IGNORABLE = (  # PropList.txt: Other_Default_Ignorable_Code_Point
    (0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x2065, 0x2065), (0x3164, 0x3164),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0xE0000, 0xE0000), (0xE0002, 0xE001F),
    (0xE0080, 0xE00FF), (0xE01F0, 0xE0FFF),
)
_VARIATION_SELECTOR = (  # PropList.txt: Variation_Selector
    (0x180B, 0x180D), (0x180F, 0x180F), (0xFE00, 0xFE0F), (0xE0100, 0xE01EF),
)
_PREPENDED_CONCATENATION_MARK = (  # PropList.txt: Prepended_Concatenation_Mark
    (0x0600, 0x0605), (0x06DD, 0x06DD), (0x070F, 0x070F), (0x0890, 0x0891), (0x08E2, 0x08E2),
    (0x110BD, 0x110BD), (0x110CD, 0x110CD),
)
_NOT_IGNORABLE = ((0xFFF9, 0xFFFB), (0x13430, 0x1343F)) + _PREPENDED_CONCATENATION_MARK


def _default_ignorable() -> frozenset[int]:
    """Code points with Default_Ignorable_Code_Point=Yes (definition above; ~4,170 of them)."""
    cps = {cp for lo, hi in _OTHER_DEFAULT_IGNORABLE + _VARIATION_SELECTOR for cp in range(lo, hi + 1)}
    # Cf occurs in planes 0, 1 and 14 only
    for lo, hi in ((0, 0x20000), (0xE0000, 0xE1000)):
        cps.update(cp for cp in range(lo, hi) if unicodedata.category(chr(cp)) == "Cf")
    cps.difference_update(cp for cp in list(cps) if chr(cp).isspace())  # - White_Space
    for lo, hi in _NOT_IGNORABLE:
        cps.difference_update(range(lo, hi + 1))
    return frozenset(cps)


def _class_of(cps) -> str:
    """Regex character-class body for a set of code points (merged ranges)."""
    parts: list[str] = []
    run: list[int] = []
    for cp in sorted(cps):
        if run and cp == run[-1] + 1:
            run[-1] = cp
        else:
            if run:
                parts.append(_range(*run))
            run = [cp, cp]
    if run:
        parts.append(_range(*run))
    return "".join(parts)


DEFAULT_IGNORABLE: frozenset[int] = _default_ignorable()
_IGNORABLE_RE = re.compile(f"[{_class_of(DEFAULT_IGNORABLE)}]+")
# A class with ranges above U+FFFF is matched by ``re`` range by range for every character
# outside its BMP bitmap (~20x slower than a BMP-only class): the fast checks below hold the BMP
# part of a class plus the whole astral range as one range, so "no hit" proves the text has none
# of the class's characters, and a hit only sends it to the exact, slower path.
_ASTRAL = "\U00010000-\U0010ffff"
_MAYBE_IGNORABLE_RE = re.compile(f"[{_class_of(cp for cp in DEFAULT_IGNORABLE if cp < 0x10000)}{_ASTRAL}]")


def _drop_ignorable(text: str) -> str:
    """``_IGNORABLE_RE.sub("", text)`` (the same string), skipping the slow substitution when the
    text has no candidate character."""
    return _IGNORABLE_RE.sub("", text) if _MAYBE_IGNORABLE_RE.search(text) else text


def strip_ignorable(text: str) -> str:
    """``text`` without its Default_Ignorable_Code_Point characters (see :data:`DEFAULT_IGNORABLE`).

    ASCII text is returned as is (no ASCII code point is default-ignorable).  Nothing else
    changes: no normalisation, no case folding.

    :param text: any ``str``.
    :returns: ``str``, ``len(result) <= len(text)``.
    """
    return text if text.isascii() else _IGNORABLE_RE.sub("", text)


def has_visible_content(text: str) -> bool:
    r"""True when ``text`` has a character that is neither whitespace, nor a control character
    (Unicode category Cc: U+0000-U+001F, U+007F-U+009F), nor default-ignorable.

    ``"\u200B"``, ``"\u200B\u2060"``, ``"\u00AD\uFEFF\u200B \n"``, ``"\x00\x01\x02"`` and
    ``""`` are not content; ``"..."`` is (punctuation is visible even though it yields no BM25
    token). Used to reject empty questions and documents. Stops at the first visible character
    (usually the first one), instead of stripping the whole text (``str.strip`` removes exactly
    the characters ``str.isspace`` accepts, so this is
    ``bool(strip_ignorable(text).translate(<Cc removed>).strip())``).
    """
    if text.isascii():
        return _ASCII_VISIBLE_RE.search(text) is not None
    ignorable = DEFAULT_IGNORABLE
    for c in text:
        o = ord(c)
        if not c.isspace() and o not in ignorable and not (o < 0x20 or 0x7F <= o <= 0x9F):
            return True
    return False


_ASCII_VISIBLE_RE = re.compile(r"[\x21-\x7e]")  # ASCII that is neither whitespace nor a control character


_MARK_CPS = _mark_cps()
_MARKS = _class_of(_MARK_CPS)
# word = a letter/digit that is not CJK, followed by letters/digits/marks that are not CJK.
_WORD = rf"[^\W_{_CJK_RANGES}](?:[^\W_{_CJK_RANGES}]|[{_MARKS}])*"
_CJK = rf"[{_CJK_RANGES}]+"
_TOKEN_RE = re.compile(rf"(?P<w>{_WORD})|(?P<c>{_CJK})")
_ASCII_RE = re.compile(r"[a-z0-9]+")
# ASCII text: upper case to lower, every other character that is not [a-z0-9] to a space; then
# ``str.split()`` gives the maximal runs of [a-z0-9], i.e. ``_ASCII_RE.findall(text.lower())``
# (both C loops, no regex engine: 0.079 -> 0.055 ms per derived ASCII chunk)
_ASCII_SPLIT = str.maketrans({c: (chr(c).lower() if chr(c).isalnum() else " ") for c in range(128)
                              if not ("a" <= chr(c) <= "z" or "0" <= chr(c) <= "9")})
# Normalised text with no CJK character, no combining mark and no astral character (most
# non-ASCII text: accents are composed by NFKC, Greek letters, dashes, quotes): on it
# ``_TOKEN_RE`` matches only its ``w`` group, whose classes reduce to ``[^\W_]``, so its tokens
# are the maximal runs of ``[^\W_]`` (one C-level ``findall``, no per-match Python; ~3x faster).
_WORDS_RE = re.compile(r"[^\W_]+")
_NOT_WORDS_ONLY_RE = re.compile(
    f"[{_class_of(cp for cp in _MARK_CPS if cp < 0x10000)}"
    f"{_CJK_BMP}{_ASTRAL}]")


def _normalize(text: str) -> str:
    """Default-ignorables removed -> NFKC -> casefold -> NFKC (see module docstring).

    ASCII: ``str.lower``.  The removal runs again at the end because NFKC maps a few
    compatibility characters onto default-ignorables (U+FFA0 -> U+3164 HANGUL FILLER).
    """
    if text.isascii():
        return text.lower()
    t = unicodedata.normalize("NFKC", _drop_ignorable(text)).casefold()
    return t if t.isascii() else _drop_ignorable(unicodedata.normalize("NFKC", t))


class Analyzer:
    """Deterministic text -> token list converter used for BM25 indexing and querying.

    Args:
        stem: apply the Snowball English stemmer (``snowballstemmer`` package) to word
            tokens.  Default ``False``.

    Raises:
        ImportError: ``stem=True`` and ``snowballstemmer`` is not installed (message
            says ``pip install snowballstemmer``).
    """

    __slots__ = ("stem", "_stemmer", "_stem_cache")

    def __init__(self, stem: bool = False) -> None:
        self.stem = bool(stem)
        self._stemmer = None
        self._stem_cache: dict[str, str] = {}
        if self.stem:
            try:
                import snowballstemmer  # optional dependency, imported lazily
            except ImportError as exc:  # pragma: no cover - depends on environment
                raise ImportError(
                    "pip install snowballstemmer  (needed for Analyzer(stem=True); "
                    "it is an optional dependency of oprag)"
                ) from exc
            self._stemmer = snowballstemmer.stemmer("english")

    def __repr__(self) -> str:
        return f"Analyzer(stem={self.stem})"

    def tokens(self, text: str) -> list[str]:
        """Analyse ``text`` into a list of tokens (see module docstring).

        Args:
            text: any ``str`` (may be empty).

        Returns:
            ``list[str]`` of non-empty tokens in text order; ``[]`` for text without
            letters/digits.  ``len(result)`` is the BM25 document length.

        Raises:
            TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"Analyzer.tokens expects str, got {type(text).__name__}")
        if text.isascii():
            words = text.translate(_ASCII_SPLIT).split()
            return self._stem_words(words) if self.stem else words
        norm = _normalize(text)
        if norm.isascii() or not _NOT_WORDS_ONLY_RE.search(norm):
            words = (_ASCII_RE if norm.isascii() else _WORDS_RE).findall(norm)
            return self._stem_words(words) if self.stem else words
        out: list[str] = []
        for m in _TOKEN_RE.finditer(norm):
            w = m.group("w")
            if w is not None:
                out.append(self._stem_one(w) if self.stem else w)
                continue
            run = m.group("c")
            n = len(run)
            for i in range(n - 1):
                out.append(run[i])
                out.append(run[i : i + 2])
            out.append(run[n - 1])
        return out

    __call__ = tokens

    # -- stemming -------------------------------------------------------------------
    def _stem_one(self, word: str) -> str:
        s = self._stem_cache.get(word)
        if s is None:
            s = self._stemmer.stemWord(word)  # type: ignore[union-attr]
            if len(self._stem_cache) < 1_000_000:
                self._stem_cache[word] = s
        return s

    def _stem_words(self, words: list[str]) -> list[str]:
        cache = self._stem_cache
        get = cache.get
        out = []
        for w in words:
            s = get(w)
            if s is None:
                s = self._stem_one(w)
            out.append(s)
        return out
