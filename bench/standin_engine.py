"""A GPU-timed stand-in for an OpenAI-compatible inference engine -- a SIMULATED benchmark
instrument (issue 12), never a test double for correctness.

It speaks the part of the OpenAI HTTP API OpRAG uses: ``POST /v1/chat/completions`` (streaming
SSE ``data: {...}`` chunks, a final usage chunk when ``stream_options.include_usage``, then
``data: [DONE]``; or one JSON reply), ``GET /v1/models``, ``GET /health``; plus ``GET /stats``,
its own busy/idle accounting for the benchmark. Its *timing* follows a stated model of a
continuous-batching GPU engine; its *text* is deterministic filler (words picked from a hash of
the prompt), because only the timing is simulated.

Timing model (one engine loop, a running batch, vLLM-style continuous batching):

* a request waits in a FIFO until the next step; each step admits waiting requests into the
  running batch up to ``--max-num-seqs`` (vLLM ``max_num_seqs``);
* one step costs ``decode_ms(n) = a + b * n`` with ``n`` running requests (``a`` =
  ``--decode-base-ms``, ``b`` = ``--decode-per-seq-ms``), plus ``c * prompt_tokens`` for each
  request admitted in that step (its prefill, ``c`` = ``--prefill-ms-per-token``);
* every running request gets one token per step (the first one in its admission step, as
  vLLM's prefill step samples the first token); a request finishes after ``max_tokens`` tokens
  (no early end of sequence, like ``--ignore-eos``);
* steps follow the model's clock: while the engine stays busy, step k+1 starts when step k
  ends on the model's timeline (a late event loop delivers tokens late but does not stretch the
  simulated GPU time);
* closing the HTTP stream removes the request from the running batch at once (its slot is
  free for the next step); the time is logged in ``/stats`` (``released_at``);
* ``GET /stats[?since=T]``: busy/idle seconds, steps, tokens, and (with ``since``) the idle
  intervals (no running request), in ``time.monotonic()`` seconds.

Default parameters: Llama-3.1-8B-Instruct, bf16, vLLM 0.21, one H100-80GB-HBM3, measured
concurrency sweep (InferenceBench recipe "concurrency sweep", yobitelcomm.github.io/bench,
captured 2026-05-16): median TPOT 6.48 ms at concurrency 1, 6.59 ms at 4, 10.94 ms at 16.
A straight line through c=1 and c=16 gives ``a = 6.2 ms`` and ``b = 0.30 ms`` per running
sequence (c=64 there is past the knee, 46.9 ms, preemption and prefill interference: out of
this model's range). For comparison a single A100-40GB runs the same model at ~75 tokens/s at
concurrency 1 (13.3 ms/step; johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100").
Prefill: ``c = 0.03 ms`` per prompt token = 2 x 8.0e9 FLOP per token / (989 TFLOP/s bf16 dense
x 0.55 model FLOP utilisation), the compute roofline of an H100 SXM at a typical prefill
efficiency. Every parameter is a command-line flag so the GPU device run's measured figures
can be plugged in.

Prompt tokens are estimated from the text: ``ceil(utf8_bytes / 4)`` per message plus 4 per
message for the chat template's role markers (Llama-3's tokenizer averages about 4 bytes per
token on English prose). OpRAG's own estimate without a local tokenizer uses 3 bytes (a safety
margin); this one aims at the expected count.

Run it from the repository root::

    python -m bench.standin_engine --port 8000 [--decode-base-ms 6.2 --decode-per-seq-ms 0.3
        --prefill-ms-per-token 0.03 --max-num-seqs 256]

Needs fastapi and uvicorn (the server's dependencies).
"""


import argparse
import asyncio
import collections
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

#: Words the filler text is drawn from.
WORDS = ("the", "engine", "answers", "from", "sources", "retrieval", "context", "model", "token", "batch",
         "question", "evidence", "shows", "that", "and", "with", "result", "data", "study", "claim",
         "method", "cells", "protein", "effect", "increase", "level", "patients", "risk", "found", "not")
#: Bytes per token and tokens per message of the prompt estimate (module docstring).
BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Params:
    """The timing model's parameters (module docstring), in milliseconds."""

    decode_base_ms: float = 6.2
    decode_per_seq_ms: float = 0.30
    prefill_ms_per_token: float = 0.03
    max_num_seqs: int = 256

    def step_ms(self, running: int, admitted_prompt_tokens: int) -> float:
        """Duration of one engine step with ``running`` sequences (after admission), ``admitted_prompt_tokens``
        prompt tokens prefilled in it."""
        return self.decode_base_ms + self.decode_per_seq_ms * running + self.prefill_ms_per_token * admitted_prompt_tokens


def estimate_prompt_tokens(messages: list[dict]) -> int:
    """``sum(ceil(utf8_bytes(content) / 4) + 4)`` over the chat messages."""
    n = 0
    for m in messages:
        c = m.get("content") or ""
        if isinstance(c, list):  # content parts
            c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
        n += math.ceil(len(str(c).encode("utf-8")) / BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE
    return n


def filler_tokens(messages: list[dict], n: int) -> list[str]:
    """``n`` deterministic text pieces (``" word"``) derived from the prompt's SHA-256."""
    h = int.from_bytes(hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()[:8], "big")
    return [(" " if i else "") + WORDS[(h + i * 7919) % len(WORDS)] for i in range(n)]


@dataclass(eq=False)
class Request:
    rid: int
    prompt_tokens: int
    max_tokens: int
    pieces: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    emitted: int = 0
    arrived: float = field(default_factory=time.monotonic)


class Engine:
    """The engine loop and its accounting (``stats()``); times are ``time.monotonic()`` seconds
    (CLOCK_MONOTONIC, comparable across processes on one Linux machine)."""

    def __init__(self, params: Params) -> None:
        self.p = params
        self.pending: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.wake = asyncio.Event()
        self.next_free = 0.0
        self.ids = 0
        self.started = time.monotonic()
        self.acc = {"busy_s": 0.0, "idle_s": 0.0, "steps": 0, "seq_steps": 0, "tokens": 0, "prompt_tokens": 0,
                    "admitted": 0, "completed": 0, "released": 0, "max_running": 0}
        self.released: collections.deque[tuple[int, float]] = collections.deque(maxlen=10_000)
        self.idle_log: collections.deque[tuple[float, float]] = collections.deque(maxlen=100_000)  # (start, end)
        self._idle_since: float | None = time.monotonic()

    def submit(self, messages: list[dict], max_tokens: int) -> Request:
        self.ids += 1
        r = Request(self.ids, estimate_prompt_tokens(messages), max_tokens, filler_tokens(messages, max_tokens))
        self.pending.append(r)
        self.wake.set()
        return r

    def release(self, r: Request) -> None:
        """The client closed the stream: drop the request now (frees its slot for the next step)."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.pending:
            self.pending.remove(r)
        else:
            return
        self.acc["released"] += 1
        self.released.append((r.rid, time.monotonic()))
        self._mark_idle()

    def _mark_idle(self) -> None:
        if not self.running and self._idle_since is None:
            self._idle_since = time.monotonic()

    def stats(self, since: float | None = None) -> dict:
        """Counters; ``released_at`` = the last 200 ``(request id, time)`` releases; with
        ``since`` (a monotonic time) also ``idle_intervals``: ``[start, end]`` of every stretch
        with no running request that ended after ``since`` (the one in progress ends now)."""
        now = time.monotonic()
        out = dict(self.acc)
        if self._idle_since is not None:  # the idle stretch in progress
            out["idle_s"] += now - self._idle_since
        out.update(now=now, uptime_s=now - self.started, running=len(self.running), waiting=len(self.pending),
                   params=asdict(self.p), released_at=list(self.released)[-200:])
        if since is not None:
            out["idle_intervals"] = [iv for iv in self.idle_log if iv[1] > since] + (
                [(self._idle_since, now)] if self._idle_since is not None else [])
        return out

    async def loop(self) -> None:
        while True:
            if not self.running and not self.pending:
                self.wake.clear()
                await self.wake.wait()
            if self._idle_since is not None:
                now = time.monotonic()
                self.acc["idle_s"] += now - self._idle_since
                self.idle_log.append((self._idle_since, now))
                self._idle_since = None
            new = []
            while self.pending and len(self.running) + len(new) < self.p.max_num_seqs:
                new.append(self.pending.popleft())
            self.running.extend(new)
            ptok = sum(r.prompt_tokens for r in new)
            step_s = self.p.step_ms(len(self.running), ptok) / 1000.0
            now = time.monotonic()
            start = max(now, self.next_free)  # busy: the model's timeline; after idle: now
            self.next_free = start + step_s
            await asyncio.sleep(max(0.0, self.next_free - time.monotonic()))
            a = self.acc
            a["busy_s"] += step_s
            a["steps"] += 1
            a["admitted"] += len(new)
            a["prompt_tokens"] += ptok
            a["max_running"] = max(a["max_running"], len(self.running))
            a["seq_steps"] += len(self.running)
            done = []
            for r in self.running:  # requests released during the sleep are gone already
                r.queue.put_nowait(r.pieces[r.emitted])
                r.emitted += 1
                a["tokens"] += 1
                if r.emitted >= r.max_tokens:
                    r.queue.put_nowait(None)
                    done.append(r)
            for r in done:
                self.running.remove(r)
                a["completed"] += 1
            if not self.running and not self.pending:
                self.next_free = 0.0
                self._mark_idle()


def make_app(params: Params, model_name: str = "standin") -> Any:
    """The FastAPI application (one :class:`Engine`, started with the app)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    engine = Engine(params)

    @asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(engine.loop())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)
    app.state.engine = engine

    @app.get("/health")
    async def health():
        return {"status": "ok", "simulated": True}

    @app.get("/stats")
    async def stats(since: float | None = None):
        return engine.stats(since)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "standin"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: HTTPRequest):
        try:
            body = await req.json()
            messages = list(body["messages"])
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS)
            if max_tokens < 1 or not messages:
                raise ValueError("max_tokens must be >= 1 and messages non-empty")
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"message": f"bad request: {exc}", "type": "invalid_request_error"}}, 400)
        model = str(body.get("model") or model_name)
        r = engine.submit(messages, max_tokens)
        cid, created = f"chatcmpl-standin-{r.rid}", int(time.time())
        usage = lambda: {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.emitted,  # noqa: E731
                         "total_tokens": r.prompt_tokens + r.emitted}

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            return "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}) + "\n\n"

        if not body.get("stream"):
            parts = []
            try:
                while (piece := await r.queue.get()) is not None:
                    parts.append(piece)
            finally:
                engine.release(r)  # no-op when it finished
            return {"id": cid, "object": "chat.completion", "created": created, "model": model, "usage": usage(),
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "".join(parts)}}]}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            try:
                yield chunk({"role": "assistant", "content": ""})
                while (piece := await r.queue.get()) is not None:
                    yield chunk({"content": piece})
                yield chunk({}, "length")
                if include_usage:
                    yield "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                                 "model": model, "choices": [], "usage": usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:  # also when the client closed the stream (the generator is cancelled)
                engine.release(r)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", default="standin", help="the id GET /v1/models lists (any name is accepted)")
    d = Params()
    ap.add_argument("--decode-base-ms", type=float, default=d.decode_base_ms, help="a in a + b*n per step")
    ap.add_argument("--decode-per-seq-ms", type=float, default=d.decode_per_seq_ms, help="b in a + b*n per step")
    ap.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token, help="c: prefill ms per prompt token")
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running batch limit")
    return ap.parse_args(argv)


def params_of(a: argparse.Namespace) -> Params:
    return Params(a.decode_base_ms, a.decode_per_seq_ms, a.prefill_ms_per_token, a.max_num_seqs)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    a = parse_args(argv)
    p = params_of(a)
    print(f"standin engine (SIMULATED timing) on http://{a.host}:{a.port}/v1: {p}", flush=True)
    uvicorn.run(make_app(p, a.model_name), host=a.host, port=a.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
