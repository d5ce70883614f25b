"""trial24 finding #1 over a real server (two shard processes, MiniLM, no generator): ingest's
content-hash reuse gave a chunk the server must embed the vector a client had supplied for the
same text (another document's, across streams, after that document was deleted, and the same
document re-ingested without its vector). Reuse now takes only vectors the server's embedder made.

Each check reads a chunk's stored vector through dense scores: a dense query with the client's
vector scores 1.0 on a chunk holding that vector; the question embedded by the server (the same
text) scores 1.0 on a chunk holding the embedder's vector (a text's vector does not depend on
what it is batched with: README)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc
from server_fixtures import http_server  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = pytest.mark.integration

DIM = 384
FILLER = [Doc(f"filler-{i}", f"Filler note {i} on the tides, the harbour and ferry timetables of port {i}.")
          for i in range(8)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from http_server(tmp_path_factory, "fix24a", "--generator", "none", "--shards", "2", docs=FILLER,
                           timeout=120)


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


def _score(c, text: str, doc_id: str, seq: int, query_vector: np.ndarray | None = None) -> float | None:
    """Dense score of ``doc_id``'s chunk for ``text`` (embedded by the server) or ``query_vector``."""
    hits = c.retrieve(text, mode="dense", top_k=20, query_vector=query_vector, min_seq=seq).hits
    return next((h.dense_score for h in hits if h.doc_id == doc_id), None)


def _embedded(c, text: str, doc_id: str, seq: int, supplied: np.ndarray) -> None:
    """``doc_id``'s chunk holds the embedder's vector of ``text``, not ``supplied``."""
    s = _score(c, text, doc_id, seq)
    assert s is not None and s > 0.999, (doc_id, s)
    s = _score(c, text, doc_id, seq, supplied)
    assert s is None or s < 0.5, (doc_id, s)


def test_a_supplied_vector_is_never_reused_for_a_chunk_the_server_embeds(server):
    c = server.grpc
    text = "the quokka crossing at midnight under a violet moon"
    rv = _vec(42)
    r = c.ingest([Doc("own-vec", text, vector=rv)])
    assert r.chunks_written == 1 and _score(c, text, "own-vec", r.seq, rv) > 0.999
    # another document, another stream (and for some of these ids another shard)
    for i in range(4):
        r = c.ingest([Doc(f"embed-me-{i}", text)])
        assert r.chunks_written == 1 and r.chunks_reused == 0
        _embedded(c, text, f"embed-me-{i}", r.seq, rv)
    assert _score(c, text, "own-vec", r.seq, rv) > 0.999  # a supplied vector is kept as given
    # the source deleted: later documents and re-ingests still get the embedder's vector
    c.delete(["own-vec"])
    r = c.ingest([Doc("embed-me-0", text), Doc("embed-me-late", text)])
    assert r.documents_replaced == 1 and r.chunks_reused == 1  # embed-me-0's own, unchanged: a real reuse
    for d in ("embed-me-0", "embed-me-late"):
        _embedded(c, text, d, r.seq, rv)


def test_reingest_without_vector_replaces_a_supplied_vector(server):
    c = server.grpc
    text = "a wrongly embedded note about the migration of arctic terns"
    bad = _vec(7777)
    r = c.ingest([Doc("fixme", text, vector=bad)])
    assert _score(c, text, "fixme", r.seq, bad) > 0.999
    r = c.ingest([Doc("fixme", text)])
    assert r.documents_replaced == 1 and r.chunks_reused == 0
    _embedded(c, text, "fixme", r.seq, bad)
    assert c.retrieve("arctic tern migration", mode="dense", top_k=1, min_seq=r.seq).hits[0].doc_id == "fixme"
    r = c.ingest([Doc("fixme", text)])  # unchanged, server-embedded: reused and counted
    assert r.documents_replaced == 1 and r.chunks_reused == 1
    _embedded(c, text, "fixme", r.seq, bad)


def test_same_text_in_one_stream_and_across_streams_agree(server):
    c = server.grpc
    text = "copper kettles hum softly in the lighthouse kitchen"
    a = _vec(5)
    r = c.ingest([Doc("own-c", text, vector=a), Doc("txt-c", text)])
    _embedded(c, text, "txt-c", r.seq, a)
    r = c.ingest([Doc("own-d", text, vector=_vec(6))])
    r = c.ingest([Doc("txt-d", text)])
    _embedded(c, text, "txt-d", r.seq, a)
    assert _score(c, text, "txt-d", r.seq, _vec(6)) is None or _score(c, text, "txt-d", r.seq, _vec(6)) < 0.5
