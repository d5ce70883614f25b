"""Fixtures shared by the integration test modules. Each module starts its own ``server``
(module scope, with the options it needs); ``client`` talks to it. A module that needs another
client (a different deadline, data ingested up front) defines its own ``client``."""

from __future__ import annotations

import pytest

from oprag_client.client import OpRAGClient


@pytest.fixture(scope="module")
def client(server):
    """A sync client of the module's ``server`` with a 120 s deadline per call."""
    with OpRAGClient(server.target, timeout=120) as c:
        yield c
