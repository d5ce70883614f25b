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
    assert first_candidates(r, "hybrid", "minmax", False, 10, "flat") == 200  # 0: --candidates
    for name in ("hybrid_candidates", "lexical_candidates"):  # refused like --candidates, not clamped (trial33b)
        with pytest.raises(ValueError, match=rf"{name} must be in \[0, 4096\] \(--{name.replace('_', '-')}\), got 5000"):
            RetrievalConfig(**{name: 5000})
    r = RetrievalConfig(hybrid_candidates=4096)
    assert first_candidates(r, "hybrid", "minmax", False, 10, "flat") == r.max_candidates
    with pytest.raises(ValueError, match=r"hybrid_candidates must be in \[0, 4096\] \(--hybrid-candidates\), got -1"):
        RetrievalConfig(hybrid_candidates=-1)
    cfg = ServerConfig(retrieval=RetrievalConfig(hybrid_candidates=16))
    assert _job(cfg, top_k=2).spec.candidates == 16
    with pytest.raises(InvalidArgument, match="candidates"):
        _job(candidates=5000)


def test_an_ann_index_keeps_the_window():
    """HNSW / IVF: the beam finds ef_search rows whatever N, and shorter lists widen more at scale
    (1M: 25% vs 8% of SciFact queries; bench/RESULTS.md, session 33): N stays --candidates."""
    for kind in ("hnsw", "ivf"):
        cfg = ServerConfig(dense=DenseConfig(kind=kind))
        assert _job(cfg, top_k=10).spec.candidates == 256
        assert first_candidates(RetrievalConfig(), "hybrid", "minmax", False, 10, kind) == 256
