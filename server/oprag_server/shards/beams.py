"""The HNSW beam of each query of a shard search (issue 13): a ``hybrid`` request's dense list needs a smaller beam
than a ``dense`` one where its BM25 list ranks beside it (``DenseConfig.hybrid_ef_search``)."""

from __future__ import annotations


def of(store, req, plain: list[int]) -> dict[int, list[int]]:
    """The unfiltered queries ``plain`` of ``req`` (a :class:`.protocol.SearchRequest` to the shard of
    :class:`.chunks.ChunkStore` ``store``) by the HNSW beam their dense search uses (``ef_search``; 0: the index
    default): the request's own; for a ``hybrid`` request that leaves it 0 on an HNSW shard, ``--hybrid-ef-search``
    (when below ``--ef-search``) for each query with a term that occurs in this shard, whose BM25 list ranks beside
    the dense one, and the index default for the others, whose ranking here is the dense side's alone (as in ``dense``
    mode). Empty for no query."""
    p = store.dense.params
    if not plain:
        return {}
    if req.ef_search or req.mode != "hybrid" or p.kind != "hnsw" or not 0 < p.hybrid_ef_search < p.ef_search:
        return {int(req.ef_search): plain}
    ix, terms = store.postings, req.batch.terms
    out: dict[int, list[int]] = {}
    for i in plain:
        out.setdefault(p.hybrid_ef_search if any(ix.df(t) for t in terms[i]) else 0, []).append(i)
    return out


def widest(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Knobs used (``{"ef_search" | "nprobe": value}``) of two searches: the larger value of each."""
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}
