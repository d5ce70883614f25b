"""The GPU-timed stand-in engine (bench/standin_engine.py, a benchmark instrument) speaks the
OpenAI protocol as the official ``openai`` client expects it, follows its timing model, and
drops a request from its running batch as soon as the client closes the stream; and
``python -m bench.serving --standin`` (engine mode) produces the issue's JSON keys.

The stand-in runs as a real process on a free loopback port (uvicorn)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.standin_engine import Params, estimate_prompt_tokens, filler_tokens
from oprag_client.testing import wait_until
from standin_process import standin_engine

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[2]
# a slow, flat decode step so timing is visible above event-loop noise on a loaded machine
A_MS, B_MS, C_MS = 20.0, 1.0, 0.1


def test_timing_model_and_prompt_estimate():
    p = Params(6.2, 0.3, 0.03, 256)
    assert p.step_ms(32, 0) == pytest.approx(6.2 + 9.6)
    assert p.step_ms(1, 1000) == pytest.approx(6.5 + 30.0)
    msgs = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "é" * 10}]  # 40 + 20 bytes
    assert estimate_prompt_tokens(msgs) == 10 + 4 + 5 + 4
    assert filler_tokens(msgs, 5) == filler_tokens(msgs, 5) and len(filler_tokens(msgs, 5)) == 5
    assert filler_tokens(msgs, 5) != filler_tokens([{"role": "user", "content": "other"}], 5)


@pytest.fixture(scope="module")
def standin():
    with standin_engine("--decode-base-ms", str(A_MS), "--decode-per-seq-ms", str(B_MS),
                        "--prefill-ms-per-token", str(C_MS)) as root:
        yield root


def stats(root: str) -> dict:
    with urllib.request.urlopen(root + "/stats", timeout=5) as f:
        return json.loads(f.read())


def test_streaming_usage_and_non_streaming(standin):
    async def go():
        c = openai.AsyncOpenAI(base_url=standin + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "w" * 400}]  # 100 + 4 prompt tokens
        t = time.perf_counter()
        s = await c.chat.completions.create(model="any", messages=msgs, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})
        parts, usage, finish = [], None, None
        async for ch in s:
            usage = ch.usage or usage
            for x in ch.choices:
                finish = x.finish_reason or finish
                if x.delta.content:
                    parts.append(x.delta.content)
        dt = time.perf_counter() - t
        r = await c.chat.completions.create(model="any", messages=msgs, max_tokens=6)
        models = await c.models.list()
        await c.close()
        return parts, usage, finish, dt, r, models

    parts, usage, finish, dt, r, models = asyncio.run(go())
    assert len(parts) == 6 and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (104, 6)
    assert r.choices[0].message.content == "".join(parts)  # deterministic text from the prompt
    assert r.usage.completion_tokens == 6
    assert [m.id for m in models.data] == ["standin"]
    # 6 steps of >= 21 ms plus 10.4 ms prefill: the model's time is a floor
    assert dt >= (6 * (A_MS + B_MS) + 104 * C_MS) / 1000 * 0.95


def test_closing_the_stream_releases_the_request_at_once(standin):
    before = stats(standin)

    async def go():
        c = openai.AsyncOpenAI(base_url=standin + "/v1", api_key="none", max_retries=0)
        s = await c.chat.completions.create(model="any", messages=[{"role": "user", "content": "long"}],
                                            max_tokens=10_000, stream=True)
        n = 0
        async for ch in s:
            n += sum(1 for x in ch.choices if x.delta.content)
            if n >= 2:
                break
        running = stats(standin)["running"]
        t = time.monotonic()
        await s.close()
        await c.close()
        return running, t

    running, t_close = asyncio.run(go())
    assert running == 1
    assert wait_until(lambda: stats(standin)["released"] == before["released"] + 1, 5)
    after = stats(standin)
    assert after["running"] == 0 and after["waiting"] == 0
    released_at = after["released_at"][-1][1]
    assert released_at - t_close < 0.1  # removed from the running batch within 100 ms


def test_bad_request_is_400(standin):
    req = urllib.request.Request(standin + "/v1/chat/completions", data=b'{"messages": []}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400


KEYS = ("overlap_fraction_of_ideal", "prep_to_gen_ratio", "admitted_p95_ratio_overload", "engine_idle_fraction",
        "cancel_release_ms_p95", "throughput_ratio_vs_sequential_client", "engine")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serving_bench_engine_mode_smoke(tmp_path):
    """The smallest engine-mode run: real OpRAG servers in front of the stand-in, every step."""
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "-m", "bench.serving", "--standin", "--quick", "--chunks", "300", "--concurrency", "2",
           "--duration", "1", "--warmup", "0.5", "--max-new-tokens-b", "0", "--cancels", "2",
           "--overload-duration", "2", "--overload-inflight", "2", "--data-dir", str(tmp_path / "data"),
           "--out", str(out), "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert all(k in res for k in KEYS), sorted(res)
    assert res["engine"]["simulated"] is True
    assert res["prep_to_gen_ratio"] is not None and res["cancel_release_ms_p95"] is not None
    assert json.loads(out.read_text())["headline_concurrency"] == 2
