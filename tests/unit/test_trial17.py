"""Findings of trial17 (a new user probing ANN indexes, odd inputs and error messages)."""

from __future__ import annotations

import pytest

from oprag_server import cli
from oprag_server.config import DenseConfig


@pytest.mark.parametrize("m", [0, 1, 513, 100_000])
def test_hnsw_m_out_of_range_is_refused_at_start(m, capsys):
    """--hnsw-m 1 used to start, and the first ingest crashed the shard process (FAISS divides by
    ln(M) = 0: SIGSEGV), the ingest failing UNAVAILABLE; 100,000 started too (800 KB of links
    per vector). Both are start-up errors now, exit status 2, naming the option and the range."""
    with pytest.raises(ValueError, match=r"hnsw_m \(--hnsw-m\) must be in \[2, 512\]"):
        DenseConfig(kind="hnsw", hnsw_m=m)
    assert cli.main(["--dense-index", "hnsw", "--hnsw-m", str(m)]) == 2
    assert "--hnsw-m" in capsys.readouterr().err


def test_hnsw_m_bounds_are_usable():
    assert DenseConfig(kind="hnsw", hnsw_m=2).hnsw_m == 2
    assert DenseConfig(kind="hnsw", hnsw_m=512).hnsw_m == 512
