"""End to end against a REAL inference engine: the server runs ``--generator transformers-serve``
(transformers' own OpenAI-compatible server as a supervised child process, on the converted
SmolLM2), real shard processes, all-MiniLM-L6-v2. One engine for the module; short answers.

Skipped (with the reason) when ``transformers serve`` is not installed (extra ``engine``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, wait_until
from oprag_server.models.managed_engine import transformers_cli

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1200),  # an engine (re)start on a loaded 2-core machine can take minutes
    pytest.mark.skipif(transformers_cli() is None,
                       reason="`transformers serve` is not installed: pip install 'transformers[serving]' (extra engine)"),
]

QUERY_HEALTH = "oprag.v1.OpRAG.Query"
DOCS = [
    Doc("lighthouse", title="Varnholm Lighthouse", text=(
        "The Varnholm Lighthouse stands on a granite skerry at the mouth of the Varn fjord. It was completed in "
        "1874 and its lantern was designed by the engineer Ingrid Solberg.")),
    Doc("bees", title="Honey bee dances", text=(
        "Honey bee foragers tell their nestmates where food is by dancing on the comb. The angle of the waggle "
        "run encodes the direction of the flowers relative to the sun.")),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("oprag-engine")
    srv = ServerProcess.on_free_ports(data, "--shards", "1", "--generator", "transformers-serve",
                                      "--max-new-tokens", "8", "--generator-start-timeout-s", "900",
                                      "--generator-timeout-s", "600", "--monitor-fraction", "0")
    srv.start(timeout=900)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with OpRAGClient(server.target, timeout=600) as c:
        c.ingest(DOCS)
        yield c


def engine_proc(server) -> tuple[int, int]:
    """(port, pid) of the latest engine start, from the server's log line."""
    for line in reversed(server.lines):
        m = re.search(r"transformers serve is healthy on port (\d+) \(pid (\d+)\)", line)
        if m:
            return int(m.group(1)), int(m.group(2))
    raise AssertionError("no engine start in the server log")


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def query_health(server) -> int:
    with grpc.insecure_channel(server.target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=QUERY_HEALTH), timeout=10).status


def test_stream_sources_first_then_text_before_the_full_answer(client, server):
    t0, seen = time.perf_counter(), []
    for e in client.query_stream("Who designed the lantern of the Varnholm Lighthouse?", top_k=2, max_new_tokens=8,
                                 include_trace=True):
        seen.append((e.WhichOneof("event"), time.perf_counter() - t0, e))
    kinds = [k for k, _, _ in seen]
    assert kinds[0] == "sources" and kinds[-1] == "done" and set(kinds[1:-1]) == {"text"}
    texts = [t for k, t, _ in seen if k == "text"]
    assert len(texts) >= 2, "the engine's tokens should arrive as several text events"
    assert texts[0] < seen[-1][1]  # the first text event came before the full answer
    done = seen[-1][2].done
    assert "".join(e.text for k, _, e in seen if k == "text") == done.answer and done.completion_tokens > 0
    assert [s.op for s in done.trace.stages][-2:] == ["context", "generate"]
    assert query_health(server) == health_pb2.HealthCheckResponse.SERVING
    assert metric(server, "oprag_engine_tokens_total{kind=\"prompt\"}") > 0


def test_answers_equal_the_builtin_generator(server):
    """Same rendered chat, greedy: the builtin (in-process, row-wise attention, float32) and the
    engine (transformers serve, SDPA, float32 weights of the same conversion) give the same tokens."""
    from oprag_server.models.generator import HFGenerator
    from oprag_server.models.openai_engine import OpenAIGenerator
    from oprag_server.models.protocols import EngineUsage
    from oprag_server.operators.context import SYSTEM_PROMPT

    port, _ = engine_proc(server)
    builtin = HFGenerator("smollm2", device="cpu")
    engine = OpenAIGenerator(f"http://127.0.0.1:{port}/v1", str(builtin.cached_model_dir()),
                             tokenizer_dir=builtin.cached_model_dir())
    users = [f"Sources:\n\n[1] {d.title}\n{d.text}\n\nQuestion: {q}" for d, q in
             zip(DOCS, ["When was the lighthouse completed?", "What does the angle of the waggle run encode?"])]

    async def stream_all() -> list[tuple[str, EngineUsage]]:
        out = []
        for u in users:
            usage = EngineUsage()
            out.append(("".join([d async for d in engine.stream(engine.chat_messages(SYSTEM_PROMPT, u), 12, usage)]),
                        usage))
        await engine.aclose()
        return out

    got = asyncio.run(stream_all())
    want = builtin.generate([builtin.chat_prompt(SYSTEM_PROMPT, u) for u in users], 12)
    for u, (text, usage), ref in zip(users, got, want):
        assert text == ref.text
        # the engine renders the same chat template: same prompt tokens as counted locally
        assert usage.prompt_tokens == ref.prompt_tokens == engine.count_tokens(engine.chat_prompt(SYSTEM_PROMPT, u))


def test_stop_strings_reach_the_engine_and_cut_the_answer(client, server):
    """``stop`` goes to transformers serve in the request (its ``stop_strings``) and the stream is cut here too:
    the answer is the engine's full answer up to where the stop string completes, finish_reason "stop". Checked
    on the raw engine stream as well, so the engine's own handling of the field is seen, not only our cut."""
    from oprag_server.models.generator import HFGenerator
    from oprag_server.models.openai_engine import OpenAIGenerator
    from oprag_server.models.protocols import EngineUsage
    from oprag_server.operators.context import SYSTEM_PROMPT

    q = "When was the lighthouse completed?"
    full = client.query(q, top_k=1, max_new_tokens=12).answer
    assert len(full) >= 12, full
    stop = full[5:8]
    want = full[:full.find(stop)]
    r = client.query(q, top_k=1, max_new_tokens=12, stop=[stop])
    assert (r.answer, r.finish_reason) == (want, "stop"), (full, stop)
    port, _ = engine_proc(server)
    builtin = HFGenerator("smollm2", device="cpu")
    engine = OpenAIGenerator(f"http://127.0.0.1:{port}/v1", str(builtin.cached_model_dir()),
                             tokenizer_dir=builtin.cached_model_dir())
    user = f"Sources:\n\n[1] {DOCS[0].title}\n{DOCS[0].text}\n\nQuestion: {q}"

    async def raw(stops):
        usage = EngineUsage()
        text = "".join([d async for d in engine.stream(engine.chat_messages(SYSTEM_PROMPT, user), 12, usage, stop=stops)])
        return text, usage.finish_reason

    async def both():
        out = await raw(()), await raw((stop,))
        await engine.aclose()
        return out

    (plain, why_plain), (cut, why_cut) = asyncio.run(both())
    assert why_plain == "length" and why_cut == "stop" and len(cut) < len(plain), (plain, cut)  # the engine stopped


def test_cancelled_stream_frees_its_engine_slot(client, server):
    before = metric(server, "oprag_engine_cancel_release_seconds_count")
    call = client.query_stream("What do honey bee dances tell?", top_k=2, max_new_tokens=64)
    for e in call:
        if e.WhichOneof("event") == "text":
            call.cancel()
            break
    assert wait_until(lambda: metric(server, "oprag_engine_cancel_release_seconds_count") > before, 30)
    n = metric(server, "oprag_engine_cancel_release_seconds_count") - before
    s = metric(server, "oprag_engine_cancel_release_seconds_sum")
    assert n == 1 and s < 0.1, f"slot released after {s:.3f} s"
    assert wait_until(lambda: metric(server, "oprag_engine_inflight") == 0, 30)


def test_engine_killed_mid_stream_gives_unavailable_and_recovers(client, server):
    _, pid = engine_proc(server)
    errors: list[grpc.RpcError] = []
    call = client.query_stream("Who designed the lantern?", top_k=2, max_new_tokens=64)
    killed = threading.Event()
    try:
        for e in call:
            if e.WhichOneof("event") == "text" and not killed.is_set():
                os.kill(pid, signal.SIGKILL)
                killed.set()
    except grpc.RpcError as exc:
        errors.append(exc)
    assert killed.is_set() and errors, "the stream should fail once the engine is gone"
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert wait_until(lambda: metric(server, "oprag_engine_inflight") == 0, 10)  # no stuck request
    # Query path NOT_SERVING while the engine is down; Retrieve keeps working meanwhile
    assert wait_until(lambda: query_health(server) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
    assert client.retrieve("lighthouse lantern", top_k=1).hits[0].doc_id == "lighthouse"
    # the supervisor restarts the engine; the query path comes back
    assert wait_until(lambda: query_health(server) == health_pb2.HealthCheckResponse.SERVING, 900, 1.0)
    # the restart's log line reaches server.lines through the log pipe, not with the health answer
    assert wait_until(lambda: engine_proc(server)[1] != pid, 30, 0.2)
    r = client.query("When was the lighthouse completed?", top_k=1, max_new_tokens=4)
    assert r.completion_tokens > 0
