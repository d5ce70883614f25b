"""The N a request gets when it leaves ``candidates`` 0 (operators.hybrid.first_candidates,
through service.convert.query_job)."""

from __future__ import annotations

import pytest

from oprag.v1 import oprag_pb2
from oprag_server.config import DenseConfig, RetrievalConfig, ServerConfig
from oprag_server.operators.hybrid import first_candidates
from oprag_server.service.convert import InvalidArgument, query_job


def _job(cfg=None, **kw):
    req = oprag_pb2.QueryRequest(question="q", **kw)
    return query_job(req, cfg or ServerConfig(), dim=4, generate=False, can_generate=False)


def test_min_max_hybrid_starts_small_and_others_keep_the_window():
    assert _job().spec.candidates == 64  # default top_k 5
    assert _job(top_k=10).spec.candidates == 64
    assert _job(top_k=30).spec.candidates == 120
    assert _job(top_k=100).spec.candidates == 400
    assert _job(top_k=10, candidates=300).spec.candidates == 300  # asked: kept
    assert _job(top_k=10, candidates=3).spec.candidates == 10  # at least top_k, as before
    assert _job(top_k=10, fusion=oprag_pb2.FusionOptions(method=oprag_pb2.RRF)).spec.candidates == 256
    assert _job(top_k=10, group_by_document=True).spec.candidates == 256
    for mode in (oprag_pb2.DENSE, oprag_pb2.LEXICAL, oprag_pb2.FULL_HYBRID):
        assert _job(top_k=10, mode=mode).spec.candidates == 256


def test_the_knob_and_its_bounds():
    r = RetrievalConfig(hybrid_candidates=0, candidates=200)
    assert first_candidates(r, "hybrid", "minmax", False, 10, True) == 200  # 0: --candidates
    for name in ("hybrid_candidates", "lexical_candidates"):  # refused like --candidates, not clamped (trial33b)
        with pytest.raises(ValueError, match=rf"{name} must be in \[0, 4096\] \(--{name.replace('_', '-')}\), got 5000"):
            RetrievalConfig(**{name: 5000})
    r = RetrievalConfig(hybrid_candidates=4096)
    assert first_candidates(r, "hybrid", "minmax", False, 10, True) == r.max_candidates
    with pytest.raises(ValueError, match=r"hybrid_candidates must be in \[0, 4096\] \(--hybrid-candidates\), got -1"):
        RetrievalConfig(hybrid_candidates=-1)
    cfg = ServerConfig(retrieval=RetrievalConfig(hybrid_candidates=16))
    assert _job(cfg, top_k=2).spec.candidates == 16
    with pytest.raises(InvalidArgument, match="candidates"):
        _job(candidates=5000)


def test_an_ann_index_keeps_the_window():
    """HNSW / IVF above shards x ``--ann-check`` chunks: the beam finds ef_search rows whatever N, and shorter lists
    widen more at scale (1M: 25% vs 8% of SciFact queries; bench/RESULTS.md, session 33): N stays --candidates."""
    for kind in ("hnsw", "ivf"):
        cfg = ServerConfig(dense=DenseConfig(kind=kind))
        assert _job(cfg, top_k=10).spec.candidates == 256  # (no corpus size given: not known exact)
        assert first_candidates(RetrievalConfig(), "hybrid", "minmax", False, 10, False) == 256


def test_hnsw_and_ivf_start_small_while_every_shard_ranks_exactly():
    """With HNSW / IVF the first N is flat's while the corpus holds at most shards x ``--ann-check`` chunks (each
    shard then ranks from its check sample, exactly, as flat does; session 43: 12K HNSW at N 64 0.92x N 256's p50,
    the same replies); above it, or with the check off, ``--candidates`` (at 1M, N 64 widened 25% of queries)."""
    for kind in ("hnsw", "ivf"):
        cfg = ServerConfig(shards=2, dense=DenseConfig(kind=kind, ann_check=1000))
        job = lambda chunks, **kw: query_job(oprag_pb2.QueryRequest(question="q", top_k=10, **kw), cfg, dim=4,  # noqa: E731
                                             generate=False, can_generate=False, chunks=chunks)
        assert [job(n).spec.candidates for n in (1, 1999, 2000, 2001, 10**6, 0)] == [64, 64, 64, 256, 256, 256]
        assert job(1500, mode=oprag_pb2.DENSE).spec.candidates == 256  # (min-max hybrid only, as with flat)
        off = ServerConfig(shards=2, dense=DenseConfig(kind=kind, ann_check=0))
        assert query_job(oprag_pb2.QueryRequest(question="q", top_k=10), off, dim=4, generate=False,
                         can_generate=False, chunks=10).spec.candidates == 256
    flat = ServerConfig(dense=DenseConfig(kind="flat"))
    assert query_job(oprag_pb2.QueryRequest(question="q", top_k=10), flat, dim=4, generate=False, can_generate=False,
                     chunks=10**6).spec.candidates == 64
