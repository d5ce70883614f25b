"""``oprag serve --event-loop uvloop`` (a real server, 2 shard processes): the frontend on
libuv's loop answers Ingest, Retrieve and Stats with the same hits as asyncio's loop, and
``--event-loop`` refuses an unknown loop (a ValueError from the config: exit 2 with the message)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess
from oprag_server.cli import build_parser, config_from_args

pytestmark = pytest.mark.integration


def _hits(tmp_path, loop: str, docs, queries):
    log = tmp_path / f"{loop}.log"
    srv = ServerProcess.on_free_ports(tmp_path / loop, "--generator", "none", "--shards", "2", "--event-loop", loop,
                                      log_path=log)
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            assert c.stats().chunks == len(docs)
            out = []
            for text, v in queries:
                for mode in ("hybrid", "full_hybrid", "lexical"):
                    r = c.retrieve(text, mode=mode, top_k=5, query_vector=v.tolist())
                    out.append([(h.chunk_id, h.score) for h in r.hits])
    finally:
        srv.stop()
    line = next(ln for ln in log.read_text().splitlines() if "frontend event loop:" in ln)
    assert ("uvloop" in line) == (loop == "uvloop"), line
    return out


def test_uvloop_frontend_gives_the_same_hits_as_asyncio(tmp_path):
    pytest.importorskip("uvloop")
    rng = np.random.default_rng(5)
    V = rng.standard_normal((50, 384)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    docs = [Doc(f"d{i}", " ".join(words[(i * j) % 8] for j in range(1, 6)) + f" item {i}", vector=V[i])
            for i in range(40)]
    queries = [("alpha gamma", V[3] + 0.1 * V[7]), ("omega item 9", V[9]), ("theta sigma", V[20])]
    uv = _hits(tmp_path, "uvloop", docs, queries)
    base = _hits(tmp_path, "asyncio", docs, queries)
    assert uv == base and all(len(h) == 5 for h in uv)


def test_unknown_event_loop_is_refused():
    with pytest.raises(ValueError, match="event loop must be 'asyncio' or 'uvloop'"):
        config_from_args(build_parser().parse_args(["--event-loop", "trio"]))
    assert config_from_args(build_parser().parse_args([])).event_loop == "asyncio"
    assert config_from_args(build_parser().parse_args(["--event-loop", "uvloop"])).event_loop == "uvloop"
