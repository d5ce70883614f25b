"""What the ingest stream's Load stage checks in each document: the reasons a document is
rejected (:func:`validate_document`), the vectors a document brings (:func:`supplied_vectors`),
and the content hash a chunk is stored under (:func:`embedded_prefix`, :data:`SUPPLIED_PREFIX`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from .. import metadata as md
from .. import records
from ..config import LimitsConfig
from ..index.analyzer import has_visible_content


#: content-hash prefix of a chunk whose vector its client supplied (``Document.vector``/``chunks``):
#: no chunk the server embeds ever looks such a hash up, so a supplied vector (another model's, a
#: random test vector) is never reused for another chunk with that text (trial24)
SUPPLIED_PREFIX = "u:"


def embedded_prefix(embedder: str) -> str:
    """Content-hash prefix of the chunks the server's embedder named ``embedder`` embedded:
    ``"e" + 8 hex digits of sha256(name) + ":"``. Ingest reuses the stored vector of a chunk only
    when its content hash, prefix included, is the new chunk's (same text, embedded by the same
    model). Chunks stored before the prefixes existed (a bare 64-hex sha256: supplied or embedded,
    by whichever model, nobody knows) match no new hash: they are embedded again when their
    document is re-ingested, never reused."""
    return "e" + hashlib.sha256(embedder.encode()).hexdigest()[:8] + ":"


def content_hash(text: str, prefix: str) -> str:
    """``prefix`` (:func:`embedded_prefix` or :data:`SUPPLIED_PREFIX`) + the hex sha256 of ``text``
    (UTF-8) cut to 64 characters in all (54 hex digits after an embedder's prefix, 216 bits): the
    shards hold as many bytes per chunk as with the bare hashes before. A bare hash (64 hex digits,
    no ``:``) never equals a prefixed one."""
    return prefix + hashlib.sha256(text.encode()).hexdigest()[: 64 - len(prefix)]


class IngestError(ValueError):
    """The stream as a whole is invalid (for example a wrong ``sent_documents`` count, or no
    final message); nothing of it was stored."""


def validate_document(doc: Any, limits: LimitsConfig) -> str | None:
    """Reason a document cannot be stored, or None. ``doc`` has id, title, text, metadata
    (and optionally typed_metadata).

    A text with no visible character (only whitespace, control characters such as U+0000, and
    Unicode Default_Ignorable code points such as U+200B, U+00AD, U+FEFF;
    :func:`~oprag_server.index.analyzer.has_visible_content`) is empty.
    """
    chunks = list(getattr(doc, "chunks", ()))
    if not doc.id:
        return "id is empty: give every document a non-empty id"
    if not doc.id.strip():  # (a blank CSV/Parquet cell, trial23; an id with other characters is kept as it is)
        return "id is only whitespace: give every document an id with a character other than whitespace"
    if len(doc.id.encode()) > limits.max_doc_id_bytes:
        return f"id is longer than {limits.max_doc_id_bytes} bytes: use a shorter id"
    if "\x00" in doc.id:
        return "id contains a NUL character (U+0000): remove it (any other character, control characters included, is kept)"
    if chunks:
        if doc.text or len(getattr(doc, "vector", ())):
            return "a document with chunks carries its text and vectors in them: leave text and vector empty"
        bad = next((i for i, c in enumerate(chunks) if not has_visible_content(c.text)), None)
        if bad is not None:  # (trial50b: which one was not said)
            return (f"chunk {bad}'s text is empty (nothing but whitespace, control or invisible characters; chunks "
                    "counted from 0 in the document's order)")
    elif not has_visible_content(doc.text):  # "", whitespace, or only control / Default_Ignorable code points
        return "text is empty (nothing but whitespace, control or invisible characters): send the document's text"
    tsize = len(doc.title.encode())
    if tsize > limits.max_title_bytes:
        return (f"title is {tsize} bytes; the limit is {limits.max_title_bytes} (it is stored and returned with every "
                "chunk): shorten the title and put longer text in the document's text or metadata")
    size = len(doc.text.encode()) + tsize + sum(len(c.text.encode()) for c in chunks)
    if size > limits.max_document_bytes:
        return f"document is {size} bytes; the limit is {limits.max_document_bytes}: split it into several documents"
    try:
        meta = md.of_document(doc)
    except ValueError as exc:
        return str(exc)
    if len(meta) > limits.max_metadata_entries:
        return f"metadata has {len(meta)} entries; the limit is {limits.max_metadata_entries}: drop or merge entries"
    msize = md.size_bytes(meta)
    if msize > limits.max_metadata_bytes:
        return (f"metadata is {msize} bytes (keys and values); the limit is {limits.max_metadata_bytes}: shorten or drop "
                "values (put long text in the document's text)")
    return None


def supplied_vectors(n: int, doc: Any, dim: int) -> list[tuple[str, np.ndarray]] | None:
    """Document ``n`` of the stream's own (chunk text, unit vector float32[D]) pairs, or None to embed it.

    The vectors come as repeated floats (``vector`` / ``ChunkVector.vector``) or packed
    (``vectors_f32`` + ``vector_dim``: one ``np.frombuffer``, :func:`records.packed_rows`).

    :raises IngestError: a vector of another width than the index's, NaN/infinity, all zeros, a chunk
        without a vector;
        packed bytes of the wrong length or a ``vector_dim`` other than the index's; both forms
        in one document.
    """
    chunks = list(getattr(doc, "chunks", ()))
    one = getattr(doc, "vector", ())
    packed, pdim = getattr(doc, "vectors_f32", b""), getattr(doc, "vector_dim", 0)
    if not chunks and not len(one) and not packed and not pdim:
        return None
    texts, rows = ([c.text for c in chunks], [c.vector for c in chunks]) if chunks else ([doc.text], [one])
    try:
        if packed or pdim:
            if any(len(r) for r in rows):
                raise ValueError("vectors_f32 and repeated float vectors in one document: send one form")
            vecs = records.packed_rows(packed, len(rows), pdim, dim)
        else:
            empty = next((i for i, r in enumerate(rows) if not len(r)), None) if chunks else None
            if empty is not None:  # ("a vector has 0 values; the index holds vectors of width 384" named no chunk)
                raise ValueError(f"chunk {empty} has no vector: every chunk of a document brings its vector "
                                 "(or send them all packed in vectors_f32), or send the text without chunks "
                                 "to have it chunked and embedded")
            vecs = records.unit_rows(rows, dim, what="a vector")
    except ValueError as exc:
        raise IngestError(f"document {n} ({doc.id!r}): {exc}; nothing was stored") from exc
    return list(zip(texts, vecs))



def supplied_vectors_many(docs: list[tuple[int, Any]], dim: int) -> list[list[tuple[str, np.ndarray]] | None]:
    """:func:`supplied_vectors` of ``(n, document)`` pairs (one message's valid documents, in
    order), the same values: the one-vector documents in the packed form (what the client sends
    for numpy vectors, and bulk loads use) are unpacked and normalised as one matrix (row-wise:
    each row's floats are those of its own call); per-document numpy calls took 8% of the
    frontend's ingest time at 60K chunks (issue 13).

    :raises IngestError: as :func:`supplied_vectors`, for the first such document in order.
    """
    one = [i for i, (_, d) in enumerate(docs)
           if getattr(d, "vector_dim", 0) == dim and len(getattr(d, "vectors_f32", b"")) == 4 * dim
           and not len(getattr(d, "chunks", ())) and not len(getattr(d, "vector", ()))]
    out: list = [None] * len(docs)
    if len(one) > 1:
        try:
            mat = records.packed_rows(b"".join([docs[i][1].vectors_f32 for i in one]), len(one), dim, dim)
        except ValueError:  # a bad row: the per-document calls below name its document
            one = []
        else:
            for r, i in enumerate(one):
                out[i] = [(docs[i][1].text, mat[r])]
    done = set(one) if len(one) > 1 else set()
    return [out[i] if i in done else supplied_vectors(n, d, dim) for i, (n, d) in enumerate(docs)]
