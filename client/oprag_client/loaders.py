"""Document loaders for ``oprag ingest --format text|jsonl|beir|wikitext|parquet|arrow``.

Each loader yields :class:`~oprag_client.client.Doc` lazily, so large files stream.
The columnar formats (:func:`load_parquet`, :func:`load_arrow`) need ``pyarrow`` and ``numpy``
(the client's ``arrow`` extra); they are imported only when used.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from .client import Doc, metadata_value
from .vectors import check_json_chunks, check_json_vector, check_widths, column_matrix
from .wikitext import load_wikitext, wikitext_articles, wikitext_detok  # noqa: F401 - re-exported

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}


def _metadata_json(s: str):
    """A ``metadata`` column's string as the JSON value it holds.

    :raises ValueError: not JSON (the message says what the column must hold; json's own
        "Expecting value: line 1 column 1 (char 0)" named neither the column nor the fix)."""
    try:
        return json.loads(s)
    except json.JSONDecodeError as exc:
        raise ValueError(f"metadata is not JSON ({exc.msg} at character {exc.pos} of {s[:40]!r}): a metadata "
                         'string must hold a JSON object, e.g. {"lang": "en"} (or use a struct column)') from None


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


def _folder_files(p: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files with one of ``suffixes`` under folder ``p`` (recursive, sorted). An entry with such a
    name that is not a readable file (a dangling symbolic link, a FIFO, a socket, a device) is
    skipped with a message on stderr, as a non-UTF-8 text file is (it was skipped silently)."""
    import stat
    import sys

    out = []
    for f in sorted(p.rglob("*")):
        if f.suffix.lower() not in suffixes or f.is_dir():
            continue
        if f.is_file():
            out.append(f)
        elif f.is_symlink() and not f.exists():
            print(f"oprag: skipping {f}: a symbolic link to {os.readlink(f)}, which does not exist", file=sys.stderr)
        else:
            try:
                mode = f.stat().st_mode
                kind = ("a FIFO, " if stat.S_ISFIFO(mode) else "a socket, " if stat.S_ISSOCK(mode)
                        else "a device, " if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "")
            except OSError as exc:  # (a symbolic link loop, no permission)
                kind = f"{exc.strerror}: "
            print(f"oprag: skipping {f}: {kind}not a regular file", file=sys.stderr)
    return out


def load_text(paths: list[Path]) -> Iterator[Doc]:
    """Plain UTF-8 text files (a directory is searched recursively for .txt/.md/.rst files).
    The id is the path relative to the given directory (or the file name; ``stdin`` for
    ``/dev/stdin``, which is read as a file, as is any pipe); the title is the file stem. A leading UTF-8 byte-order mark is dropped. Binary and non-UTF-8 files, and in a folder
    dangling symbolic links, FIFOs, sockets and devices, are skipped with a warning.

    :raises ValueError: two of the given paths yield the same id (e.g. ``a/x.txt`` and
        ``b/x.txt`` given as folders ``a`` and ``b``): one would silently replace the other, so
        ingest them from their common parent folder (in separate calls the second would replace
        the first as well: same id).
    """
    seen: dict[str, Path] = {}

    def check(doc_id: str, f: Path) -> bool:  # False: this very file was given already (read once)
        if doc_id in seen:
            if seen[doc_id].resolve() == f.resolve():
                return False
            raise ValueError(f"{f} and {seen[doc_id]} both get the document id {doc_id!r}; "
                             "ingest them from their common parent folder (ids are relative paths); "
                             "separate calls would not help: the second would replace the first")
        seen[doc_id] = f
        return True

    for p in paths:
        if p.is_dir():
            for f in _folder_files(p, TEXT_SUFFIXES):
                if check(str(f.relative_to(p)), f) and (text := _read_text(f)) is not None:
                    yield Doc(id=str(f.relative_to(p)), title=f.stem, text=text)
        elif p.exists():  # a file, or a pipe or character device (/dev/stdin, <(...)) read as one
            if check(p.name, p) and (text := _read_text(p)) is not None:
                yield Doc(id=p.name, title=p.stem, text=text)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")


#: the fields ``--format jsonl`` reads (any other is ignored, with a warning on stderr once per name and file)
JSONL_FIELDS = frozenset({"id", "text", "title", "metadata", "vector", "chunks"})


def _json_lines(path: Path, id_key: str, what: str, known: frozenset[str] | None = None) -> Iterator[Doc]:
    """Documents of one JSON-lines file whose id is under ``id_key``; with ``known``, any other
    field is named on stderr, once per name (it is ignored).

    :raises ValueError: a line is not JSON, lacks the id or text, or has a field of the wrong
        type (file and line named).
    """
    told: set[str] = set()  # field names already warned about
    with open(path, encoding="utf-8-sig") as f:
        for n, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise TypeError(f"a line must be a JSON object, got {type(obj).__name__}")
                _check_types(obj, id_key)
                lacks = [k for k in (id_key, "text") if k not in obj and not (k == "text" and obj.get("chunks"))]
                if lacks:  # (was the bare KeyError: "expected ... with id and text ('text')", trial35)
                    hint = ("; a BEIR corpus line ('_id'): use --format beir" if id_key == "id" and "_id" in obj
                            else "; a JSON lines file ('id'): use --format jsonl" if id_key == "_id" and "id" in obj
                            else "")  # (trial50)
                    raise ValueError(f"no {' and no '.join(map(repr, lacks))} field (the line's fields: "
                                     f"{', '.join(map(repr, obj)) or 'none'}){hint}")
                if known is not None and (new := sorted(obj.keys() - known - told)):  # (a typo was silent: trial34)
                    told.update(new)
                    print(f"oprag: {path}:{n}: ignoring field(s) {', '.join(map(repr, new))}: a line's fields are "
                          f"{', '.join(sorted(known))}", file=sys.stderr)
                if obj.get("vector") == []:  # Doc reads [] as no vector: the server would embed the text
                    raise ValueError("vector is empty: give its numbers, or leave it out to embed the text")
                chunks = obj.get("chunks")
                yield Doc(id=str(obj[id_key]), text=obj["text"] if not chunks else obj.get("text") or "",
                          title=obj.get("title") or "", metadata=_metadata(obj.get("metadata")),
                          vector=obj.get("vector"),
                          chunks=[(c["text"], c["vector"]) for c in chunks] if chunks else None)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected {what} with {id_key} and text ({exc})") from exc
            except ValueError as exc:  # a metadata value of no metadata type
                raise ValueError(f"{path}:{n}: {exc}") from exc


def _lines(f, path: Path) -> Iterator[tuple[int, str]]:
    """``(n, line)`` of a text file.

    :raises ValueError: the file is not UTF-8 (a Parquet or Arrow file read as JSON lines said
        only "'utf-8' codec can't decode byte 0x88 in position 92", naming no file)."""
    n = 0
    try:
        for n, line in enumerate(f, 1):
            yield n, line
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}:{n + 1}: not UTF-8 text ({exc.reason}): JSON lines are UTF-8 text; for a "
                         "Parquet or Arrow file use --format parquet or --format arrow") from None


def _check_types(obj: dict, id_key: str) -> None:
    """:raises TypeError: id not a string or integer, text/title not strings (null title allowed).
    :raises ValueError: ``vector`` not a list of finite float32-range numbers (a boolean is not one),
        ``chunks`` not a non-empty list of ``{"text", "vector"}`` objects (:func:`vectors.check_json_chunks`)
        or given with a ``text`` or ``vector`` of the document's own."""
    if id_key in obj and (isinstance(obj[id_key], bool) or not isinstance(obj[id_key], (str, int))):
        raise TypeError(f"{id_key} must be a string or an integer, got {type(obj[id_key]).__name__}")
    if "text" in obj and obj["text"] is not None and not isinstance(obj["text"], str):
        raise TypeError(f"text must be a string, got {type(obj['text']).__name__}")
    if obj.get("title") is not None and not isinstance(obj["title"], str):
        raise TypeError(f"title must be a string, got {type(obj['title']).__name__}")
    if obj.get("vector") is not None and not isinstance(obj["vector"], list):  # (was named at send time, no line)
        raise ValueError(f"vector must be a list of numbers, got {json.dumps(obj['vector'])[:80]}")
    if obj.get("vector"):
        check_json_vector(obj["vector"])
    if "chunks" in obj and obj["chunks"] is not None:  # a ValueError: "expected ... id and text ('vector')" misled
        check_json_chunks(obj["chunks"])
        if obj.get("text") or obj.get("vector"):  # (the server rejected it, after the stream's other documents: trial28b)
            raise ValueError("a document with chunks carries its text and vectors in them: leave out its "
                             f"{' and '.join(k for k in ('text', 'vector') if obj.get(k))}")


def load_jsonl(paths: list[Path]) -> Iterator[Doc]:
    """JSON lines ``{"id", "text", "title"?, "metadata"?, "vector"?}`` or, with precomputed chunks,
    ``{"id", "chunks": [{"text", "vector"}], "title"?, "metadata"?}`` (vectors: lists of floats of
    the server's width; the server then embeds nothing for that document).

    :raises ValueError: a line is not JSON or lacks id/text (the message names file and line).
    """
    for p in paths:
        yield from _json_lines(p, "id", "a JSON object", JSONL_FIELDS)


def load_beir(paths: list[Path]) -> Iterator[Doc]:
    """BEIR ``corpus.jsonl``: ``{"_id", "title", "text", "metadata"}`` (a directory means its
    corpus.jsonl); a line may also carry ``"vector"`` or ``"chunks"``, read and checked as
    :func:`load_jsonl` reads them (the same line reader)."""
    for p in paths:
        yield from _json_lines(p / "corpus.jsonl" if p.is_dir() else p, "_id", "a BEIR corpus line")


def _files(paths: list[Path], suffixes: tuple[str, ...]) -> list[Path]:
    """The given files, and the files with one of ``suffixes`` in a given directory (sorted)."""
    out = []
    for p in paths:
        if p.is_dir():
            out += _folder_files(p, suffixes)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return out


def load_parquet(paths: list[Path], vector_column: str | None = None) -> Iterator[Doc]:
    """Parquet files (a directory: its ``*.parquet`` files), streamed in record batches; the
    columns are read as :func:`columnar_docs` describes.

    :raises ValueError: a missing column, vectors of more than one width, a null vector in
        chunk rows (file and row named); checked before the first document is yielded.
    :raises ImportError: pyarrow or numpy missing (``pip install 'oprag-client[arrow]'``).
    """
    pq, seen = _pyarrow("parquet"), {}
    for f in _files(paths, (".parquet", ".pq")):
        try:
            pf = pq.ParquetFile(f)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError; it named no file
            raise ValueError(f"{f}: not a Parquet file ({exc}){_other_format(f, 'parquet')}") from exc
        yield from columnar_docs(f, pf.schema_arrow, lambda cols=None, pf=pf: pf.iter_batches(4096, columns=cols),
                                 vector_column, seen)


def load_arrow(paths: list[Path], vector_column: str | None = None) -> Iterator[Doc]:
    """Arrow IPC files (the file format, ``.arrow`` / ``.feather`` v2, or the stream format; a
    directory: its ``*.arrow``, ``*.feather``, ``*.arrows`` files), read batch by batch; columns as
    :func:`columnar_docs` describes.

    :raises ValueError: as :func:`load_parquet`, or a file that is not Arrow IPC.
    """
    pa = _pyarrow()

    def reader(f: Path):
        try:
            return pa.ipc.open_file(f)
        except pa.ArrowInvalid:
            try:
                return pa.ipc.open_stream(f)
            except (pa.ArrowInvalid, OSError) as exc:  # (random bytes: an OSError, "negative continuation token")
                raise ValueError(f"{f}: not an Arrow IPC file or stream ({exc}){_other_format(f, 'arrow')}") from exc

    def batches(f: Path):
        def read(cols=None):
            r = reader(f)
            it = (r.get_batch(i) for i in range(r.num_record_batches)) if hasattr(r, "num_record_batches") else r
            for b in it:
                yield b.select(cols) if cols else b
        return read

    seen: dict = {}
    for f in _files(paths, (".arrow", ".feather", ".arrows", ".ipc")):
        yield from columnar_docs(f, reader(f).schema, batches(f), vector_column, seen)


def _other_format(f: Path, given: str) -> str:
    """``"; it is <kind>: use --format <x>"`` when the file's first bytes are another columnar format's magic (a
    Parquet file starts with ``PAR1``, an Arrow IPC file with ``ARROW1``, an IPC stream with the continuation
    marker ``0xFFFFFFFF``); ``"; it starts as <kind> but is damaged or cut short"`` when that format is the one
    ``given`` (trial44: a truncated Parquet file was told to use --format parquet); else ``""``."""
    try:
        with open(f, "rb") as fh:
            head = fh.read(6)
    except OSError:
        return ""
    kind = "parquet" if head[:4] == b"PAR1" else "arrow" if head == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff" else ""
    if not kind:
        return ""
    name = {"parquet": "a Parquet file", "arrow": "an Arrow IPC file or stream"}[kind]
    return f"; it starts as {name} but is damaged or cut short" if kind == given else f"; it is {name}: use --format {kind}"


def _pyarrow(sub: str = ""):
    try:
        import numpy  # noqa: F401, PLC0415
        import pyarrow  # noqa: PLC0415
        if sub:
            import importlib  # noqa: PLC0415
            return importlib.import_module(f"pyarrow.{sub}")
        import pyarrow.ipc  # noqa: F401, PLC0415
        return pyarrow
    except ImportError as exc:
        raise ImportError("reading Parquet / Arrow needs pyarrow and numpy: pip install 'oprag-client[arrow]'") from exc


def columnar_docs(path: Path, schema, batches, vector_column: str | None = None, seen: dict | None = None
                  ) -> Iterator[Doc]:
    """Documents of one columnar file. ``seen``: shared by the files of one ingest (``width``, ``path``: the first
    file with vectors), so a file whose width differs is refused by name before its first row (trial50: the
    server's refusal named a document of the stream, not the file).

    Columns: ``id`` (string or integer), ``text`` (string), optional ``title`` (string),
    ``metadata`` (a JSON object as a string, or a struct: :func:`_metadata` rules) and the
    vector column (a list or fixed-size list of floats, one width for the whole file; float32 on
    the wire): ``vector_column`` when given (then the file must have it), else ``vector`` if the
    file has one. Two layouts:

    * one row per document (no ``doc_id`` column): a row with a vector is stored as one chunk
      with that vector, a row whose vector is null (or a file without the column) is chunked
      and embedded by the server;
    * one row per chunk (a ``doc_id`` column): consecutive rows with the same ``doc_id`` are
      one document's chunks in row order (``text`` each chunk's text, ``vector`` required);
      title and metadata come from the document's first row, ``id`` is not needed.

    :param batches: ``batches(columns=None)`` -> iterator of ``pyarrow.RecordBatch`` (read
        twice when the vector widths must be checked first).
    :raises ValueError: (file and row named) a missing column, a vector column that is not a
        list of numbers, two widths or an empty vector in the file -- checked before the first
        document is yielded -- or, found as the rows are read, a bad id, text or metadata, a null vector in chunk
        rows, a document's rows not contiguous.
    """
    import numpy as np  # noqa: PLC0415
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    names = set(schema.names)
    chunk_rows = "doc_id" in names
    named, vector_column = vector_column is not None, vector_column or "vector"
    need = ["doc_id" if chunk_rows else "id", "text"] + ([vector_column] if chunk_rows or named else [])
    missing = [c for c in need if c not in names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(schema.names)})")
    has_vec = vector_column in names
    if has_vec:
        vt = schema.field(vector_column).type
        if not (pa.types.is_list(vt) or pa.types.is_large_list(vt) or pa.types.is_fixed_size_list(vt)) \
                or not (pa.types.is_floating(vt.value_type) or pa.types.is_integer(vt.value_type)):
            raise ValueError(f"{path}: column {vector_column!r} must hold lists of numbers, got {vt}")
        width = vt.list_size if pa.types.is_fixed_size_list(vt) else None
        if width is None:  # one width for the whole file, before sending any
            try:
                width = check_widths(batches([vector_column]), vector_column, chunk_rows, np, pc)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        if seen is not None and width is not None:
            seen.setdefault("width", width)
            seen.setdefault("path", path)
            if width != seen["width"]:
                raise ValueError(f"{path}: column {vector_column!r} holds vectors of width {width}, but "
                                 f"{seen['path']} holds width {seen['width']}: the files of one ingest need one width, "
                                 "the index's, so one of the two does not match it (embed every file with the "
                                 "index's model)")
    row, cur, done = 0, None, set()
    for b in batches():
        cols = {n: b.column(n) for n in b.schema.names}
        try:
            vecs, valid = (column_matrix(cols[vector_column], np, pa, pc, row) if has_vec else (None, None))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        text = cols["text"].to_pylist()
        title = cols["title"].to_pylist() if "title" in cols else [None] * b.num_rows
        meta = cols["metadata"].to_pylist() if "metadata" in cols else [None] * b.num_rows
        ids = cols["doc_id" if chunk_rows else "id"].to_pylist()
        for i in range(b.num_rows):
            where = f"{path}: row {row + i}"
            try:
                if ids[i] is None or isinstance(ids[i], (bytes, float)):
                    raise ValueError(f"{'doc_id' if chunk_rows else 'id'} must be a string or an integer, got {ids[i]!r}")
                if isinstance(text[i], bytes):  # a binary column: its bytes need not be UTF-8
                    raise ValueError("text is bytes (a binary column): write the text column as UTF-8 "
                                     "strings (pyarrow.string()), decoding the bytes with their encoding")
                if text[i] is not None and not isinstance(text[i], str):
                    raise ValueError(f"text must be a string, got {type(text[i]).__name__}")
                m = _metadata_json(meta[i]) if isinstance(meta[i], str) else meta[i]
                if not chunk_rows:
                    yield Doc(id=str(ids[i]), text=text[i] or "", title=title[i] or "", metadata=_metadata(m),
                              vector=vecs[i] if has_vec and valid[i] else None)
                    continue
                if not valid[i]:
                    raise ValueError("chunk rows need a vector: give this row its chunk's vector (a file without "
                                     "a doc_id column is read one document per row, and a null vector there has "
                                     "the server embed the text)")
                did = str(ids[i])
                if cur is not None and cur.id == did:
                    cur.chunks.append((text[i] or "", vecs[i]))
                    continue
                if did in done:
                    raise ValueError(f"the rows of document {did!r} are not contiguous: sort or group the rows by "
                                     "doc_id (a document's chunks, in order, one after the other)")
                if cur is not None:
                    done.add(cur.id)
                    yield cur
                cur = Doc(id=did, title=title[i] or "", metadata=_metadata(m), chunks=[(text[i] or "", vecs[i])])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: {exc}") from exc
        row += b.num_rows
    if cur is not None:
        yield cur


LOADERS = {"text": load_text, "jsonl": load_jsonl, "beir": load_beir, "wikitext": load_wikitext,
           "parquet": load_parquet, "arrow": load_arrow}
