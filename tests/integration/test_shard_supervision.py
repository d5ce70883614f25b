"""A shard process that dies is detected and restarted; meanwhile results are complete or
explicitly partial, never silently incomplete."""

from __future__ import annotations

import os
import signal
import time

import grpc
import psutil
import pytest

from oprag_client.cli_ingest import outcome_unknown
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration


def _shard_pids(server_pid: int) -> list[int]:
    kids = psutil.Process(server_pid).children()
    return [p.pid for p in kids if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def test_killed_shard_is_restarted_and_partial_results_are_flagged(tmp_path):
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--shards", "2").start()
    try:
        with OpRAGClient(srv.target, timeout=30) as c:
            r = c.ingest([Doc(f"doc{i}", f"Tide tables for harbour {i} list high water times.") for i in range(20)])
            before = c.stats()
            pids = _shard_pids(srv.proc.pid)
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            # trial48 #18: an ingest the dead shard refuses (its final message sent, the commit never begun) says
            # in its status that nothing was stored: the CLI reported "stored whole or not at all"
            with pytest.raises(grpc.RpcError) as refused:
                c.ingest([Doc(f"late{i}", f"Late tide note {i}.") for i in range(20)])
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert refused.value.nothing_stored is True and not outcome_unknown(refused.value)
            saw_not_serving = saw_stats_missing = saw_writes_down = False
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    res = c.retrieve("harbour high water", mode="dense", top_k=20, min_seq=r.seq)
                except Exception as exc:  # noqa: BLE001 - only explicit statuses are acceptable
                    assert "UNAVAILABLE" in str(exc), exc
                    continue
                if res.retrieval.partial:
                    assert list(res.retrieval.missing_shards) and len(res.hits) < 20
                else:
                    assert len(res.hits) == 20, "an incomplete result without the partial flag"
                st = c.stats()  # Stats too: the totals are complete or the missing shards are named
                if st.missing_shards:
                    saw_stats_missing = True
                    assert st.documents < before.documents and len(st.shards) == 1
                    assert [s.shard for s in st.shards] == [i for i in (0, 1) if i not in st.missing_shards]
                else:
                    assert (st.documents, st.chunks) == (before.documents, before.chunks), \
                        "Stats counted the answering shards only, without naming the missing one"
                status = c.health()
                saw_not_serving |= status == "NOT_SERVING"
                # trial51 #5: the write path's name said SERVING while every write failed UNAVAILABLE
                writes = c.health("oprag.v1.OpRAG.Ingest")
                saw_writes_down |= writes == "NOT_SERVING"
                if status == "SERVING" and not res.retrieval.partial and len(_shard_pids(srv.proc.pid)) == 2 \
                        and saw_not_serving:
                    break
                time.sleep(0.05)
            assert saw_not_serving, "health never reported the dead shard"
            assert saw_stats_missing, "Stats never named the dead shard in missing_shards"
            assert saw_writes_down, "the Ingest health name never reported the dead shard"
            assert c.health() == "SERVING" and c.health("oprag.v1.OpRAG.Ingest") == "SERVING"
            after = c.stats()
            assert (after.documents, after.chunks) == (before.documents, before.chunks)  # (nothing "late" stored)
            assert len(c.retrieve("harbour high water", mode="full_hybrid", top_k=20).hits) == 20
    finally:
        srv.stop()
