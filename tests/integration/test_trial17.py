"""Issue 17 (same inputs, same plan, same output) at a real server's doors (generator off).

The server embeds the questions of concurrent Retrieves together (one encoder batch); a
question's vector used to differ by ~1e-7 with its batch mates (padding width, MKL's
row-count-dependent GEMM), so dense scores and near-tied orders depended on who else was asking.
"""

from __future__ import annotations

import asyncio

import pytest

from oprag_client.client import AsyncOpRAGClient, Doc
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration

TOPICS = ["lighthouse keeper", "river delta", "capital of France", "protein folding", "jazz piano",
          "tax law", "volcano eruption", "chess opening", "bread baking", "satellite orbit"]
QUESTIONS = ["lighthouse", "Who keeps the lighthouse on the rocky northern coast at night?",
             "Paris", "what is the capital of France and why did the kings choose it",
             "how do proteins fold", "jazz", "which chess opening suits a beginner who likes attacks",
             "bread", "How long does a satellite in low earth orbit take to circle the planet once?",
             "volcano eruption warning signs", "river delta formation over thousands of years", "tax"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("trial17"), free_port(), free_port(), "--generator", "none")
    srv.start()
    yield srv
    srv.stop()


def _key(reply) -> list[bytes]:
    return [h.SerializeToString(deterministic=True) for h in reply.hits]


def test_concurrent_retrieves_equal_each_question_alone(server, client):
    client.ingest([Doc(f"d{i}", f"Notes {i} about {TOPICS[i % len(TOPICS)]}: " + " ".join(
        TOPICS[(i * 7 + j) % len(TOPICS)] for j in range(i % 5 + 1))) for i in range(60)])
    alone = {q: _key(client.retrieve(q, top_k=10)) for q in QUESTIONS}
    assert all(alone.values())

    async def together(order):
        async with AsyncOpRAGClient(server.target, timeout=120) as c:
            replies = await asyncio.gather(*[c.retrieve(q, top_k=10) for q in order])
        return {q: _key(r) for q, r in zip(order, replies)}

    for rnd in range(4):  # different batch mates and positions each round
        order = QUESTIONS[rnd:] + QUESTIONS[:rnd] if rnd % 2 == 0 else QUESTIONS[::-1][rnd:]
        got = asyncio.run(together(order))
        for q in order:
            assert got[q] == alone[q], (rnd, q)
