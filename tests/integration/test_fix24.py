"""trial24 findings over a real server (two shard processes, HTTP port, no generator).

#1: HYBRID said ``certified`` and still returned another top-k (and other scores) than
FULL_HYBRID when every chunk a filter allows holds a query term ("the" in a set of paragraphs):
exact mode normalises BM25 from the lowest score of those chunks, dense-first hybrid used 0."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc
from server_fixtures import http_server  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)

_WORDS = ("harbour lighthouse keeper storm season critics album church tower river bridge market festival "
          "lobster diet race winner engine railway castle garden poet novel").split()
_VOCAB = _WORDS + [f"w{i}" for i in range(400)]


def _paragraphs(n: int, seed: int, the: bool) -> list[str]:
    """Paragraphs of 20-40 words (Zipf-like over ``_VOCAB``: most words rare, so their idf is
    positive); with ``the``, each holds "the" at least once."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(_VOCAB) + 1)
    p /= p.sum()
    out = []
    for _ in range(n):
        words = rng.choice(_VOCAB, size=int(rng.integers(20, 40)), p=p).tolist()
        for _ in range(int(rng.integers(1, 4)) if the else 0):
            words.insert(int(rng.integers(0, len(words) + 1)), "the")
        out.append(" ".join(words))
    return out


# "the" in 160 of 420 documents (idf > 0), every one of them in the set a filter allows
DOCS = ([Doc(f"set-{i}", p, metadata={"set": "every"}) for i, p in enumerate(_paragraphs(160, 24, True))]
        + [Doc(f"free-{i}", p, metadata={"set": "free"}) for i, p in enumerate(_paragraphs(260, 25, False))])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from http_server(tmp_path_factory, "fix24", "--generator", "none", "--shards", "2", docs=DOCS, timeout=120)


def test_hybrid_equals_full_hybrid_when_every_allowed_chunk_holds_a_query_term(server):
    c = server.grpc
    certified = 0
    for q in ("the lobster diet", "the first race of the season", "what did the critics say about the album",
              "the storm made landfall near the harbour", "the church tower"):
        for cand in (4, 16, 64):
            h = c.retrieve(q, top_k=5, mode="hybrid", candidates=cand, filters={"set": "every"})
            f = c.retrieve(q, top_k=5, mode="full_hybrid", candidates=cand, filters={"set": "every"})
            assert [x.chunk_id for x in h.hits] == [x.chunk_id for x in f.hits], (q, cand, h.retrieval.certified)
            np.testing.assert_allclose([x.score for x in h.hits], [x.score for x in f.hits], rtol=1e-12, atol=0)
            certified += h.retrieval.certified
    assert certified >= 10  # (not only equal after widening rounds ran out)
