"""trial35: a stream whose connection is lost after its final message was sent may have been
committed (README: "Ingest semantics"), so ``oprag ingest`` must not say it stored nothing;
one cut short before its final message stored nothing. A real gRPC server on a loopback port
in its own process, with a stand-in servicer that ends its process (``os._exit``, as a kill -9
would) when the final message arrives, or refuses the stream at its first message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import free_port, oprag_cli

ROOT = Path(__file__).resolve().parents[2]

SERVER = textwrap.dedent("""
    import os, sys
    from concurrent import futures
    import grpc
    from oprag.v1 import oprag_pb2_grpc

    port, mode = sys.argv[1], sys.argv[2]

    class Servicer(oprag_pb2_grpc.OpRAGServicer):
        def Ingest(self, requests, context):
            for r in requests:
                if mode == "exit-at-final" and r.final:
                    os._exit(0)  # the process ends with the whole stream received, before it answers
                if mode == "refuse-at-first":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "a shard is unavailable (it is being restarted)")

    srv = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 << 20)])
    oprag_pb2_grpc.add_OpRAGServicer_to_server(Servicer(), srv)
    srv.add_insecure_port("127.0.0.1:" + port)
    srv.start()
    print("READY", flush=True)
    srv.wait_for_termination()
""")


@pytest.fixture
def stand_in():
    procs = []

    def start(mode: str) -> str:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.Popen([sys.executable, "-c", SERVER, str(port), mode], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        assert p.stdout.readline().strip() == "READY"
        return f"127.0.0.1:{port}"

    yield start
    for p in procs:
        p.kill()
        p.wait(30)


def test_the_client_marks_whether_the_final_message_was_sent(stand_in):
    with OpRAGClient(stand_in("exit-at-final"), timeout=60) as c, pytest.raises(grpc.RpcError) as got:
        c.ingest([Doc(id="a", text="one"), Doc(id="b", text="two")])
    assert got.value.code() == grpc.StatusCode.UNAVAILABLE and got.value.final_message_sent is True
    assert got.value.nothing_stored is False  # (cut after the final message: the outcome is unknown)
    # refused at the first message while the client's next documents are not ready yet: gRPC's
    # sending thread can take the final message only once they are (a stream of large messages
    # raced here: with loopback flow control windows gRPC may pull all of them before the refusal
    # arrives, and then the flag rightly says the final message was handed over)
    release = threading.Event()

    def docs():
        yield from (Doc(id=f"d{i}", text="word") for i in range(65))  # the 65th hands over the first message
        release.wait(60)
        yield from (Doc(id=f"e{i}", text="word") for i in range(200))

    try:
        with OpRAGClient(stand_in("refuse-at-first"), timeout=60) as c, pytest.raises(grpc.RpcError) as got:
            c.ingest(docs())
        assert got.value.code() == grpc.StatusCode.UNAVAILABLE and got.value.final_message_sent is False
        assert got.value.nothing_stored is True  # no final message, no commit (trial52 #6)
    finally:
        release.set()


def test_oprag_ingest_reports_a_stream_cut_after_its_final_message_as_unknown(stand_in, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i}"}) + "\n" for i in range(3)))
    out = subprocess.run([*oprag_cli(), "ingest", "--server", stand_in("exit-at-final"), "--format", "jsonl",
                          "--json", "--no-progress", str(f)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    err = json.loads(out.stdout)["error"]
    assert (err["code"], err["stored"]) == ("UNAVAILABLE", None)
    assert "ended UNAVAILABLE after its final message was sent" in out.stderr and "stored whole or not at all" in out.stderr
    assert "Traceback" not in out.stderr
