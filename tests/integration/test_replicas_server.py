"""``--shards 2 --replicas 2``: a replica process SIGKILLed under mixed ingest + query load fails
no request and loses no acknowledged document; it comes back with every acknowledged write
(proved by killing its sibling once it serves: the shard then answers from it alone), and after
a clean restart every replica serves the same corpus."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port

pytestmark = pytest.mark.integration
QUERIES = ["harbour high water", "tide tables", "ferry timetable winter", "lighthouse keeper log"]


def _replicas(server_pid: int, data_dir: Path) -> dict[tuple[int, int], int]:
    """``{(shard, replica): pid}`` of the shard processes, from the write-ahead log each holds open."""
    out = {}
    for p in psutil.Process(server_pid).children():
        try:
            files = [f.path for f in p.open_files()]
        except psutil.Error:
            continue
        for f in files:
            rel = Path(f).relative_to(data_dir) if f.startswith(str(data_dir)) else None
            if rel is None or rel.name != "wal.log":
                continue
            parts = rel.parts  # shard-i/wal.log or replica-r/shard-i/wal.log
            r = int(parts[0].split("-")[1]) if parts[0].startswith("replica-") else 0
            out[(int(parts[-2].split("-")[1]), r)] = p.pid
    return out


def _serving(data_dir: Path, server_pid: int, shard: int, replica: int, old_pid: int) -> bool:
    d = (data_dir if replica == 0 else data_dir / f"replica-{replica}") / f"shard-{shard}"
    pid = _replicas(server_pid, data_dir).get((shard, replica))
    return pid is not None and pid != old_pid and not (d / "STALE").exists()


def start_replicated(tmp_path: Path, docs: int) -> tuple[ServerProcess, Path, dict[tuple[int, int], int]]:
    """A started ``--shards 2 --replicas 2`` server (no generator) on ``tmp_path`` holding ``docs``
    documents ``base<i>``: the server, its data directory (resolved) and :func:`_replicas`."""
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--shards", "2",
                        "--replicas", "2").start()
    try:
        with OpRAGClient(srv.target, timeout=60) as c:
            c.ingest([Doc(f"base{i}", f"Tide tables for harbour {i} list high water times.") for i in range(docs)])
        pids = _replicas(srv.proc.pid, srv.data_dir.resolve())
        assert len(pids) == 4, pids
    except BaseException:
        srv.stop()
        raise
    return srv, srv.data_dir.resolve(), pids


def _snapshot(c: OpRAGClient) -> list[list[tuple[str, float]]]:
    return [[(h.chunk_id, round(h.score, 5)) for h in c.retrieve(q, mode="full_hybrid", top_k=10).hits]
            for q in QUERIES]


@pytest.mark.slow  # ~20 s of replica / object-storage restarts: in `make test-all`, out of the 10-minute default suite
def test_replica_killed_under_load_fails_nothing_and_catches_up(tmp_path):
    srv, data, pids = start_replicated(tmp_path, 20)
    try:
        with OpRAGClient(srv.target, timeout=30) as c:
            acked, errors, partial, stop = [], [], [], threading.Event()

            def writer():
                n = 0
                while not stop.is_set():
                    docs = [Doc(f"w{n}-{j}", f"Ferry timetable {n} winter sailing {j} from the harbour.")
                            for j in range(2)]
                    try:
                        c.ingest(docs)
                        acked.extend(d.id for d in docs)
                    except Exception as exc:  # noqa: BLE001 - any failure counts
                        errors.append(f"write: {exc}")
                    n += 1

            def reader():
                while not stop.is_set():
                    try:
                        res = c.retrieve("harbour high water", mode="full_hybrid", top_k=10)
                        if res.retrieval.partial:
                            partial.append(list(res.retrieval.missing_shards))
                    except Exception as exc:  # noqa: BLE001
                        errors.append(f"query: {exc}")

            threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
            for t in threads:
                t.start()
            try:
                while len(acked) < 6:
                    time.sleep(0.05)
                victim = pids[(0, 0)]
                os.kill(victim, signal.SIGKILL)
                deadline = time.time() + 40
                while not _serving(data, srv.proc.pid, 0, 0, victim):
                    assert time.time() < deadline, "replica 0 of shard 0 did not serve again"
                    time.sleep(0.1)
                n = len(acked)
                while len(acked) < n + 4:  # writes reach the returned replica too
                    time.sleep(0.05)
            finally:
                stop.set()
                for t in threads:
                    t.join(30)
            assert errors == [] and partial == []
            before, stats = _snapshot(c), c.stats()
            assert stats.documents == 20 + len(acked)
            # the sibling goes: shard 0 is answered by the replica that came back alone
            sibling = _replicas(srv.proc.pid, data)[(0, 1)]
            os.kill(sibling, signal.SIGKILL)
            assert _snapshot(c) == before
            assert c.stats().documents == 20 + len(acked)
            deadline = time.time() + 40
            while not _serving(data, srv.proc.pid, 0, 1, sibling):
                assert time.time() < deadline, "replica 1 of shard 0 did not serve again"
                time.sleep(0.1)
            assert _snapshot(c) == before and c.health() == "SERVING"
        srv.stop()  # a clean restart: every replica loads its own directory and serves
        srv.start()
        with OpRAGClient(srv.target, timeout=30) as c:
            assert c.stats().documents == 20 + len(acked) and _snapshot(c) == before
            assert len(_replicas(srv.proc.pid, data)) == 4 and not list(data.rglob("STALE"))
    finally:
        srv.stop()
