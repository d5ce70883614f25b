"""``from oprag_client import OpRAGClient`` works (trial47 #4: the package's ``__init__`` was empty)."""

from __future__ import annotations

import pytest


def test_top_level_names_are_the_client_modules():
    import oprag_client
    from oprag_client import client

    from oprag_client import AsyncOpRAGClient, Doc, OpRAGClient, query_request  # noqa: F401

    assert set(oprag_client.__all__) <= set(dir(oprag_client))  # (tab completion; trial47b #3)
    assert OpRAGClient is client.OpRAGClient and Doc is client.Doc and query_request is client.query_request
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        oprag_client.Nope  # noqa: B018
