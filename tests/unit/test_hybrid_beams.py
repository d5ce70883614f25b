"""shards/beams.py: which HNSW beam each query of a shard search uses (``--hybrid-ef-search``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oprag_server.config import DenseConfig
from oprag_server.shards import beams


class _Postings:
    def __init__(self, df: dict[str, int]) -> None:
        self._df = df

    def df(self, term: str) -> int:
        return self._df.get(term, 0)


def _store(**dense):
    return SimpleNamespace(dense=SimpleNamespace(params=DenseConfig(**dense)), postings=_Postings({"cell": 3, "gene": 1}))


def _req(terms, mode="hybrid", ef=0):
    return SimpleNamespace(mode=mode, ef_search=ef, batch=SimpleNamespace(terms=terms))


def test_hybrid_queries_with_a_term_here_take_the_hybrid_beam():
    st = _store(kind="hnsw")
    got = beams.of(st, _req([["cell"], ["zz"], [], ["zz", "gene"]]), [0, 1, 2, 3])
    assert got == {320: [0, 3], 0: [1, 2]}
    assert beams.of(st, _req([["cell"], ["zz"]]), [1]) == {0: [1]}
    assert beams.of(st, _req([["cell"]]), []) == {}


@pytest.mark.parametrize("mode,ef,dense,want", [
    ("dense", 0, {"kind": "hnsw"}, {0: [0]}),  # dense mode: the index default
    ("hybrid", 77, {"kind": "hnsw"}, {77: [0]}),  # the request's own beam
    ("hybrid", 0, {"kind": "ivf"}, {0: [0]}),  # (nprobe: untouched)
    ("hybrid", 0, {"kind": "hnsw", "hybrid_ef_search": 0}, {0: [0]}),  # off
    ("hybrid", 0, {"kind": "hnsw", "ef_search": 200}, {0: [0]}),  # a default below it: kept
    ("hybrid", 0, {"kind": "hnsw", "ef_search": 600, "hybrid_ef_search": 400}, {400: [0]}),
])
def test_other_requests_keep_their_beam(mode, ef, dense, want):
    assert beams.of(_store(**dense), _req([["cell"]], mode, ef), [0]) == want


def test_widest_knobs():
    assert beams.widest({}, {"ef_search": 320}) == {"ef_search": 320}
    assert beams.widest({"ef_search": 1280}, {"ef_search": 512}) == {"ef_search": 1280}


def test_config_range():
    with pytest.raises(ValueError, match="hybrid_ef_search"):
        DenseConfig(kind="hnsw", hybrid_ef_search=-1)
    with pytest.raises(ValueError, match="hybrid_ef_search"):
        DenseConfig(kind="hnsw", hybrid_ef_search=70000)
