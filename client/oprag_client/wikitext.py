"""The ``wikitext`` loader (``oprag ingest --format wikitext``): the raw WikiText-2 files, one
document per article (README: "Formats")."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

from .client import Doc

_WIKI_TITLE = re.compile(r"^ = ([^=].*?) = $")
_WIKI_DETOK = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")]


def wikitext_articles(text: str, skipped: list[int] | None = None,
                      headings: list[int] | None = None) -> Iterator[tuple[str, str]]:
    """Split WikiText into ``(title, body)`` per article.

    An article heading is a line `` = Title = `` (one ``=`` on each side) with a blank line (or
    the start / end of the file) right before and right after it, as WikiText writes them. A
    line of that shape inside a paragraph block, such as the formula line
    `` = 1 <unk> / s and a nominal <unk> k = ``, is body text. Section headings
    (`` = = Section = = ``) stay in the body. Title and body are detokenised alike
    (:func:`wikitext_detok`). Text before the first heading belongs to no article: it is skipped,
    and the (1-based) numbers of its non-blank lines are appended to ``skipped`` when given. The
    (1-based) line of each article's heading is appended to ``headings`` when given, before the
    article is yielded.
    """
    lines = text.splitlines()
    title, body, at = None, [], 0
    for i, line in enumerate(lines):
        m = _WIKI_TITLE.match(line)
        if m and (i == 0 or not lines[i - 1].strip()) and (i + 1 == len(lines) or not lines[i + 1].strip()):
            if title is not None:
                if headings is not None:
                    headings.append(at)
                yield title, wikitext_detok("\n".join(body))
            title, body, at = wikitext_detok(m.group(1).strip()), [], i + 1
        elif line.strip() and title is not None:
            body.append(line.strip())
        elif line.strip() and skipped is not None:
            skipped.append(i + 1)
    if title is not None:
        if headings is not None:
            headings.append(at)
        yield title, wikitext_detok("\n".join(body))


def wikitext_detok(s: str) -> str:
    """Join WikiText's split number and hyphen tokens: `` @-@ `` -> ``-``, `` @,@ `` -> ``,``,
    `` @.@ `` -> ``.`` (``"M @-@ 82"`` -> ``"M-82"``, ``"1 @,@ 000"`` -> ``"1,000"``). Other
    tokens, ``<unk>`` included, are kept as they are."""
    for a, b in _WIKI_DETOK:
        s = s.replace(a, b)
    return s


def load_wikitext(paths: list[Path]) -> Iterator[Doc]:
    """One document per WikiText article; id ``<file stem>:<title>`` (a repeated title gets
    `` (2)``, `` (3)``...; not ``#n``, which reads like a chunk number). Text before a file's first
    article heading is no article: it is skipped with a message on stderr naming its lines. An
    article with no text under its heading is skipped with a message on stderr naming its title
    and line (it was dropped in silence: not a document, not rejected); it is no repeat of its title.

    :raises ValueError: a file is not UTF-8.
    """
    for p in paths:
        seen: dict[str, int] = {}
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start}): --format wikitext reads "
                             "the raw WikiText-2 text files") from None
        skipped: list[int] = []
        headings: list[int] = []
        for title, body in wikitext_articles(text, skipped, headings):
            if not body.strip():
                print(f"oprag: skipping article {title!r} (line {headings[-1]} of {p}): no text under its heading",
                      file=sys.stderr)
                continue
            seen[title] = seen.get(title, 0) + 1
            suffix = f" ({seen[title]})" if seen[title] > 1 else ""
            yield Doc(id=f"{p.stem}:{title}{suffix}", title=title, text=body, metadata={"source": p.name})
        if skipped:  # (was dropped in silence, trial22; the text loader says what it skips, too)
            lines = f"line {skipped[0]}" if len(skipped) == 1 else f"lines {skipped[0]}-{skipped[-1]}"
            print(f"oprag: skipping {lines} of {p}: text before its first article heading "
                  "(--format wikitext reads articles, each starting with a ' = Title = ' line between blank lines)",
                  file=sys.stderr)
