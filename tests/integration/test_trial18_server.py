"""Findings of trial18 at a real server's doors (a new user filling the data directory, ...).

The disk is made full with the shard process's RLIMIT_FSIZE (EFBIG on a write past the limit),
lowered and raised again from outside with prlimit(2), as in test_trial15.
"""

from __future__ import annotations

import resource
import time

import grpc
import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, free_port
from test_trial15 import _docs, _shard_pid  # (tests/integration is on sys.path: pytest's rootdir-relative import)
from test_replicas_server import _replicas

pytestmark = [pytest.mark.integration]


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit(2) (Linux)")
def test_a_full_disk_prints_one_shard_traceback_not_one_per_failed_write(tmp_path):
    """Each write refused by a full disk (and each periodic snapshot, every 30 s) made the shard
    print its traceback, two chained ones of ~20 lines, to the service log -- whose volume may be
    the full one -- while the frontend logs the condition once per change. The shard now prints a
    disk error's traceback once per kind (again after 10 minutes)."""
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "1")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(_docs("before", 5, 5, 1))
            pid = _shard_pid(srv)
            wal = tmp_path / "data" / "shard-0" / "wal.log"
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (wal.stat().st_size + 1024, hard))  # the disk fills
            start = len(srv.lines)
            for i in range(4):
                with pytest.raises(grpc.RpcError) as e:
                    c.ingest(_docs(f"full{i}x", 20, 50, 2 + i))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "could not write to its data directory" in e.value.details(), e.value.details()
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))  # space is back
            c.ingest(_docs("after", 3, 5, 9))
            assert c.stats().documents == 8
        log = srv.lines[start:]
        tracebacks = [line for line in log if line.startswith("Traceback")]
        assert len(tracebacks) == 1, "".join(log[-80:])
        frontend = [line for line in log if "ERROR oprag: a data directory could not be written" in line]
        assert len(frontend) == 1, "".join(log[-80:])  # the frontend's line, once
    finally:
        srv.stop()


def test_sigterm_stops_in_well_under_the_shard_teardown_time_and_keeps_every_document(tmp_path):
    """After its final snapshot each shard process answered SHUTDOWN and then tore its
    interpreter down (numba, FAISS, Arrow: seconds of native teardown), while the frontend joined
    the processes one by one: SIGTERM of an idle 2-shard server took 3.5 s, 7.2 s with 2 replicas
    (load ~5). A shard now ends with os._exit once it answered, as it does when its frontend left:
    0.45 s and 0.84 s. Nothing is lost: the restart serves every document."""
    import time

    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "2", "--replicas", "2")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(_docs("kept", 30, 5, 4))
        t = time.monotonic()
        assert srv.stop() == 0
        took = time.monotonic() - t
        assert took < 3.0, f"SIGTERM took {took:.1f} s"
        srv.start()
        with OpRAGClient(srv.target, timeout=120) as c:
            assert c.stats().documents == 30
            assert c.retrieve("markerkeptx7", mode="lexical", top_k=1).hits[0].doc_id == "kept7"
    finally:
        srv.stop()


def test_an_id_sent_twice_in_a_stream_keeps_its_last_version_when_the_versions_take_different_paths(tmp_path):
    """README: "A document id sent twice in one stream keeps its last version". The shard kept
    the version whose rows came last in the staged batch, and a chunk whose vector is reused
    (its text is stored already) or supplied by the client goes to the shard at once, ahead of
    earlier chunks still being embedded: the stream [d: "first ...", d: "second ..."] stored
    "first ..." whenever "second ..."'s text was already in the corpus. The shard now keeps the
    highest generation (the frontend numbers a stream's documents in order)."""
    srv = ServerProcess.on_free_ports(tmp_path / "data", "--generator", "none", "--shards", "1")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            def stored(doc_id: str) -> list[str]:
                hits = c.retrieve("zebuword yakword ownword", mode="lexical", top_k=20).hits
                return [h.text for h in hits if h.doc_id == doc_id]

            c.ingest([Doc("other", "second version yakword")])  # its text's vector is now reusable
            r = c.ingest([Doc("d", "first version zebuword"), Doc("d", "second version yakword")])
            assert r.documents_written == 1  # ("other"'s vector reused: not counted, README)
            assert stored("d") == ["second version yakword"]
            vec = np.random.default_rng(7).standard_normal(384).astype(np.float32)
            c.ingest([Doc("e", "first version zebuword embedded"), Doc("e", "second version ownword", vector=vec)])
            assert stored("e") == ["second version ownword"]
            assert c.stats().documents == 3
        srv.kill9()
        srv.start()  # the write-ahead log replays to the same versions
        with OpRAGClient(srv.target, timeout=120) as c:
            assert stored("d") == ["second version yakword"] and stored("e") == ["second version ownword"]
    finally:
        srv.stop()



@pytest.fixture(scope="module")
def small_queue_replicas(tmp_path_factory):
    """One server for the checks below (neither restarts it): no generator, one shard held by 2
    replicas, a query queue of 1, an HTTP port (``srv.url``); two documents ``r0``, ``r1``."""
    http_port = free_port()
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("t18") / "data", "--generator", "none", "--shards", "1",
                                      "--replicas", "2", "--queue-capacity", "1", "--http-port", str(http_port))
    srv.start()
    srv.url = f"http://127.0.0.1:{http_port}/v1"
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(_docs("r", 2, 5, 3))  # (each replica's write-ahead log is open now)
        yield srv
    finally:
        srv.stop()


def test_the_log_names_the_replica_of_each_shard_process(small_queue_replicas):
    """With --replicas 2 the server logged ``shard 0: process pid P`` once per replica, the same
    words twice: which process held which replica could not be told (the test helpers took the
    last line). The line now names the replica when a shard has several (``shard 0 replica 1:
    process pid P``), the process that holds that replica's write-ahead log."""
    srv = small_queue_replicas
    held = _replicas(srv.proc.pid, srv.data_dir.resolve())
    assert {r: _shard_pid(srv, replica=r) for r in (0, 1)} == {0: held[(0, 0)], 1: held[(0, 1)]}, held
    assert not [line for line in srv.lines if "shard 0: process pid" in line]


def test_a_full_queue_of_retrieves_hints_a_retrieval_s_time_not_a_generation_s(small_queue_replicas):
    """The trial's repro: --generator none --queue-capacity 1, 6 concurrent Retrieve clients (no
    retry): every refusal carried ``retry-after-ms: 500``, the generation-batch EWMA's start value
    (never updated without a generator), for Retrieves of tens of ms. The hint now follows the
    retrieval's service time (engine/admission.py): at least 50 ms, at most the slowest answer seen."""
    import threading

    srv, hints, took, lock = small_queue_replicas, [], [], threading.Lock()

    def client(k: int) -> None:
        with OpRAGClient(srv.target, timeout=60) as c:
            for i in range(12):
                t = time.perf_counter()
                try:
                    c.retrieve(f"markerrx{(k + i) % 2} padding", top_k=2)
                    with lock:
                        took.append((time.perf_counter() - t) * 1000)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    with lock:
                        hints.extend(int(v) for key, v in e.trailing_metadata() if key == "retry-after-ms")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hints and took, (hints, took)
    assert all(50 <= h <= max(50, max(took)) for h in hints), (sorted(hints)[-5:], sorted(took)[-5:])


def test_embeddings_refuse_invisible_only_input_as_a_question_is_refused(small_queue_replicas):
    """POST /v1/embeddings checked its inputs with str.strip(), so "\\u200b\\u2060" (zero-width
    space, word joiner: invisible, not whitespace) was embedded, while the same text as a
    question is INVALID_ARGUMENT on every query path (README: an empty question is nothing but
    whitespace and invisible characters). Now a 400 naming the input. (On the module's server,
    last: its requests are sequential, so the queue of 1 refuses none of them.)"""
    import requests

    url = small_queue_replicas.url
    for text in ("\u200b\u2060", " \u00ad\n"):
        r = requests.post(f"{url}/embeddings", json={"model": "minilm", "input": ["fine", text]}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"].startswith("input[1] must have visible text"), err
        r = requests.post(f"{url}/retrieve", json={"query": text}, timeout=60)
        assert r.status_code == 400 and "question is empty" in r.json()["error"]["message"], r.text
    r = requests.post(f"{url}/embeddings", json={"model": "minilm", "input": "Gesamt\u00adkonzept"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384, r.text
