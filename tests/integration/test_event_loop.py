"""``oprag serve --event-loop uvloop`` (a real server, 2 shard processes): the frontend on
libuv's loop answers Ingest, Retrieve and Stats, and
``--event-loop`` refuses an unknown loop (a ValueError from the config: exit 2 with the message)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess
from oprag_server.cli import build_parser, config_from_args

pytestmark = pytest.mark.integration


def test_uvloop_frontend_serves_ingest_retrieve_and_stats(tmp_path):
    """One server on uvloop (the log names the loop class, so an ignored flag fails): each
    document's own vector finds it first in dense mode, its words in lexical mode, and hybrid
    and full_hybrid agree on the top hit. (That uvloop's replies equal asyncio's hit for hit is
    bench.hotpath's identical_hits in bench/RESULTS.md, "The frontend on uvloop".)"""
    pytest.importorskip("uvloop")
    rng = np.random.default_rng(5)
    V = rng.standard_normal((40, 384)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    docs = [Doc(f"d{i}", " ".join(words[(i * j) % 8] for j in range(1, 6)) + f" item{i}", vector=V[i])
            for i in range(40)]
    log = tmp_path / "uvloop.log"
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "2", "--event-loop", "uvloop",
                                      log_path=log)
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            assert c.stats().chunks == len(docs)
            for i in (0, 9, 23, 39):
                assert c.retrieve(f"item{i}", mode="dense", top_k=3, query_vector=V[i].tolist()).hits[0].chunk_id == f"d{i}#0"
                assert c.retrieve(f"item{i}", mode="lexical", top_k=3).hits[0].chunk_id == f"d{i}#0"
                tops = {c.retrieve(f"item{i}", mode=m, top_k=3, query_vector=V[i].tolist()).hits[0].chunk_id
                        for m in ("hybrid", "full_hybrid")}
                assert tops == {f"d{i}#0"}
    finally:
        srv.stop()
    line = next(ln for ln in log.read_text().splitlines() if "frontend event loop:" in ln)
    assert "uvloop" in line, line


def test_unknown_event_loop_is_refused():
    with pytest.raises(ValueError, match="--event-loop must be 'asyncio' or 'uvloop'"):
        config_from_args(build_parser().parse_args(["--event-loop", "trio"]))
    assert config_from_args(build_parser().parse_args([])).event_loop == "asyncio"
    assert config_from_args(build_parser().parse_args(["--event-loop", "uvloop"])).event_loop == "uvloop"
