"""Document loaders for ``oprag ingest --format text|jsonl|beir|wikitext``.

Each loader yields :class:`~oprag_client.client.Doc` lazily, so large files stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from .client import Doc, metadata_value

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
_WIKI_TITLE = re.compile(r"^ = ([^=].*?) = $")
_WIKI_DETOK = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")]


def _metadata(m) -> dict:
    """A JSON ``metadata`` object as typed metadata (README: typed metadata): strings, integers,
    floats and booleans keep their JSON type, null drops the key.

    :raises ValueError: not an object, or a value that is an array, an object, NaN, infinity or
        an integer outside signed 64-bit.
    """
    if not m:
        return {}
    if not isinstance(m, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(m).__name__}")
    for k, v in m.items():
        if v is not None:
            metadata_value(k, v)
    return {k: v for k, v in m.items() if v is not None}


def _read_text(f: Path) -> str | None:
    """UTF-8 text of a file, or None (with a warning) for binary or non-UTF-8 content."""
    import sys

    data = f.read_bytes()
    if b"\x00" in data:
        print(f"oprag: skipping {f}: binary or UTF-16 content", file=sys.stderr)
        return None
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError:
        print(f"oprag: skipping {f}: not UTF-8", file=sys.stderr)
        return None


def load_text(paths: list[Path]) -> Iterator[Doc]:
    """Plain UTF-8 text files (a directory is searched recursively for .txt/.md/.rst files).
    The id is the path relative to the given directory (or the file name); the title is the file
    stem. A leading UTF-8 byte-order mark is dropped. Binary and non-UTF-8 files are skipped with
    a warning.

    :raises ValueError: two of the given paths yield the same id (e.g. ``a/x.txt`` and
        ``b/x.txt`` given as folders ``a`` and ``b``): one would silently replace the other, so
        ingest them in separate calls or from their common parent folder.
    """
    seen: dict[str, Path] = {}

    def check(doc_id: str, f: Path) -> None:
        if doc_id in seen:
            raise ValueError(f"{f} and {seen[doc_id]} both get the document id {doc_id!r}; "
                             "ingest them from their common parent folder (ids are relative paths) "
                             "or in separate calls")
        seen[doc_id] = f

    for p in paths:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            for f in files:
                text = _read_text(f)
                if text is not None:
                    check(str(f.relative_to(p)), f)
                    yield Doc(id=str(f.relative_to(p)), title=f.stem, text=text)
        elif p.is_file():
            text = _read_text(p)
            if text is not None:
                check(p.name, p)
                yield Doc(id=p.name, title=p.stem, text=text)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")


def _json_lines(path: Path, id_key: str, what: str) -> Iterator[Doc]:
    """Documents of one JSON-lines file whose id is under ``id_key``.

    :raises ValueError: a line is not JSON, lacks the id or text, or has a field of the wrong
        type (file and line named).
    """
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise TypeError(f"a line must be a JSON object, got {type(obj).__name__}")
                _check_types(obj, id_key)
                chunks = obj.get("chunks")
                yield Doc(id=str(obj[id_key]), text=obj["text"] if not chunks else obj.get("text") or "",
                          title=obj.get("title") or "", metadata=_metadata(obj.get("metadata")),
                          vector=obj.get("vector"),
                          chunks=[(c["text"], c["vector"]) for c in chunks] if chunks else None)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected {what} with {id_key} and text ({exc})") from exc
            except ValueError as exc:  # a metadata value of no metadata type
                raise ValueError(f"{path}:{n}: {exc}") from exc


def _check_types(obj: dict, id_key: str) -> None:
    """:raises TypeError: id not a string or integer, text/title not strings (null title allowed)."""
    if id_key in obj and (isinstance(obj[id_key], bool) or not isinstance(obj[id_key], (str, int))):
        raise TypeError(f"{id_key} must be a string or an integer, got {type(obj[id_key]).__name__}")
    if "text" in obj and obj["text"] is not None and not isinstance(obj["text"], str):
        raise TypeError(f"text must be a string, got {type(obj['text']).__name__}")
    if obj.get("title") is not None and not isinstance(obj["title"], str):
        raise TypeError(f"title must be a string, got {type(obj['title']).__name__}")


def load_jsonl(paths: list[Path]) -> Iterator[Doc]:
    """JSON lines ``{"id", "text", "title"?, "metadata"?, "vector"?}`` or, with precomputed chunks,
    ``{"id", "chunks": [{"text", "vector"}], "title"?, "metadata"?}`` (vectors: lists of floats of
    the server's width; the server then embeds nothing for that document).

    :raises ValueError: a line is not JSON or lacks id/text (the message names file and line).
    """
    for p in paths:
        yield from _json_lines(p, "id", "a JSON object")


def load_beir(paths: list[Path]) -> Iterator[Doc]:
    """BEIR ``corpus.jsonl``: ``{"_id", "title", "text", "metadata"}`` (a directory means its
    corpus.jsonl)."""
    for p in paths:
        yield from _json_lines(p / "corpus.jsonl" if p.is_dir() else p, "_id", "a BEIR corpus line")


def wikitext_articles(text: str) -> Iterator[tuple[str, str]]:
    """Split WikiText into ``(title, body)`` per article.

    An article heading is a line `` = Title = `` (one ``=`` on each side) with a blank line (or
    the start / end of the file) right before and right after it, as WikiText writes them. A
    line of that shape inside a paragraph block, such as the formula line
    `` = 1 <unk> / s and a nominal <unk> k = ``, is body text. Section headings
    (`` = = Section = = ``) stay in the body. Title and body are detokenised alike
    (:func:`wikitext_detok`). Text before the first heading is skipped.
    """
    lines = text.splitlines()
    title, body = None, []
    for i, line in enumerate(lines):
        m = _WIKI_TITLE.match(line)
        if m and (i == 0 or not lines[i - 1].strip()) and (i + 1 == len(lines) or not lines[i + 1].strip()):
            if title is not None:
                yield title, wikitext_detok("\n".join(body))
            title, body = wikitext_detok(m.group(1).strip()), []
        elif title is not None and line.strip():
            body.append(line.strip())
    if title is not None:
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
    `` (2)``, `` (3)``...; not ``#n``, which reads like a chunk number)."""
    for p in paths:
        seen: dict[str, int] = {}
        for title, body in wikitext_articles(p.read_text(encoding="utf-8")):
            if not body.strip():
                continue
            seen[title] = seen.get(title, 0) + 1
            suffix = f" ({seen[title]})" if seen[title] > 1 else ""
            yield Doc(id=f"{p.stem}:{title}{suffix}", title=title, text=body, metadata={"source": p.name})


LOADERS = {"text": load_text, "jsonl": load_jsonl, "beir": load_beir, "wikitext": load_wikitext}
