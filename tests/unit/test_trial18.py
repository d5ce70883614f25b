"""Findings of trial18 (a new user probing start-up options, a full data directory and the CLI)."""

from __future__ import annotations

import pytest

from oprag_server import cli
from oprag_server.config import IngestConfig, ServerConfig


@pytest.mark.parametrize("n", [0, -1])
def test_upsert_batch_below_one_is_refused_at_start(n, capsys):
    """--upsert-batch 0 used to start, and then every ingest failed with INTERNAL ("ValueError:
    need at least one array to stack": the upsert stage sent empty batches); now a start-up error,
    exit status 2, naming the option's value."""
    with pytest.raises(ValueError, match=r"upsert batch must be >= 1, got "):
        ServerConfig(ingest=IngestConfig(upsert_batch=n))
    assert cli.main(["--upsert-batch", str(n)]) == 2
    assert f"upsert batch must be >= 1, got {n}" in capsys.readouterr().err


def test_upsert_batch_of_one_is_usable():
    assert ServerConfig(ingest=IngestConfig(upsert_batch=1)).ingest.upsert_batch == 1
