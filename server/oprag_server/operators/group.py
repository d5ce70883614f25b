"""The ``group`` operator: document-level retrieval, the "group by" of vector databases.

A request with ``group_by_document`` asks for the ``top_k`` best *documents*. Chunks are
retrieved from a window larger than ``top_k``, grouped by ``doc_id``, and each document is
scored by its best chunk (MaxP: Dai & Callan, "Deeper Text Understanding for IR with Contextual
Neural Language Modeling", SIGIR 2019). Documents rank by that score, descending, ties by
ascending ``doc_id``; each keeps its best ``chunks_per_document`` chunks of the window, in rank
order (score descending, ties by ascending chunk id).

The window (in chunks):

``hybrid`` (dense-first)
    the dense-first window itself: all N = ``candidates`` chunks, fused. Fused scores are
    defined over that window (min-max ranges, RRF ranks), so it cannot grow without changing
    them; a document has a score only when one of its chunks is among the N dense candidates.
    Ask for larger ``candidates`` to see more documents.
``full_hybrid`` with RRF
    likewise the fused lists: the chunks in the top-``candidates`` dense or BM25 list (every
    other chunk has RRF score 0 and is not returned); their RRF ranks depend on ``candidates``.
``dense``, ``lexical``, ``full_hybrid`` with weighted min-max (exact)
    a chunk's score does not depend on the window. It starts at
    ``W = max(candidates, top_k * chunks_per_document)`` and grows x4 while it holds fewer
    than ``top_k`` documents, came back full (``W`` chunks) and is smaller than the eligible
    chunks (``RetrievalInfo.chunks_searched``), up to :data:`MAX_WINDOW`. A document with no
    chunk in a window that holds ``top_k`` documents cannot score above the window's last
    chunk, so the ``top_k`` documents and their MaxP scores are those over every chunk (up to
    ties with that last score, which the window breaks by chunk id).
"""

from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable

import numpy as np

from ..domain import DocumentHit, Hit, RetrievalInfo, RetrieveSpec

#: Largest chunk window the exact modes grow to (chunks per query).
MAX_WINDOW = 16384
#: Window growth factor of the exact modes.
GROWTH = 4

RetrieveFn = Callable[[np.ndarray, list[str], list[RetrieveSpec]],
                      Awaitable[tuple[list[list[Hit]], dict[str, float], list[RetrievalInfo]]]]


def _fixed(spec: RetrieveSpec) -> bool:
    """Whether the request's chunk scores are defined over a window of ``candidates`` chunks."""
    return spec.mode == "hybrid" or (spec.mode == "full_hybrid" and spec.fusion == "rrf")


def window(spec: RetrieveSpec) -> int:
    """First chunk window W of a grouped request (module docstring): ``candidates`` in hybrid
    mode, else ``max(candidates, top_k * chunks_per_document)`` (full_hybrid RRF returns at
    most its two fused lists of ``candidates`` chunks of it)."""
    if spec.mode == "hybrid":
        return spec.candidates
    return max(spec.candidates, spec.top_k * spec.chunks_per_document)


def group_hits(hits: list[Hit], top_k: int, chunks_per_document: int) -> list[DocumentHit]:
    """Group ranked chunks into the ``top_k`` best documents (MaxP).

    :param hits: chunks of the window, any order.
    :param top_k: documents to return (fewer when the window holds fewer).
    :param chunks_per_document: best chunks kept per document (>= 1).
    :returns: documents by (score desc, doc_id asc); ``score`` = best chunk's ``score``,
        ``title`` = its title, ``hits`` = best chunks by (score desc, chunk_id asc).
    """
    docs: dict[str, DocumentHit] = {}
    for h in sorted(hits, key=lambda h: (-h.score, h.chunk_id)):
        d = docs.get(h.doc_id)
        if d is None:
            docs[h.doc_id] = DocumentHit(h.doc_id, h.title, h.score, [h])
        elif len(d.hits) < chunks_per_document:
            d.hits.append(h)
    return sorted(docs.values(), key=lambda d: (-d.score, d.doc_id))[:top_k]


def flatten(docs: list[DocumentHit]) -> list[Hit]:
    """The documents' chunks, document by document: what ``hits`` holds for a grouped request."""
    return [h for d in docs for h in d.hits]


def _grow(spec: RetrieveSpec, w: int, hits: list[Hit], docs: list[DocumentHit], info: RetrievalInfo) -> int:
    """The next window of an exact-mode request, or 0 when the current one answers it."""
    if _fixed(spec) or len(docs) >= spec.top_k or len(hits) < w:
        return 0
    limit = min(info.chunks_searched, MAX_WINDOW)
    return min(w * GROWTH, limit) if w < limit else 0


async def retrieve_documents(
    retrieve: RetrieveFn, qvecs: np.ndarray, texts: list[str], specs: list[RetrieveSpec]
) -> tuple[list[list[Hit]], dict[str, float], list[RetrievalInfo], list[list[DocumentHit] | None]]:
    """Retrieve a batch where some requests are grouped by document.

    :param retrieve: :meth:`oprag_server.operators.retrieve.Retriever.retrieve` (or a stand-in
        with its signature); called once for the batch, then again only for exact-mode grouped
        requests whose window must grow.
    :param qvecs: float32[B, D]; :param texts: B query texts; :param specs: B specs.
    :returns: B hit lists (for a grouped request, :func:`flatten` of its documents), timings in
        seconds summed over the calls, B :class:`RetrievalInfo`, and B document lists (None for
        a chunk-level request).
    """
    n = len(specs)
    if not any(s.group_by_document for s in specs):  # chunk-level only: one call, no window to grow
        hits, times, infos = await retrieve(qvecs, texts, specs)
        return hits, dict(times), infos, [None] * n
    wins = [window(s) if s.group_by_document else s.top_k for s in specs]
    hits: list[list[Hit]] = [[] for _ in range(n)]
    infos: list[RetrievalInfo | None] = [None] * n
    docs: list[list[DocumentHit] | None] = [None] * n
    times: dict[str, float] = {}
    todo = list(range(n))
    while todo:
        run = [dataclasses.replace(specs[i], top_k=wins[i]) if specs[i].group_by_document else specs[i]
               for i in todo]
        got, t, inf = await retrieve(qvecs[todo], [texts[i] for i in todo], run)
        for k, v in t.items():
            times[k] = times.get(k, 0.0) + v
        again = []
        for j, i in enumerate(todo):
            hits[i], infos[i] = got[j], inf[j]
            s = specs[i]
            if s.group_by_document:
                docs[i] = group_hits(got[j], s.top_k, s.chunks_per_document)
                w = _grow(s, wins[i], got[j], docs[i], inf[j])
                if w:
                    wins[i] = w
                    again.append(i)
        todo = again
    hits = [flatten(d) if d is not None else h for h, d in zip(hits, docs)]
    return hits, times, infos, docs
