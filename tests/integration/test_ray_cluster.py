"""Shards as Ray actors on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``:
separate raylets on this machine): shards land on different nodes; killing the node holding a
shard under concurrent commits and queries loses no acknowledged document, flags every
incomplete result as partial, and the shard serves again on another node with the results an
in-process reference gives for the same committed transactions. And ``oprag serve
--ray-address local`` serves end to end.

Skipped without the 'ray' extra; about 1.5 minutes on 2 cores (plus about 1 minute for the
replica test and 45 s for the object-storage node loss, both marked ``slow``). ``-m "not ray"`` leaves it
out; ``python -m bench.cluster`` runs the 5-kill version with the data-plane figures.
"""

from __future__ import annotations

import asyncio
import os

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the 'ray' extra: pip install -e '.[ray]'")

from bench import _internals, cluster as harness  # noqa: E402
from oprag_client.client import Doc, OpRAGClient  # noqa: E402
from oprag_client.testing import ServerProcess, free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture()
def three_nodes():
    c = harness.start_cluster(workers=3)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_node_loss_loses_no_acknowledged_document_and_flags_partial_results(three_nodes, tmp_path):
    res = asyncio.run(harness.node_loss(_internals.shard_plane(), three_nodes, tmp_path, kills=1))
    assert res["shard_nodes_distinct"], res
    assert res["moved_to_other_node"], res
    assert res["acked_docs"] > 0 and res["acked_docs_lost"] == 0, res
    assert res["documents_after"] == res["landed_docs"], res
    assert res["partial_results"] > 0 and res["silent_partial_results"] == 0 and res["failed_queries"] == 0, res
    assert res["failed_writes"] > 0, res  # writes were refused (UNAVAILABLE) while the shard was down
    assert res["identical_results"], res


@pytest.mark.slow
def test_node_loss_with_object_storage_recovers_on_a_node_with_nothing(three_nodes, tmp_path):
    """``--storage-uri`` (file://): the node holding shard 0 is removed and shard 0's local
    directory deleted with it; the shard comes back on another node from the object store."""
    uri = (tmp_path / "bucket").as_uri()
    res = asyncio.run(harness.node_loss(_internals.shard_plane(), three_nodes, tmp_path / "local", kills=1,
                                        storage=uri))
    assert res["moved_to_other_node"] and res["acked_docs"] > 0 and res["acked_docs_lost"] == 0, res
    assert res["documents_after"] == res["landed_docs"] and res["identical_results"], res
    assert res["silent_partial_results"] == 0 and res["failed_queries"] == 0, res
    assert (tmp_path / "bucket" / "shard-0" / "CURRENT").exists()


@pytest.mark.slow
def test_replicas_on_ray_a_node_loss_fails_no_request(tmp_path):
    """``--replicas 2`` as Ray actors (4 bundles, SPREAD over 5 one-CPU nodes): the node holding
    a replica of shard 0 is removed under load, then (once it serves again) the node holding its
    sibling: no request fails, no acknowledged document is lost, results are unchanged."""
    from bench.replicas import replica_loss

    c = harness.start_cluster(workers=5)
    try:
        res = asyncio.run(replica_loss(_internals.shard_plane(), tmp_path, kills=2, cluster=c))
    finally:
        ray.shutdown()
        c.shutdown()
    assert res["replicas_on_distinct_nodes"], res
    assert res["failed_requests"] == 0 and res["partial_results"] == 0 and res["queries"] > 0, res
    assert res["acked_docs"] > 0 and res["acked_docs_lost"] == 0, res
    assert res["documents_after"] == res["acked_docs"] and res["identical_results"], res


def test_serve_with_ray_address_local(tmp_path):
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--shards", "2",
                        "--ray-address", "local", "--ray-shard-cpus", "0.5").start()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest([Doc(f"doc{i}", f"Tide tables for harbour {i} list high water times.") for i in range(20)])
            st = c.stats()
            assert st.documents == 20 and len(st.shards) == 2
            hits = c.retrieve("high water at harbour 7", top_k=3)
            assert len(hits.hits) == 3 and not hits.retrieval.partial
    finally:
        srv.stop()
