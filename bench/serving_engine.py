"""``python -m bench.serving --engine-url URL --engine-model NAME [--standin]``: serving with
generation on an inference engine (issue 12): where the prep/generation overlap exists.

OpRAG runs with ``--generator openai --generator-url URL --generator-model NAME`` in front of
any OpenAI-compatible engine; with ``--standin`` the bench starts the GPU-timed stand-in
(:mod:`bench.standin_engine`, SIMULATED timing) at URL itself.

1. Corpus: ``--chunks N`` synthetic chunks (deterministic Zipf-distributed words from this
   repository's docs, ~180 words each, 10 per document) with random unit vectors of width
   ``--dim`` supplied by the bench (bring-your-own vectors), so nothing is embedded; reused
   from ``bench/out/serving-engine-data-<N>``. Questions: 12 words from the same distribution;
   each brings its query vector (a chunk's vector plus noise), so queries are not embedded
   either. Prep = memory-less retrieve (hybrid, top 5) + context.
2. Systems, each closed-loop at every ``--concurrency`` level (window ``--duration`` s after
   ``--warmup`` s); two servers run at once (``no_overlap`` on a copy of the corpus) and at each
   level the three systems are measured back to back, so S and the ratio to the sequential
   client divide figures from adjacent windows (:func:`run_systems`):
   * ``overlap`` (the server's defaults, ``--max-batch 64``): a prep batch closes at once with
     the requests waiting (up to 64); each request goes to the engine as soon as its prompt
     exists while the prep loop goes on with newer arrivals, so under load prep batches grow
     with what arrived during the previous prep;
   * ``no_overlap`` (the same plus ``--no-overlap``): the best serial schedule. The requests
     waiting (up to 64, the batch closed after ``--max-wait-ms``) are prepared as one batch,
     then all of them generate on the engine at once (one engine batch), and the next prep
     starts only when the engine stage is empty. Prep and generation never overlap; the engine
     still sees the whole cohort, so the comparison isolates the overlap from continuous
     batching's batch-size gain;
   * ``sequential_client``: the bench itself does ``Retrieve`` over gRPC, builds the same prompt
     with the server's prompt builder, then streams it from the engine directly (one after the
     other per client).
3. Figures at the headline level (32, else the highest): per-request prep (the reply's
   ``timings_ms``: memory+embed+retrieve+context) and gen (``generate``: time in the engine),
   measured in the ``no_overlap`` run (stages in series, nothing hidden):
   ``prep_to_gen_ratio`` = prep / gen; ``S`` = overlap throughput / no_overlap throughput;
   ``S_ideal`` = (prep + gen) / max(prep, gen) (two stages); ``overlap_fraction_of_ideal`` =
   (S - 1) / (S_ideal - 1) (issue 12). Setting ``A``: ``--max-new-tokens``, chosen so prep / gen
   is in [0.5, 2]; setting ``B``: ``--max-new-tokens-b`` (generation-dominated), same figures.
4. ``engine_idle_fraction`` (overlap run, headline level): of the time at least one request was
   waiting in OpRAG (from its client send to the end of its prep: ``send + queue + prep``), the
   fraction during which the engine had no running request (the stand-in's ``/stats`` idle
   intervals; both clocks CLOCK_MONOTONIC). Per level also ``engine_idle_fraction`` of the whole
   window (idle seconds / window). Not measurable for an engine without ``/stats``.
5. Overload: a fresh server with ``--generator-max-inflight M`` (``--overload-inflight``, the
   engine batch at which latency stays near the unloaded one), ``--max-queue-delay-ms`` (the
   latency admission) and capacity = overlap throughput at concurrency M (measured first);
   open loop at 2 x capacity for ``--overload-duration`` s with a deadline. Reports admitted
   p95 / unloaded p95 (overlap at concurrency 1), RESOURCE_EXHAUSTED refusals and their p95
   latency, RSS (``/proc``) before/after.
6. Cancel: ``--cancels`` sequential QueryStreams cancelled after their first text event;
   ``cancel_release_ms_p95`` = client cancel -> the stand-in removed the request from its
   running batch (``/stats`` ``released_at``, both CLOCK_MONOTONIC); without ``/stats`` the
   server's ``oprag_engine_cancel_release_seconds`` (server cancel -> HTTP stream closed),
   p95 as the upper bound of its histogram bucket.

``--json`` prints one JSON object as the last stdout line (also written to
``bench/out/serving-engine[-quick].json``).
"""

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse


from . import _internals
from ._common import OUT, REPO, emit_json, log, machine_info, mval, percentile, scrape, start_server

HEADLINE = 32


def r3(x):
    return None if x is None else round(float(x), 3)


# ------------------------------------------------------------------------------ args

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="serving bench, engine mode (see bench/serving_engine.py)")
    ap.add_argument("--engine-url", default="", help="OpenAI-compatible engine base URL with /v1")
    ap.add_argument("--engine-model", default="standin", help="the engine's model name (a local dir: exact token counts)")
    ap.add_argument("--standin", action="store_true", help="start bench.standin_engine at --engine-url (SIMULATED)")
    ap.add_argument("--decode-base-ms", type=float, default=None, help="stand-in a (default: its own)")
    ap.add_argument("--decode-per-seq-ms", type=float, default=None, help="stand-in b")
    ap.add_argument("--prefill-ms-per-token", type=float, default=None, help="stand-in c")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="stand-in running batch limit")
    ap.add_argument("--chunks", type=int, default=0, help="corpus chunks (default 20000; --quick 2000)")
    ap.add_argument("--dim", type=int, default=384, help="vector width (the server's embedder: MiniLM 384)")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--ingest-streams", type=int, default=2, help="concurrent Ingest calls while loading the corpus")
    ap.add_argument("--ingest-only", action="store_true",
                    help="load the corpus into --data-dir (a server with --generator none) and exit; the "
                         "device script runs this while the engine loads")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per level")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="setting A (prep/gen near 1 on the stand-in)")
    ap.add_argument("--max-new-tokens-b", type=int, default=128, help="setting B (generation-dominated); 0 = skip")
    ap.add_argument("--settings", default="",
                    help="instead of A/B: NAME=MAX_NEW_TOKENS,... (e.g. A=8,B=128,C=1); the headline is the "
                         "setting whose prep/gen at the headline concurrency is in [0.5, 2], nearest 1")
    ap.add_argument("--context-tokens", type=int, default=384,
                    help="the server's prompt budget (384: prep / gen in [0.5, 2] at c=32 on the stand-in on 2 cores)")
    ap.add_argument("--max-batch", type=int, default=64, help="server --max-batch (prep batches), both systems")
    ap.add_argument("--max-wait-ms", type=float, default=25.0, help="server --max-wait-ms (no_overlap cohorts)")
    ap.add_argument("--max-inflight", type=int, default=128, help="server --generator-max-inflight")
    ap.add_argument("--overload-inflight", type=int, default=2,
                    help="engine slots of the overload server: an engine's latency grows with its batch, so "
                         "admitted p95 within 2x of the unloaded one needs a small batch")
    ap.add_argument("--overload-factor", type=float, default=2.0)
    ap.add_argument("--overload-duration", type=float, default=15.0)
    ap.add_argument("--overload-deadline", type=float, default=10.0)
    ap.add_argument("--overload-delay-fraction", type=float, default=0.5,
                    help="--max-queue-delay-ms = this x the unloaded p95")
    ap.add_argument("--cancels", type=int, default=20)
    ap.add_argument("--no-overload", action="store_true")
    ap.add_argument("--server-arg", action="append", default=[], help="extra option for every server (repeatable)")
    ap.add_argument("--quick", action="store_true", help="2000 chunks, concurrency 1,8, 2 s windows")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="OUT",
                    help="print one JSON line last; with OUT also write the JSON there")
    a = ap.parse_args(argv)
    if not a.engine_url and not a.standin:
        ap.error("--engine-url is required (or --standin)")
    if a.quick:
        a.chunks = a.chunks or 2000
        a.concurrency = "1,8" if a.concurrency == "1,8,32,64" else a.concurrency
        a.duration, a.warmup = min(a.duration, 2.0), min(a.warmup, 1.0)
        a.overload_duration = min(a.overload_duration, 4.0)
        a.cancels = min(a.cancels, 5)
    a.chunks = a.chunks or 20000
    a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    a.data_dir = a.data_dir or OUT / f"serving-engine-data-{a.chunks}-{a.dim}"
    a.log_path = OUT / "serving-engine-server.log"
    return a


# ------------------------------------------------------------------------------ corpus

def _vocab() -> list[str]:
    import re

    words: dict[str, int] = {}
    for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for w in re.findall(r"[a-z]{3,}", p.read_text(encoding="utf-8", errors="ignore").lower()):
            words[w] = words.get(w, 0) + 1
    return sorted(words, key=lambda w: (-words[w], w))[:5000]


class Corpus:
    """Deterministic synthetic chunks, vectors and questions (seeded numpy)."""

    def __init__(self, chunks: int, dim: int, seed: int = 12) -> None:
        import numpy as np

        self.np, self.n, self.dim = np, chunks, dim
        self.vocab = _vocab()
        ranks = np.arange(1, len(self.vocab) + 1)
        self.p = (1.0 / ranks) / (1.0 / ranks).sum()  # Zipf, s = 1
        self.rng = np.random.default_rng(seed)

    def words(self, n: int) -> str:
        return " ".join(self.vocab[i] for i in self.rng.choice(len(self.vocab), n, p=self.p))

    def unit(self, rows: int):
        v = self.rng.standard_normal((rows, self.dim)).astype("float32")
        return v / self.np.linalg.norm(v, axis=1, keepdims=True)

    def documents(self, per_doc: int = 10):
        from oprag_client.client import Doc

        for d in range(math.ceil(self.n / per_doc)):
            k = min(per_doc, self.n - d * per_doc)
            vecs = self.unit(k)
            yield Doc(f"syn-{d:06d}", title=f"Synthetic {d}",
                      chunks=[(self.words(180), vecs[i].tolist()) for i in range(k)])

    def questions(self, n: int = 512) -> list[tuple[str, list[float]]]:
        qs = self.unit(n) * 0.3 + self.unit(n)  # unit noise around random directions
        qs /= self.np.linalg.norm(qs, axis=1, keepdims=True)
        return [(self.words(12) + "?", qs[i].tolist()) for i in range(n)]


def ensure_data(c, a) -> dict:
    """Ingest the corpus through client ``c`` when the server's data dir is empty (first server)."""
    t = time.perf_counter()
    s = c.stats(timeout=60)
    ingested = s.chunks == 0
    if ingested:
        log(f"ingesting {a.chunks} synthetic chunks (own vectors, width {a.dim}) into {a.data_dir}")
        from concurrent.futures import ThreadPoolExecutor

        docs = list(Corpus(a.chunks, a.dim).documents())
        batches = [docs[i:i + 200] for i in range(0, len(docs), 200)]
        # a few Ingest streams at once: the server's stages run concurrently across streams
        with ThreadPoolExecutor(max(1, a.ingest_streams)) as pool:
            n = sum(pool.map(lambda b: c.ingest(b, timeout=600).chunks_written, batches))
        log(f"ingested {n} chunks over {a.ingest_streams} streams in {time.perf_counter() - t:.0f} s")
        s = c.stats(timeout=60)
    if s.chunks != a.chunks:
        raise SystemExit(f"{a.data_dir} holds {s.chunks} chunks, not {a.chunks}: remove it to re-ingest")
    log(f"data: {s.documents} documents, {s.chunks} chunks ({'ingested' if ingested else 'reused'}) "
        f"in {time.perf_counter() - t:.0f} s")
    return {"data_dir": str(a.data_dir), "documents": s.documents, "chunks": s.chunks, "ingested": ingested,
            "ingest_s": round(time.perf_counter() - t, 1), "vectors": f"supplied by the bench, width {a.dim}"}


# ------------------------------------------------------------------------------ engine

def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as f:
        return json.loads(f.read())


class EngineSide:
    """The engine URL, the stand-in process when the bench started it, and ``/stats``."""

    def __init__(self, a) -> None:
        self.url, self.model, self.proc = a.engine_url.rstrip("/"), a.engine_model, None
        if a.standin:
            import subprocess

            from oprag_client.testing import free_port

            if not self.url:
                self.url = f"http://127.0.0.1:{free_port()}/v1"
            port = urlparse(self.url).port
            cmd = [sys.executable, "-m", "bench.standin_engine", "--port", str(port), "--model-name", self.model]
            for flag in ("decode_base_ms", "decode_per_seq_ms", "prefill_ms_per_token", "max_num_seqs"):
                if getattr(a, flag) is not None:
                    cmd += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(OUT / "standin-engine.log", "w"),
                                         stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            self.wait_health()
        self.root = self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url
        self.has_stats = self.stats() is not None
        self.params = (self.stats() or {}).get("params")

    def wait_health(self, timeout: float = 60.0) -> None:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"the stand-in engine exited ({self.proc.returncode}); see bench/out/standin-engine.log")
            try:
                get_json(self.url.rsplit("/v1", 1)[0] + "/health", 2.0)
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit(f"engine at {self.url} did not answer /health within {timeout:.0f} s")

    def stats(self, since: float | None = None) -> dict | None:
        try:
            return get_json(self.root + "/stats" + (f"?since={since!r}" if since is not None else ""), 5.0)
        except (OSError, ValueError):
            return None

    def label(self) -> str:
        return (f"standin (SIMULATED GPU timing: {self.params})" if self.proc is not None or self.params
                else f"real engine at {self.url}, model {self.model}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# ------------------------------------------------------------------------------ closed loops

def closed_loop(make_call, questions, conc: int, duration: float, warmup: float, mark, prewarm: int = 2) -> dict:
    """``conc`` asyncio workers in one event loop (no client threads: on a loaded 2-core machine
    a thread per client added hundreds of ms of client-side delay) awaiting
    ``call((q, vec)) -> dict`` (``ok``, ``code``, ``prep_ms``, ``gen_ms``, ...) in a loop, where
    ``(call, aclose) = await make_call()``; ``prewarm`` calls one after another first (the
    server's first engine request opens its HTTP client). The window is ``duration`` s after
    ``warmup`` s; ``mark("start"|"end")`` runs at its edges."""

    async def main():
        call, aclose = await make_call()
        for qv in questions[:prewarm]:
            await call(qv)
        recs, stop, nxt = [], asyncio.Event(), [0]

        async def worker():
            while not stop.is_set():
                i = nxt[0]
                nxt[0] += 1
                t = time.perf_counter()
                try:
                    r = await call(questions[i % len(questions)])
                except Exception as exc:  # noqa: BLE001 - a failed request is a data point
                    r = {"ok": False, "code": f"EXC:{type(exc).__name__}:{str(exc)[:100]}"}
                recs.append((t, time.perf_counter(), r))

        tasks = [asyncio.create_task(worker()) for _ in range(conc)]
        await asyncio.sleep(warmup)
        t0 = time.perf_counter()
        await asyncio.to_thread(mark, "start")
        await asyncio.sleep(max(0.0, duration - (time.perf_counter() - t0)))
        t1 = time.perf_counter()
        await asyncio.to_thread(mark, "end")
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=120)
        for tk in pending:
            tk.cancel()
        await aclose()
        return recs, t0, t1, len(pending)

    recs, t0, t1, hung = asyncio.run(main())
    waiting = [(s, s + (r.get("queue_ms") or 0.0) / 1000 + (r.get("prep_ms") or 0.0) / 1000)
               for s, _, r in recs if r.get("ok") and r.get("queue_ms") is not None]
    win = [(s, e, r) for s, e, r in recs if t0 < e <= t1]
    ok = [(s, e, r) for s, e, r in win if r.get("ok")]
    lat = [(e - s) * 1000 for s, e, _ in ok]
    errors: dict[str, int] = {}
    for _, _, r in recs:
        if not r.get("ok"):
            errors[r["code"]] = errors.get(r["code"], 0) + 1

    def mean(key):
        xs = [r[key] for _, _, r in ok if r.get(key) is not None]
        return r3(sum(xs) / len(xs)) if xs else None

    return {"concurrency": conc, "window_s": r3(t1 - t0), "completed": len(ok),
            "throughput_rps": r3(len(ok) / (t1 - t0)), "p50_ms": r3(percentile(lat, 50)) if lat else None,
            "p95_ms": r3(percentile(lat, 95)) if lat else None, "prep_ms": mean("prep_ms"), "gen_ms": mean("gen_ms"),
            "queue_ms": mean("queue_ms"), "server_total_ms": mean("server_total_ms"),
            "completion_tokens": mean("tokens"), "errors": errors,
            "hung_workers": hung, "_waiting": waiting, "_t0": t0, "_t1": t1}


def _union(ivs: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in ivs):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def idle_while_waiting(waiting, idle, lo: float, hi: float) -> float | None:
    """Fraction of the time in [lo, hi] with at least one request waiting in OpRAG (sent by the
    client, not yet prepared: ``[send, send + queue + prep]``) during which the engine had no
    running request (the stand-in's idle intervals). Both on CLOCK_MONOTONIC
    (``time.perf_counter`` and ``time.monotonic`` on Linux)."""
    w, i = _union(waiting, lo, hi), _union(idle, lo, hi)
    total = sum(b - a for a, b in w)
    if total <= 0:
        return None
    both = 0.0
    for a, b in w:
        for c, d in i:
            both += max(0.0, min(b, d) - max(a, c))
    return both / total


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``), 0.0 without one."""
    if not pid:
        return 0.0
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


LAG = "oprag_event_loop_lag_seconds"


def run_level(call, questions, conc: int, a, engine: EngineSide, server_pid: int | None = None,
              metrics_port: int | None = None) -> dict:
    """One closed-loop level, with the engine's ``/stats``, the server's main-process CPU
    (``server_cpu_fraction``: CPU seconds / window; 1.0 = one core busy) and, with
    ``metrics_port``, its event loops' lag (``oprag_event_loop_lag_seconds``: mean and p95 as the
    bucket bound, per loop: ``frontend`` and ``engine``) over the window."""
    snaps: dict = {}

    def mark(edge):
        snaps[edge] = (time.perf_counter(), engine.stats(), cpu_s(server_pid),
                       scrape(metrics_port) if metrics_port else {})

    res = closed_loop(call, questions, conc, a.duration, a.warmup, mark)
    (t0, s0, c0, m0), (t1, s1, c1, m1) = snaps["start"], snaps["end"]
    res["server_cpu_fraction"] = r3((c1 - c0) / (t1 - t0)) if server_pid else None
    for loop in ("frontend", "engine"):
        n = mval(m1, LAG + "_count", loop=loop) - mval(m0, LAG + "_count", loop=loop)
        if n > 0:
            res[f"{loop}_loop_lag_ms_mean"] = r3((mval(m1, LAG + "_sum", loop=loop) - mval(m0, LAG + "_sum", loop=loop)) / n * 1000)
            res[f"{loop}_loop_lag_ms_p95"] = r3(hist_p95_ms({k: v for k, v in m0.items() if ("loop", loop) in k[1]},
                                                            {k: v for k, v in m1.items() if ("loop", loop) in k[1]}, LAG))
    waiting, w0, w1 = res.pop("_waiting"), res.pop("_t0"), res.pop("_t1")
    if s1 and waiting:
        st = engine.stats(since=w0)
        res["engine_idle_while_waiting"] = r3(idle_while_waiting(waiting, st.get("idle_intervals", []), w0, w1))
    if s0 and s1:
        steps = s1["steps"] - s0["steps"]
        res["engine_idle_fraction"] = r3((s1["idle_s"] - s0["idle_s"]) / (t1 - t0))
        res["engine_busy_fraction"] = r3((s1["busy_s"] - s0["busy_s"]) / (t1 - t0))
        res["engine_mean_running"] = r3((s1["seq_steps"] - s0["seq_steps"]) / steps) if steps else None
    return res


def oprag_call(target: str, max_new: int, timeout: float = 120.0):
    """``make_call`` for :func:`closed_loop`: ``Query`` over gRPC (async client) with the
    question's own vector; prep/gen/queue/total from the reply's ``timings_ms``."""
    prep_keys = ("memory", "embed", "retrieve", "context")

    async def make():
        import grpc
        from oprag_client.client import AsyncOpRAGClient

        c = AsyncOpRAGClient(target)

        async def call(qv):
            q, v = qv
            try:
                r = await c.query(q, query_vector=v, max_new_tokens=max_new, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                return {"ok": False, "code": e.code().name}
            tm = r.timings_ms
            return {"ok": True, "code": "OK", "prep_ms": sum(tm.get(k, 0.0) for k in prep_keys),
                    "gen_ms": tm.get("generate"), "queue_ms": tm.get("queue"), "server_total_ms": tm.get("total"),
                    "tokens": r.completion_tokens}

        return call, c.close

    return make


def sequential_call(target: str, engine: EngineSide, a, max_new: int):
    """``make_call``: ``Retrieve`` over gRPC, the server's prompt builder, then the engine
    directly (streamed, the official ``openai`` async client), one after the other."""
    model = _internals.openai_generator(engine.url, engine.model,
                                        tokenizer_dir=Path(engine.model) if Path(engine.model).is_dir() else None)

    async def make():
        import openai
        from oprag_client.client import AsyncOpRAGClient

        c = AsyncOpRAGClient(target)
        oai = openai.AsyncOpenAI(base_url=engine.url, api_key="none", max_retries=0, timeout=120.0)

        async def call(qv):
            q, v = qv
            t = time.perf_counter()
            rr = await c.retrieve(q, query_vector=v, timeout=120)
            hits = [_internals.hit(chunk_id=h.chunk_id, doc_id=h.doc_id, title=h.title, text=h.text, score=h.score,
                                   dense_score=h.dense_score, lexical_score=h.lexical_score, shard=h.shard)
                    for h in rr.hits]
            payload = _internals.build_context(q, hits, model, budget_tokens=a.context_tokens, max_new_tokens=max_new)
            t_gen = time.perf_counter()
            n = 0
            stream = await oai.chat.completions.create(model=engine.model, messages=payload.messages,
                                                       max_tokens=max_new, temperature=0.0, stream=True,
                                                       stream_options={"include_usage": True})
            async for ch in stream:
                if ch.usage is not None:
                    n = ch.usage.completion_tokens
            e = time.perf_counter()
            return {"ok": True, "code": "OK", "prep_ms": (t_gen - t) * 1000, "gen_ms": (e - t_gen) * 1000, "tokens": n}

        async def aclose():
            await oai.close()
            await c.close()

        return call, aclose

    return make


# ------------------------------------------------------------------------------ servers

def engine_server_args(a, engine: EngineSide, *extra: str) -> list[str]:
    return ["--shards", str(a.shards), "--generator", "openai", "--generator-url", engine.url,
            "--generator-model", engine.model, "--generator-max-inflight", str(a.max_inflight),
            "--context-tokens", str(a.context_tokens), "--max-wait-ms", str(a.max_wait_ms),
            "--max-new-tokens", str(a.max_new_tokens), "--max-batch", str(a.max_batch), *extra, *a.server_arg]


SYSTEMS = {"overlap": [], "no_overlap": ["--no-overlap"]}  # + --max-batch: see engine_server_args


def copy_data(a) -> Path:
    """A copy of the loaded corpus for the second server (``<data dir>-copy``; two servers may
    not share a data directory); made once, refreshed when the original changed."""
    import shutil

    src, dst = Path(a.data_dir), Path(f"{a.data_dir}-copy")
    stamp = max(p.stat().st_mtime for p in src.rglob("*"))
    if dst.exists() and (dst / ".copied").exists() and float((dst / ".copied").read_text()) >= stamp:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    (dst / ".copied").write_text(repr(stamp))
    return dst


def log_level(name: str, sname: str, conc: int, L: dict) -> None:
    log(f"  {name:17s} {sname} c={conc:<3d} {L['throughput_rps']:8.2f} req/s  p50 {L['p50_ms']} "
        f"p95 {L['p95_ms']} ms  prep {L['prep_ms']} gen {L['gen_ms']} queue {L['queue_ms']} ms  "
        f"total {L['server_total_ms']} ms  idle {L.get('engine_idle_fraction')}/{L.get('engine_idle_while_waiting')}  "
        f"running {L.get('engine_mean_running')}  server cpu {L['server_cpu_fraction']}  loop lag ms (mean/p95) "
        f"frontend {L.get('frontend_loop_lag_ms_mean')}/{L.get('frontend_loop_lag_ms_p95')} engine "
        f"{L.get('engine_loop_lag_ms_mean')}/{L.get('engine_loop_lag_ms_p95')}  errors {L['errors'] or '-'}")


def run_systems(a, engine: EngineSide, questions, settings: dict[str, int],
                cancel: bool = False) -> tuple[dict, dict | None]:
    """Two servers at once, ``overlap`` (on the corpus) and ``no_overlap`` (on a copy of it);
    for every level of the first setting and the headline level of the others, the three
    systems back to back (``overlap``, ``no_overlap``, ``sequential_client``: the overlap
    server's Retrieve only), so the figures that are divided by each other (S, the ratio to the
    sequential client) come from adjacent windows and a load change on a shared machine between
    them is as short as it can be (before: all levels of one server, then all of the other,
    minutes apart). The idle server costs nothing measurable (no requests; a 20 ms lag-probe
    timer). Then, with ``cancel``, the cancel run on the overlap server.
    :returns: ``({system: result}, cancel result or None)``."""
    from oprag_client.client import OpRAGClient

    args = {n: engine_server_args(a, engine, *SYSTEMS[n]) for n in ("overlap", "no_overlap")}
    srv = {"overlap": start_server(a.data_dir, *args["overlap"], log_path=a.log_path)}
    out: dict = {n: {"server_args": args[n if n != "sequential_client" else "overlap"], "settings": {}}
                 for n in ("overlap", "no_overlap", "sequential_client")}
    cancelled, alive, rc = None, {}, {}
    try:
        with OpRAGClient(srv["overlap"].target) as c:
            if a.data is None:
                a.data = ensure_data(c, a)
        srv["no_overlap"] = start_server(copy_data(a), *args["no_overlap"], log_path=a.log_path)
        for sname, max_new in settings.items():
            res: dict = {n: {} for n in out}
            for conc in (a.levels if sname == next(iter(settings)) else [headline(a)]):
                for name in ("overlap", "no_overlap", "sequential_client"):
                    s = srv["overlap" if name == "sequential_client" else name]
                    call = (sequential_call(s.target, engine, a, max_new) if name == "sequential_client"
                            else oprag_call(s.target, max_new))
                    L = res[name][str(conc)] = run_level(call, questions, conc, a, engine, s.proc.pid, s.metrics_port)
                    log_level(name, sname, conc, L)
            for n in out:
                out[n]["settings"][sname] = {"max_new_tokens": max_new, "levels": res[n]}
        with OpRAGClient(srv["overlap"].target) as c:
            if cancel:
                cancelled = run_cancel(a, engine, questions, c, srv["overlap"].metrics_port)
        for n, s in srv.items():
            with OpRAGClient(s.target) as c:
                alive[n] = s.alive() and c.health(timeout=10) == "SERVING"
    finally:
        for n, s in srv.items():
            rc[n] = s.stop()
    for n, v in out.items():
        k = "overlap" if n == "sequential_client" else n
        v.update(alive_at_end=alive.get(k, False), stop_rc=rc.get(k))
    return out, cancelled


def headline(a) -> int:
    return HEADLINE if HEADLINE in a.levels else max(a.levels)


# ------------------------------------------------------------------------------ overload, cancel

def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` (``/proc/PID/status`` VmRSS) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def _open_loop(target: str, questions, rate: float, duration: float, deadline: float, max_new: int) -> list:
    import grpc
    from oprag_client.client import AsyncOpRAGClient

    recs: list[tuple[str, float]] = []
    async with AsyncOpRAGClient(target) as c:
        async def one(qv):
            t = time.perf_counter()
            try:
                await c.query(qv[0], query_vector=qv[1], max_new_tokens=max_new, timeout=deadline)
                recs.append(("OK", time.perf_counter() - t))
            except grpc.aio.AioRpcError as e:
                recs.append((e.code().name, time.perf_counter() - t))

        tasks, t0 = [], time.perf_counter()
        for i in range(max(1, int(rate * duration))):
            d = t0 + i / rate - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.create_task(one(questions[i % len(questions)])))
        await asyncio.gather(*tasks)
    return recs


def run_overload(a, engine: EngineSide, questions, unloaded_p95: float) -> dict:
    """Capacity at ``--overload-inflight`` engine slots, then 2x that offered, open loop."""
    from oprag_client.client import OpRAGClient

    m = a.overload_inflight
    delay_ms = max(20.0, a.overload_delay_fraction * unloaded_p95)
    extra = engine_server_args(a, engine, *SYSTEMS["overlap"], "--max-queue-delay-ms", f"{delay_ms:.0f}")
    extra[extra.index("--generator-max-inflight") + 1] = str(m)
    srv = start_server(a.data_dir, *extra, log_path=a.log_path)
    try:
        cap = run_level(oprag_call(srv.target, a.max_new_tokens), questions, m, a, engine, srv.proc.pid)
        rate = a.overload_factor * cap["throughput_rps"]
        log(f"overload: capacity {cap['throughput_rps']} req/s at {m} engine slots; offering {rate:.1f} req/s for "
            f"{a.overload_duration:g} s, deadline {a.overload_deadline:g} s, --max-queue-delay-ms {delay_ms:.0f}")
        rss0 = rss_mb(srv.proc.pid)
        recs = asyncio.run(_open_loop(srv.target, questions, rate, a.overload_duration, a.overload_deadline,
                                      a.max_new_tokens))
        time.sleep(1.0)
        rss1 = rss_mb(srv.proc.pid)
        with OpRAGClient(srv.target) as c:
            alive = c.health(timeout=10) == "SERVING"
    finally:
        rc = srv.stop()
    refused = [t * 1000 for code, t in recs if code == "RESOURCE_EXHAUSTED"]
    admitted = [t * 1000 for code, t in recs if code != "RESOURCE_EXHAUSTED"]
    codes: dict[str, int] = {}
    for code, _ in recs:
        codes[code] = codes.get(code, 0) + 1
    adm95 = percentile(admitted, 95) if admitted else None
    res = {"server_args": extra, "capacity": cap, "offered_rps": r3(rate), "sent": len(recs), "codes": codes,
           "admitted_p95_ms": r3(adm95), "unloaded_p95_ms": r3(unloaded_p95),
           "admitted_p95_ratio_overload": r3(adm95 / unloaded_p95) if adm95 and unloaded_p95 else None,
           "refused": len(refused), "refusal_p95_ms": r3(percentile(refused, 95)) if refused else None,
           "rss_mb_before": rss0, "rss_mb_after": rss1, "alive_after": alive, "stop_rc": rc}
    log(f"overload: {codes}, admitted p95 {res['admitted_p95_ms']} ms (ratio {res['admitted_p95_ratio_overload']}), "
        f"refusal p95 {res['refusal_p95_ms']} ms, RSS {rss0} -> {rss1} MiB")
    return res


def hist_p95_ms(before: dict, after: dict, name: str) -> float | None:
    """p95 of a Prometheus histogram's growth between two scrapes: the upper bound of the bucket
    holding the 95th percent (ms)."""
    rows = sorted((float(dict(lab)["le"]), v - before.get((n, lab), 0.0)) for (n, lab), v in after.items()
                  if n == name + "_bucket")
    if not rows or rows[-1][1] <= 0:
        return None
    total = rows[-1][1]
    return next(le * 1000 for le, cnt in rows if cnt >= 0.95 * total)


def run_cancel(a, engine: EngineSide, questions, c, metrics_port: int) -> dict:
    """``--cancels`` QueryStreams on client ``c``, one at a time, each cancelled after its first
    text event."""
    client_ms: list[float] = []
    m0 = scrape(metrics_port)
    for i in range(a.cancels):
        q, v = questions[i % len(questions)]
        # a long answer (still streaming at the cancel) that leaves the prompt half the server's budget
        call = c.query_stream(q, query_vector=v, max_new_tokens=max(16, a.context_tokens // 2), timeout=120)
        for ev in call:
            if ev.WhichOneof("event") == "text":
                break
        t_cancel = time.monotonic()
        call.cancel()
        if engine.has_stats:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                st = engine.stats()
                after = [at for _, at in st["released_at"] if at >= t_cancel]
                if after:
                    client_ms.append((min(after) - t_cancel) * 1000)
                    break
                time.sleep(0.01)
        time.sleep(0.2)
    m1 = scrape(metrics_port)
    name = "oprag_engine_cancel_release_seconds"
    n = mval(m1, name + "_count") - mval(m0, name + "_count")
    res = {"cancels": a.cancels, "released_seen_by_engine": len(client_ms),
           "client_cancel_to_engine_release_ms_p95": r3(percentile(client_ms, 95)) if client_ms else None,
           "client_cancel_to_engine_release_ms_max": r3(max(client_ms)) if client_ms else None,
           "server_cancel_release_count": int(n),
           "server_cancel_release_ms_mean": r3((mval(m1, name + "_sum") - mval(m0, name + "_sum")) / n * 1000) if n else None,
           "server_cancel_release_ms_p95_bucket": r3(hist_p95_ms(m0, m1, name))}
    log(f"cancel: {res}")
    return res


# ------------------------------------------------------------------------------ report

def overlap_figures(on: dict | None, off: dict | None, seq: dict | None) -> dict:
    """The issue's overlap figures from one level of each system (see the module docstring)."""
    if not on or not off or not off.get("prep_ms") or not off.get("gen_ms") or not off["throughput_rps"]:
        return {}
    prep, gen = off["prep_ms"], off["gen_ms"]
    s = on["throughput_rps"] / off["throughput_rps"]
    s_ideal = (prep + gen) / max(prep, gen)
    return {"prep_ms": prep, "gen_ms": gen, "prep_to_gen_ratio": r3(prep / gen), "S": r3(s), "S_ideal": r3(s_ideal),
            "overlap_fraction_of_ideal": r3((s - 1) / (s_ideal - 1)) if s_ideal > 1.0001 else None,
            "prep_to_gen_ratio_overlap_run": r3(on["prep_ms"] / on["gen_ms"]) if on.get("prep_ms") and on.get("gen_ms") else None,
            "throughput_ratio_vs_sequential_client": r3(on["throughput_rps"] / seq["throughput_rps"])
            if seq and seq["throughput_rps"] else None}


def headline_setting(settings: dict) -> str:
    """The setting the headline figures come from: among those whose prep/gen at the headline
    concurrency lies in [0.5, 2] (the issue's range, the seed's 114 ms vs 103 ms), the one nearest
    1 on a log scale; when none does, the first setting (all settings are reported either way)."""
    import math

    def dist(name):
        r = settings[name].get("headline", {}).get("prep_to_gen_ratio")
        return abs(math.log(r)) if r and 0.5 <= r <= 2 else None

    ok = [n for n in settings if dist(n) is not None]
    return min(ok, key=dist) if ok else next(iter(settings), "A")


def report(a, engine: EngineSide, systems: dict, overload: dict | None, cancel: dict | None) -> dict:
    h = str(headline(a))

    def lvl(sys_name, setting, c=h):
        return systems.get(sys_name, {}).get("settings", {}).get(setting, {}).get("levels", {}).get(c)

    settings = {}
    for sname in systems.get("overlap", {}).get("settings", {}):
        per_c = {c: overlap_figures(lvl("overlap", sname, c), lvl("no_overlap", sname, c), lvl("sequential_client", sname, c))
                 for c in systems["overlap"]["settings"][sname]["levels"]}
        settings[sname] = {"max_new_tokens": systems["overlap"]["settings"][sname]["max_new_tokens"],
                           "headline": per_c.get(h, {}), "per_concurrency": per_c}
    hs = headline_setting(settings)
    A = settings.get(hs, {}).get("headline", {})
    head_on = lvl("overlap", hs) or {}
    src = engine.label()
    cancel_p95 = None
    if cancel:
        cancel_p95 = cancel["client_cancel_to_engine_release_ms_p95"]
        if cancel_p95 is None:
            cancel_p95 = cancel["server_cancel_release_ms_p95_bucket"]
    return {
        "benchmark": "serving-engine",
        "quick": a.quick,
        "headline_concurrency": int(h),
        "headline_setting": hs,
        "overlap_fraction_of_ideal": A.get("overlap_fraction_of_ideal"),
        "prep_to_gen_ratio": A.get("prep_to_gen_ratio"),
        "admitted_p95_ratio_overload": overload["admitted_p95_ratio_overload"] if overload else None,
        "engine_idle_fraction": head_on.get("engine_idle_while_waiting") if engine.has_stats else "not measurable (no /stats)",
        "engine_idle_fraction_of_window": head_on.get("engine_idle_fraction"),
        "cancel_release_ms_p95": cancel_p95,
        "throughput_ratio_vs_sequential_client": A.get("throughput_ratio_vs_sequential_client"),
        "engine": {
            "overlap_fraction_of_ideal": src, "prep_to_gen_ratio": src, "admitted_p95_ratio_overload": src,
            "engine_idle_fraction": (src + ", /stats idle seconds") if engine.has_stats else None,
            "cancel_release_ms_p95": src + (", client cancel -> engine released (/stats)" if cancel and
                                            cancel["client_cancel_to_engine_release_ms_p95"] is not None else
                                            ", server metric oprag_engine_cancel_release_seconds (bucket bound)"),
            "throughput_ratio_vs_sequential_client": src,
            "simulated": engine.params is not None, "url": engine.url, "model": engine.model, "params": engine.params,
        },
        "refusal_p95_ms": overload["refusal_p95_ms"] if overload else None,
        "overload_refused": overload["refused"] if overload else None,
        "settings": settings,
        "systems": systems,
        "overload": overload,
        "cancel": cancel,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "data"},
    }


def ingest_only(a) -> int:
    """``--ingest-only``: fill ``a.data_dir`` and exit (JSON line with the ingest figures)."""
    from oprag_client.client import OpRAGClient

    srv = start_server(a.data_dir, "--shards", str(a.shards), "--generator", "none", *a.server_arg,
                       log_path=a.log_path)
    try:
        with OpRAGClient(srv.target) as c:
            data = ensure_data(c, a)
    finally:
        srv.stop()
    data["chunks_per_s"] = round(a.chunks / data["ingest_s"], 1) if data["ingested"] and data["ingest_s"] else None
    print(json.dumps(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.ingest_only:
        return ingest_only(a)
    t_all = time.perf_counter()
    machine = machine_info()
    a.data = None
    questions = Corpus(a.chunks, a.dim, seed=99).questions()
    engine = EngineSide(a)
    log(f"engine: {engine.label()}")
    if a.settings:
        settings = {k.strip(): int(v) for k, v in (kv.split("=") for kv in a.settings.split(",") if kv.strip())}
    else:
        settings = {"A": a.max_new_tokens, **({"B": a.max_new_tokens_b} if a.max_new_tokens_b else {})}
    first = next(iter(settings))
    a.max_new_tokens = settings[first]  # the server default and the overload/cancel runs use the first setting
    systems, overload = {}, None
    try:
        systems, cancel = run_systems(a, engine, questions, settings, cancel=a.cancels > 0)
        lo = systems["overlap"]["settings"][first]["levels"].get(str(min(a.levels)))
        if not a.no_overload and lo and lo["p95_ms"]:
            overload = run_overload(a, engine, questions, lo["p95_ms"])
    finally:
        engine.stop()
    result = report(a, engine, systems, overload, cancel)
    try:
        load_end = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        load_end = None
    result.update({"data": a.data, "machine": {**machine, "loadavg_at_end": load_end},
                   "total_s": round(time.perf_counter() - t_all, 1)})
    out = a.out or (Path(a.json) if a.json else OUT / ("serving-engine-quick.json" if a.quick else "serving-engine.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    log(f"done in {result['total_s']:.0f} s; written {out}")
    for k in ("overlap_fraction_of_ideal", "prep_to_gen_ratio", "admitted_p95_ratio_overload", "engine_idle_fraction",
              "cancel_release_ms_p95", "throughput_ratio_vs_sequential_client"):
        log(f"  {k}: {result[k]}")
    if a.json is not None:
        emit_json(result)
    return 0
