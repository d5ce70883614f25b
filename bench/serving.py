"""Serving benchmark: closed-loop load over gRPC, with generation, against real servers, plus
an in-process LangChain chain on the same models, plus an open-loop overload run.

One run:

1. Corpus: SciFact corpus + WikiText-2 valid articles (client loaders; ``--docs N`` keeps the
   first N documents, for smoke runs). Data dir ``bench/out/serving-data`` (``--docs N``:
   ``bench/out/serving-data-<N>docs``), reused across runs: a ``--generator none`` server is
   started on it, ingest runs only when Stats shows it empty, then the server is stopped with
   SIGTERM (it snapshots ``shard-*/chunks.arrow``, read by the LangChain system).
2. Questions: SciFact ``queries.jsonl`` in file order (deterministic), cycled; every system and
   level starts at the first question. Every request asks for 32 new tokens (``--max-new-tokens``).
3. Systems, one after another, each a fresh server process on the same data dir:
   ``oprag`` (defaults), ``no_overlap`` (``--no-overlap``), ``no_batching`` (``--max-batch 1``),
   then ``langchain``: a LangChain LCEL chain in this process (FAISS vector store built from the
   snapshot vectors, queries embedded by the same MiniLM encoder, the server's own prompt
   builder, the same SmolLM2 ``HFGenerator`` wrapped in a ``RunnableLambda``), one request at a
   time per worker thread.
4. Per system and concurrency level (``--concurrency 1,8,32``): C closed-loop workers; after a
   warm-up (``--warmup`` seconds, or C completions with ``--requests``) a window of
   ``--duration`` seconds (or ``--requests`` completions). Throughput = OK completions in the
   window / window length; latency and TTFT percentiles over those completions. For the
   servers the Prometheus counters are read at both window edges: generator busy/idle
   seconds (idle fraction = idle / (idle + busy)), mean generation batch size, refusals.
5. Overload, against ``oprag`` restarted with ``--queue-capacity 2*max_batch``: open-loop
   arrivals at ``--overload-factor`` (4) x the sustainable rate (``oprag`` throughput at the
   highest concurrency) for ``--overload-duration`` seconds, async client, deadline
   ``--overload-deadline``. Reports the refused share (RESOURCE_EXHAUSTED), refusal latency,
   admitted latency vs the unloaded p95 (``oprag`` at concurrency 1), server RSS before/after,
   and whether the server still answers.

``--json`` prints one JSON object as the last stdout line (also written to
``bench/out/serving[-quick].json``); progress goes to stderr, server output to
``bench/out/serving-server.log``. Percentiles are nearest-rank (``_common.percentile``).
From the repository root; ``psutil`` and the LangChain system need ``pip install -e ".[bench]"``
(or leave ``langchain`` out of ``--systems``):

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.serving --json                 # full run
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.serving --quick --json         # smoke run

With ``--engine-url URL --engine-model NAME`` (and ``--standin`` to start the GPU-timed stand-in
engine there) generation runs on an OpenAI-compatible engine: :mod:`bench.serving_engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

from oprag_client.testing import ServerProcess

from . import _internals
from ._common import (
    DEFAULT_SHARED,
    OUT,
    emit_json,
    ingest,
    load_corpus,
    log,
    machine_info,
    msum,
    mval,
    percentile,
    read_snapshot,
    require,
    scrape,
    start_server,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIN_CHUNKS = 5_000
SERVER_SYSTEMS = {
    "oprag": [],
    "no_overlap": ["--no-overlap"],
    "no_batching": ["--max-batch", "1"],
}
ALL_SYSTEMS = ("oprag", "no_overlap", "no_batching", "langchain")
_ISSUE_RE = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b|exception|failed|INTERNAL", re.I)


# ------------------------------------------------------------------------------ helpers

def r3(x):
    return None if x is None else round(float(x), 3)


def metric_delta(before: dict, after: dict) -> dict:
    busy = mval(after, "oprag_generator_seconds_total", state="busy") - mval(before, "oprag_generator_seconds_total", state="busy")
    idle = mval(after, "oprag_generator_seconds_total", state="idle") - mval(before, "oprag_generator_seconds_total", state="idle")
    bs_sum = mval(after, "oprag_batch_size_sum", stage="generate") - mval(before, "oprag_batch_size_sum", stage="generate")
    bs_cnt = mval(after, "oprag_batch_size_count", stage="generate") - mval(before, "oprag_batch_size_count", stage="generate")
    gq_sum = (mval(after, "oprag_stage_seconds_sum", stage="generate_queue")
              - mval(before, "oprag_stage_seconds_sum", stage="generate_queue"))
    gq_cnt = (mval(after, "oprag_stage_seconds_count", stage="generate_queue")
              - mval(before, "oprag_stage_seconds_count", stage="generate_queue"))
    q_sum = mval(after, "oprag_stage_seconds_sum", stage="queue") - mval(before, "oprag_stage_seconds_sum", stage="queue")
    q_cnt = mval(after, "oprag_stage_seconds_count", stage="queue") - mval(before, "oprag_stage_seconds_count", stage="queue")
    rej = msum(after, "oprag_overload_rejections_total") - msum(before, "oprag_overload_rejections_total")
    codes = {}
    for (n, lab), v in after.items():
        if n == "oprag_requests_total":
            d = v - before.get((n, lab), 0.0)
            if d:
                ld = dict(lab)
                codes[f"{ld.get('method')}:{ld.get('code')}"] = int(d)
    return {
        "generator_busy_s": r3(busy),
        "generator_idle_s": r3(idle),
        "generator_idle_fraction": r3(idle / (idle + busy)) if idle + busy > 0 else None,
        "generate_batches": int(bs_cnt),
        "mean_generate_batch": r3(bs_sum / bs_cnt) if bs_cnt else None,
        "mean_admission_queue_ms": r3(q_sum / q_cnt * 1000) if q_cnt else None,
        "mean_generate_queue_ms": r3(gq_sum / gq_cnt * 1000) if gq_cnt else None,
        "overload_rejections": int(rej),
        "server_status_codes": codes,
    }


def rss_of(pid: int) -> dict:
    import psutil

    p = psutil.Process(pid)
    main = p.memory_info().rss
    kids = 0
    for c in p.children(recursive=True):
        try:
            kids += c.memory_info().rss
        except psutil.Error:
            pass
    return {"main_mb": round(main / 2**20, 1), "with_children_mb": round((main + kids) / 2**20, 1)}


def server_issues(srv: ServerProcess, name: str) -> list[str]:
    return [f"[{name}] {ln.rstrip()}" for ln in srv.lines if _ISSUE_RE.search(ln)][:40]


def load_questions(shared: Path) -> list[str]:
    out = []
    with open(Path(shared) / "data" / "scifact" / "queries.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                t = json.loads(line)["text"].strip()
                if t:
                    out.append(t)
    return out


# ------------------------------------------------------------------------------ closed loop

def closed_loop(call, questions: list[str], conc: int, *, duration: float, requests: int, warmup_s: float,
                mark=None, level_timeout: float = 1800.0) -> dict:
    """Run ``conc`` workers calling ``call(question) -> (ok, code, ttft_ms|None, tokens)`` in a
    closed loop. The measured window starts after the warm-up (``warmup_s`` seconds, or, with
    ``requests``, ``conc`` completions) and ends after ``duration`` s (or ``requests``
    completions). ``mark("start"|"end")`` is called at the window edges (metric scrapes)."""
    lock = threading.Lock()
    st = {"next": 0, "warm_done": 0, "win_done": 0, "t0": None, "t1": None}
    recs: list[tuple] = []
    stop = threading.Event()
    win_start = threading.Event()
    win_end = threading.Event()
    warm_n = max(1, conc)

    def worker():
        while not stop.is_set():
            with lock:
                i = st["next"]
                st["next"] += 1
            q = questions[i % len(questions)]
            t = time.perf_counter()
            try:
                ok, code, ttft, ntok, ptok, nhits = call(q)
            except Exception as exc:  # noqa: BLE001 - a failed request is a data point
                ok, code, ttft, ntok, ptok, nhits = False, f"EXC:{type(exc).__name__}:{str(exc)[:120]}", None, 0, 0, 0
            e = time.perf_counter()
            with lock:
                recs.append((t, e, ok, code, ttft, ntok, ptok, nhits))
                if requests:
                    if not win_start.is_set():
                        st["warm_done"] += 1
                        if st["warm_done"] >= warm_n:
                            st["t0"] = e
                            win_start.set()
                    elif not win_end.is_set() and e > st["t0"]:
                        st["win_done"] += 1
                        if st["win_done"] >= requests:
                            st["t1"] = e
                            win_end.set()
                            stop.set()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(conc)]
    t_begin = time.perf_counter()
    for th in threads:
        th.start()
    timed_out = False
    if requests:
        if not win_start.wait(level_timeout):
            timed_out = True
            with lock:
                st["t0"] = time.perf_counter()
                win_start.set()
        if mark:
            mark("start")
        if not win_end.wait(level_timeout):
            timed_out = True
            with lock:
                st["t1"] = time.perf_counter()
                win_end.set()
        stop.set()
        if mark:
            mark("end")
    else:
        time.sleep(warmup_s)
        with lock:
            st["t0"] = time.perf_counter()
            win_start.set()
        if mark:
            mark("start")
        time.sleep(duration)
        with lock:
            st["t1"] = time.perf_counter()
            win_end.set()
        stop.set()
        if mark:
            mark("end")
    t_drain = time.perf_counter()
    for th in threads:
        th.join(level_timeout)
    hung = sum(th.is_alive() for th in threads)
    t0, t1 = st["t0"], st["t1"]
    win = [r for r in recs if t0 < r[1] <= t1]
    ok = [r for r in win if r[2]]
    lat = [(r[1] - r[0]) * 1000 for r in ok]
    ttft = [r[4] for r in ok if r[4]]
    errors: dict[str, int] = {}
    for r in recs:
        if not r[2]:
            errors[r[3]] = errors.get(r[3], 0) + 1
    wall = t1 - t0
    return {
        "concurrency": conc,
        "window_s": r3(wall),
        "completed": len(ok),
        "failed_in_window": len(win) - len(ok),
        "throughput_rps": r3(len(ok) / wall) if wall > 0 else 0.0,
        "p50_ms": r3(percentile(lat, 50)),
        "p95_ms": r3(percentile(lat, 95)),
        "p99_ms": r3(percentile(lat, 99)),
        "mean_ms": r3(sum(lat) / len(lat)) if lat else None,
        "ttft_p50_ms": r3(percentile(ttft, 50)) if ttft else None,
        "ttft_p95_ms": r3(percentile(ttft, 95)) if ttft else None,
        "mean_completion_tokens": r3(sum(r[5] for r in ok) / len(ok)) if ok else None,
        "mean_prompt_tokens": r3(sum(r[6] for r in ok) / len(ok)) if ok else None,
        "mean_hits": r3(sum(r[7] for r in ok) / len(ok)) if ok else None,
        "requests_total": len(recs),
        "errors": errors,
        "warmup_s": r3(t0 - t_begin),
        "drain_s": r3(time.perf_counter() - t_drain),
        "timed_out": timed_out,
        "hung_workers": hung,
    }


def run_levels(name: str, call, questions, levels, a, metrics_port: int | None) -> dict:
    out = {}
    for c in levels:
        snaps = {}

        def mark(edge, _snaps=snaps):
            if metrics_port:
                try:
                    _snaps[edge] = scrape(metrics_port)
                except Exception as exc:  # noqa: BLE001
                    log(f"  metrics scrape failed: {exc}")

        res = closed_loop(call, questions, c, duration=a.duration, requests=a.requests, warmup_s=a.warmup, mark=mark)
        if "start" in snaps and "end" in snaps:
            res.update(metric_delta(snaps["start"], snaps["end"]))
        out[str(c)] = res
        log(f"  {name:12s} c={c:<3d} {res['throughput_rps']:7.3f} req/s  p50 {res['p50_ms']:9.1f} ms  "
            f"p95 {res['p95_ms']:9.1f} ms  ttft50 {res['ttft_p50_ms']}  n={res['completed']}  "
            f"idle {res.get('generator_idle_fraction')}  batch {res.get('mean_generate_batch')}  "
            f"errors {res['errors'] or '-'}")
    return out


# ------------------------------------------------------------------------------ OpRAG over gRPC

def grpc_call(client, max_new: int, timeout: float):
    import grpc

    def call(q: str):
        try:
            r = client.query(q, max_new_tokens=max_new, timeout=timeout)
            return True, "OK", (r.ttft_ms or None), r.completion_tokens, r.prompt_tokens, len(r.sources)
        except grpc.RpcError as e:
            return False, e.code().name, None, 0, 0, 0

    return call


def server_args(a, extra: list[str]) -> list[str]:
    return ["--shards", str(a.shards), "--max-new-tokens", str(a.max_new_tokens), *extra, *a.server_arg]


def prepare_data(a, data_dir: Path, log_path: Path) -> dict:
    from oprag_client.client import OpRAGClient

    docs = load_corpus(a.shared)
    if a.docs:
        docs = docs[: a.docs]
    info: dict = {"data_dir": str(data_dir), "documents_in_corpus": len(docs)}
    t = time.perf_counter()
    srv = start_server(data_dir, "--generator", "none", "--shards", str(a.shards), log_path=log_path)
    try:
        with OpRAGClient(srv.target) as c:
            s = c.stats(timeout=60)
            if s.documents == 0:
                log(f"ingesting {len(docs)} documents into {data_dir}")
                info["ingest"] = ingest(c, docs)
                s = c.stats(timeout=60)
                info["ingested"] = True
            else:
                info["ingested"] = False
                if s.documents != len(docs):
                    raise SystemExit(
                        f"{data_dir} holds {s.documents} documents, the corpus has {len(docs)}: "
                        "remove the directory (or pass --data-dir) to re-ingest")
            info["documents"] = s.documents
            info["chunks"] = s.chunks
    finally:
        rc = srv.stop()
    info["prepare_s"] = round(time.perf_counter() - t, 1)
    info["stop_rc"] = rc
    if not a.docs and info["chunks"] < MIN_CHUNKS:
        raise SystemExit(f"corpus has {info['chunks']} chunks < {MIN_CHUNKS}")
    log(f"data: {info['documents']} documents, {info['chunks']} chunks ({'ingested' if info['ingested'] else 'reused'})")
    return info


def check_corpus(c, name: str, expected_docs: int) -> dict:
    s = c.stats(timeout=60)
    res = {"documents": s.documents, "chunks": s.chunks, "expected_documents": expected_docs}
    if s.documents != expected_docs:
        log(f"WARNING: {name}: server started with {s.documents} documents, expected {expected_docs}")
    return res


def run_server_system(name: str, a, data_dir: Path, log_path: Path, questions, levels,
                      expected_docs: int) -> tuple[dict, list[str]]:
    from oprag_client.client import OpRAGClient

    extra = server_args(a, SERVER_SYSTEMS[name])
    t = time.perf_counter()
    srv = start_server(data_dir, *extra, log_path=log_path)
    start_s = time.perf_counter() - t
    log(f"{name}: server up in {start_s:.1f} s ({' '.join(extra)})")
    try:
        with OpRAGClient(srv.target) as c:
            corpus = check_corpus(c, name, expected_docs)
            res = run_levels(name, grpc_call(c, a.max_new_tokens, a.rpc_timeout), questions, levels, a, srv.metrics_port)
            alive = srv.alive() and c.health(timeout=10) == "SERVING"
    finally:
        rc = srv.stop()
    return ({"server_args": extra, "server_start_s": round(start_s, 1), "corpus_at_start": corpus,
             "alive_at_end": alive, "stop_rc": rc, "levels": res}, server_issues(srv, name))


# ------------------------------------------------------------------------------ LangChain

def run_langchain(a, data_dir: Path, questions, levels) -> dict:
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import torch
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy
    from langchain_core.embeddings import Embeddings
    from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

    t = time.perf_counter()
    snap = read_snapshot(data_dir)
    encoder = _internals.encoder("minilm")
    encoder.warm_up()
    gen = _internals.generator("smollm2")
    gen.warm_up()

    class MiniLM(Embeddings):
        def embed_documents(self, texts):
            return encoder.encode(list(texts), truncate=True).tolist()

        def embed_query(self, text):
            return encoder.encode([text], truncate=True)[0].tolist()

    metas = [{"chunk_id": c, "doc_id": d, "title": ti} for c, d, ti in zip(snap["chunk_id"], snap["doc_id"], snap["title"])]
    store = FAISS.from_embeddings(list(zip(snap["text"], snap["vectors"].tolist())), MiniLM(), metadatas=metas,
                                  distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
    retriever = store.as_retriever(search_kwargs={"k": a.top_k})
    tl = threading.local()

    def to_prompt(x: dict) -> str:
        hits = [_internals.hit(chunk_id=d.metadata["chunk_id"], doc_id=d.metadata["doc_id"],
                               title=d.metadata["title"], text=d.page_content, score=0.0, dense_score=0.0,
                               lexical_score=0.0, shard=0) for d in x["docs"]]
        payload = _internals.build_context(x["question"], hits, gen, budget_tokens=a.context_tokens,
                                max_new_tokens=a.max_new_tokens)
        tl.nhits = len(payload.sources)
        return payload.prompt

    def llm(prompt: str) -> str:
        def on_token(_row, _delta):
            if getattr(tl, "first", None) is None:
                tl.first = time.perf_counter()

        r = gen.generate([prompt], a.max_new_tokens, on_token=on_token)[0]
        tl.tokens, tl.ptok = r.completion_tokens, r.prompt_tokens
        return r.text

    chain = (RunnableParallel(docs=retriever, question=RunnablePassthrough())
             | RunnableLambda(to_prompt) | RunnableLambda(llm))
    build_s = time.perf_counter() - t
    log(f"langchain: {len(snap['chunk_id'])} chunks in FAISS, models loaded, built in {build_s:.1f} s "
        f"(torch threads {torch.get_num_threads()})")

    def call(q: str):
        tl.first, tl.tokens, tl.ptok, tl.nhits = None, 0, 0, 0
        t0 = time.perf_counter()
        chain.invoke(q)
        ttft = (tl.first - t0) * 1000 if tl.first else None
        return True, "OK", ttft, tl.tokens, tl.ptok, tl.nhits

    res = run_levels("langchain", call, questions, levels, a, None)
    return {"chain": "RunnableParallel(docs=FAISS(MiniLM) retriever k, question) | RunnableLambda(build_context) | "
                     "RunnableLambda(HFGenerator smollm2 greedy)",
            "retrieval": "dense only (FAISS inner product over the snapshot vectors); OpRAG does hybrid dense-first + BM25",
            "torch_threads": torch.get_num_threads(), "build_s": round(build_s, 1), "levels": res}


# ------------------------------------------------------------------------------ overload

async def _open_loop(target: str, questions, rate: float, duration: float, deadline: float, max_new: int) -> dict:
    import grpc
    from oprag_client.client import AsyncOpRAGClient

    recs: list[tuple[str, float]] = []
    lags: list[float] = []
    async with AsyncOpRAGClient(target) as c:
        async def one(q: str):
            t = time.perf_counter()
            try:
                await c.query(q, max_new_tokens=max_new, timeout=deadline)
                recs.append(("OK", time.perf_counter() - t))
            except grpc.aio.AioRpcError as e:
                recs.append((e.code().name, time.perf_counter() - t))

        n = max(1, int(round(rate * duration)))
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            due = t0 + i / rate
            d = due - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)
            lags.append(max(0.0, time.perf_counter() - due))
            tasks.append(asyncio.create_task(one(questions[i % len(questions)])))
        send_s = time.perf_counter() - t0
        await asyncio.gather(*tasks)
        total_s = time.perf_counter() - t0
    return {"recs": recs, "sent": n, "send_s": send_s, "total_s": total_s, "lags": lags}


def run_overload(a, data_dir: Path, log_path: Path, questions, sustainable_rps: float, unloaded_p95: float | None) -> tuple[dict, list[str]]:
    from oprag_client.client import OpRAGClient

    cap = a.overload_queue_capacity or 2 * a.max_batch
    extra = server_args(a, ["--queue-capacity", str(cap)])
    rate = max(0.5, a.overload_factor * sustainable_rps)
    floor = a.overload_min_requests / a.overload_duration if a.overload_min_requests else 0.0
    if rate < floor:
        log(f"overload: {a.overload_factor:g} x {sustainable_rps:.2f} req/s = {rate:.2f} req/s would send fewer than "
            f"{a.overload_min_requests} requests in {a.overload_duration:g} s: offering {floor:.2f} req/s")
        rate = floor
    srv = start_server(data_dir, *extra, log_path=log_path)
    log(f"overload: server up ({' '.join(extra)}); open loop {rate:.2f} req/s for {a.overload_duration:.0f} s")
    try:
        with OpRAGClient(srv.target) as c:  # warm-up: one full batch
            from concurrent.futures import ThreadPoolExecutor

            call = grpc_call(c, a.max_new_tokens, a.rpc_timeout)
            n = min(a.max_batch, cap)
            with ThreadPoolExecutor(n) as ex:
                warm = list(ex.map(call, questions[:n]))
            log(f"overload: warm-up {sum(w[0] for w in warm)}/{n} OK")
        time.sleep(1.0)
        rss_before = rss_of(srv.proc.pid)
        m0 = scrape(srv.metrics_port)
        r = asyncio.run(_open_loop(srv.target, questions, rate, a.overload_duration, a.overload_deadline,
                                   a.max_new_tokens))
        m1 = scrape(srv.metrics_port)
        time.sleep(1.0)
        rss_after = rss_of(srv.proc.pid)
        alive = srv.alive()
        ok_after = False
        if alive:
            try:
                with OpRAGClient(srv.target) as c:
                    alive = c.health(timeout=10) == "SERVING"
                    c.query(questions[0], max_new_tokens=a.max_new_tokens, timeout=a.rpc_timeout)
                    ok_after = True
            except Exception as exc:  # noqa: BLE001
                log(f"overload: server not answering afterwards: {exc}")
                alive = False
    finally:
        rc = srv.stop()
    recs = r["recs"]
    refused = [t * 1000 for code, t in recs if code == "RESOURCE_EXHAUSTED"]
    # admitted = not refused at admission: answered OK, or expired/failed after being queued
    admitted = [t * 1000 for code, t in recs if code != "RESOURCE_EXHAUSTED"]
    answered = [t * 1000 for code, t in recs if code == "OK"]
    codes: dict[str, int] = {}
    for code, _ in recs:
        codes[code] = codes.get(code, 0) + 1
    n = len(recs)
    adm_p95 = percentile(admitted, 95) if admitted else None
    res = {
        "server_args": extra,
        "queue_capacity": cap,
        "sustainable_rps": r3(sustainable_rps),
        "offered_factor": r3(rate / sustainable_rps) if sustainable_rps else None,
        "offered_rps": r3(rate),
        "sent": r["sent"],
        "send_s": r3(r["send_s"]),
        "total_s": r3(r["total_s"]),
        "max_send_lag_ms": r3(max(r["lags"]) * 1000) if r["lags"] else None,
        "codes": codes,
        "refused_share": r3(len(refused) / n) if n else None,
        "refusal_p50_ms": r3(percentile(refused, 50)) if refused else None,
        "refusal_p95_ms": r3(percentile(refused, 95)) if refused else None,
        "refusal_max_ms": r3(max(refused)) if refused else None,
        "refusals_over_50ms": sum(1 for x in refused if x > 50.0),
        "admitted": len(admitted),
        "answered_ok": len(answered),
        "answered_ok_p95_ms": r3(percentile(answered, 95)) if answered else None,
        "admitted_throughput_rps": r3(len(answered) / r["total_s"]) if r["total_s"] else None,
        "admitted_p50_ms": r3(percentile(admitted, 50)) if admitted else None,
        "admitted_p95_ms": r3(adm_p95),
        "unloaded_p95_ms": r3(unloaded_p95),
        "admitted_p95_vs_unloaded_p95": r3(adm_p95 / unloaded_p95) if adm_p95 and unloaded_p95 else None,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "rss_growth_fraction": r3((rss_after["main_mb"] - rss_before["main_mb"]) / rss_before["main_mb"]),
        "rss_growth_fraction_with_children": r3(
            (rss_after["with_children_mb"] - rss_before["with_children_mb"]) / rss_before["with_children_mb"]),
        "alive_after": bool(alive),
        "query_ok_after": ok_after,
        "stop_rc": rc,
        "server_metrics": metric_delta(m0, m1),
    }
    log(f"overload: {codes}; refused {res['refused_share']}, refusal p95 {res['refusal_p95_ms']} ms, admitted p95 "
        f"{res['admitted_p95_ms']} ms (unloaded p95 {res['unloaded_p95_ms']} ms), RSS {rss_before} -> {rss_after}, "
        f"alive {alive}")
    return res, server_issues(srv, "overload")


# ------------------------------------------------------------------------------ steps

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="folder with data/scifact, data/wikitext-2")
    ap.add_argument("--data-dir", type=Path, default=None, help="server data dir (default bench/out/serving-data[-Ndocs])")
    ap.add_argument("--docs", type=int, default=0, help="use only the first N documents (smoke runs)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated closed-loop concurrency levels")
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds per level")
    ap.add_argument("--requests", type=int, default=0, help="measured completions per level (instead of --duration)")
    ap.add_argument("--warmup", type=float, default=15.0, help="warm-up seconds per level (duration mode)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="subset of " + ",".join(ALL_SYSTEMS))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=5, help="LangChain retriever k (the server default top_k is 5)")
    ap.add_argument("--context-tokens", type=int, default=1024, help="LangChain prompt budget (server default 1024)")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8; for the overload queue)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[], help="extra option for every server (repeatable)")
    ap.add_argument("--rpc-timeout", type=float, default=600.0, help="per-request deadline of the closed loops")
    ap.add_argument("--no-overload", action="store_true")
    ap.add_argument("--overload-factor", type=float, default=4.0)
    ap.add_argument("--overload-duration", type=float, default=20.0)
    ap.add_argument("--overload-deadline", type=float, default=30.0)
    ap.add_argument("--overload-queue-capacity", type=int, default=0, help="default 2 x --max-batch")
    ap.add_argument("--overload-min-requests", type=int, default=0,
                    help="raise the offered rate so that at least this many requests are sent (--quick: 3 x queue capacity)")
    ap.add_argument("--quick", action="store_true", help="300 docs, concurrency 1,4, 8 requests per level, 5 s overload")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here (default bench/out/serving[-quick].json)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    a = ap.parse_args(argv)
    if a.quick:
        a.docs = a.docs or 300
        a.concurrency = "1,4" if a.concurrency == "1,8,32" else a.concurrency
        a.requests = a.requests or 8
        a.overload_duration = 5.0 if a.overload_duration == 20.0 else a.overload_duration
        a.overload_min_requests = a.overload_min_requests or 3 * (a.overload_queue_capacity or 2 * a.max_batch)
    a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in a.systems:
        if s not in ALL_SYSTEMS:
            ap.error(f"unknown system {s!r}")
    a.data_dir = a.data_dir or (OUT / ("serving-data" if not a.docs else f"serving-data-{a.docs}docs"))
    a.log_path = OUT / "serving-server.log"
    return a


def check_optional(a) -> None:
    """Before the first step: psutil (server RSS in the overload run) and, when selected, the
    LangChain system's libraries."""
    if not a.no_overload:
        require("psutil", what="the overload run's RSS measurement (or pass --no-overload)")
    if "langchain" in a.systems:
        require("langchain_community", "langchain_core", "faiss",
                what="the langchain system (or leave it out of --systems)")


def level(systems_out: dict, sys_name: str, c: str) -> dict | None:
    """The result of one system at concurrency ``c`` (a string key), or None."""
    return systems_out.get(sys_name, {}).get("levels", {}).get(c)


def run_all(a, questions: list[str], data: dict) -> tuple[dict, dict | None, list[str]]:
    """Steps 3-5: the server systems, the overload run, the LangChain system.

    :returns: (``{system: result}``, overload result or None, suspicious server log lines)."""
    systems_out: dict = {}
    issues: list[str] = []
    for name in ("oprag", "no_overlap", "no_batching"):
        if name in a.systems:
            systems_out[name], iss = run_server_system(name, a, a.data_dir, a.log_path, questions, a.levels,
                                                       data["documents"])
            issues += iss
    top, low = str(max(a.levels)), str(min(a.levels))
    overload = None
    head = level(systems_out, "oprag", top)
    if not a.no_overload and head:
        lo = level(systems_out, "oprag", low)
        unloaded = lo["p95_ms"] if lo and low == "1" else None
        overload, iss = run_overload(a, a.data_dir, a.log_path, questions, head["throughput_rps"], unloaded)
        issues += iss
    if "langchain" in a.systems:
        systems_out["langchain"] = run_langchain(a, a.data_dir, questions, a.levels)
    return systems_out, overload, issues


def findings_of(a, systems_out: dict, overload: dict | None, issues: list[str]) -> list[str]:
    """Things that look wrong, with evidence (logged and kept in the JSON)."""
    findings: list[str] = []
    for sname, s in systems_out.items():
        for c, L in s.get("levels", {}).items():
            if L.get("mean_hits") == 0:
                findings.append(f"{sname} c={c}: answers were generated with no sources in the prompt "
                                f"(mean prompt tokens {L.get('mean_prompt_tokens')})")
            if L["errors"]:
                findings.append(f"{sname} c={c}: failed requests {L['errors']}")
            if L["timed_out"] or L["hung_workers"]:
                findings.append(f"{sname} c={c}: timed_out={L['timed_out']} hung_workers={L['hung_workers']}")
            codes = {k: v for k, v in (L.get("server_status_codes") or {}).items() if not k.endswith(":OK")}
            if codes:
                findings.append(f"{sname} c={c}: server counted non-OK statuses {codes}")
            idle = L.get("generator_idle_fraction")
            if idle is not None and int(c) >= 8 and sname != "no_overlap" and idle > 0.10:
                findings.append(f"{sname} c={c}: generator idle {idle:.1%} of the window while {c} requests were "
                                f"outstanding (mean generate batch {L.get('mean_generate_batch')})")
        cs = s.get("corpus_at_start")
        if cs and cs["documents"] != cs["expected_documents"]:
            findings.append(f"{sname}: server started with {cs['documents']} documents, {cs['expected_documents']} "
                            "were ingested into the same data dir")
        if s.get("alive_at_end") is False:
            findings.append(f"{sname}: server not SERVING at the end")
    if overload:
        if overload["refusal_p95_ms"] is not None and overload["refusal_p95_ms"] >= 50:
            findings.append(f"overload: refusal p95 {overload['refusal_p95_ms']} ms >= 50 ms "
                            f"({overload['refusals_over_50ms']} of {overload['codes'].get('RESOURCE_EXHAUSTED', 0)} "
                            f"refusals over 50 ms, max {overload['refusal_max_ms']} ms)")
        bad = {k: v for k, v in overload["codes"].items() if k not in ("OK", "RESOURCE_EXHAUSTED")}
        if bad:
            findings.append(f"overload: other status codes {bad} among {overload['admitted']} admitted requests "
                            f"(deadline {a.overload_deadline:g} s, queue capacity {overload['queue_capacity']})")
        if not overload["alive_after"] or not overload["query_ok_after"]:
            findings.append("overload: server not answering afterwards")
        if not overload["codes"].get("RESOURCE_EXHAUSTED"):
            findings.append("overload: no request was refused (admission never triggered)")
    if issues:
        findings.append(f"{len(issues)} suspicious server log lines (see server_log_issues)")
    for f in findings:
        log("FINDING: " + f)
    return findings


def report(a, systems_out: dict, overload: dict | None, findings: list[str], issues: list[str],
           n_questions: int) -> dict:
    """Step 6: the headline (oprag at the highest concurrency), ratios, the table, everything."""
    top = str(max(a.levels))

    def ratio(other):
        x, y = level(systems_out, "oprag", top), level(systems_out, other, top)
        if not x or not y or not y["throughput_rps"]:
            return None
        return r3(x["throughput_rps"] / y["throughput_rps"])

    head = level(systems_out, "oprag", top) or {}
    return {
        "benchmark": "serving",
        "quick": a.quick,
        "headline_concurrency": int(top),
        "throughput_rps": head.get("throughput_rps"),
        "throughput_ratio_vs_no_overlap": ratio("no_overlap"),
        "throughput_ratio_vs_no_batching": ratio("no_batching"),
        "throughput_ratio_vs_langchain": ratio("langchain"),
        "generator_idle_fraction": head.get("generator_idle_fraction"),
        "p50_ms": head.get("p50_ms"),
        "p95_ms": head.get("p95_ms"),
        "ttft_p50_ms": head.get("ttft_p50_ms"),
        "overload_refused_share": overload["refused_share"] if overload else None,
        "overload_refusal_p95_ms": overload["refusal_p95_ms"] if overload else None,
        "overload_admitted_p95_ms": overload["admitted_p95_ms"] if overload else None,
        "unloaded_p95_ms": overload["unloaded_p95_ms"] if overload else (level(systems_out, "oprag", "1") or {}).get("p95_ms"),
        "overload_admitted_p95_vs_unloaded": overload["admitted_p95_vs_unloaded_p95"] if overload else None,
        "overload_rss_growth_fraction": overload["rss_growth_fraction"] if overload else None,
        "overload_server_alive": overload["alive_after"] if overload else None,
        "table": {s: {c: {k: L.get(k) for k in ("throughput_rps", "p50_ms", "p95_ms", "ttft_p50_ms",
                                                 "generator_idle_fraction", "mean_generate_batch")}
                      for c, L in v.get("levels", {}).items()} for s, v in systems_out.items()},
        "systems": systems_out,
        "overload": overload,
        "findings": findings,
        "server_log_issues": issues[:60],
        "config": {"levels": a.levels, "duration_s": None if a.requests else a.duration,
                   "requests_per_level": a.requests or None, "warmup_s": None if a.requests else a.warmup,
                   "max_new_tokens": a.max_new_tokens, "questions": "scifact queries.jsonl, file order",
                   "n_questions": n_questions, "systems": a.systems},
    }


# ------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(x.split("=")[0] in ("--engine-url", "--standin") for x in args):  # engine mode (issue 12)
        from . import serving_engine

        return serving_engine.main(args)
    a = parse_args(argv)
    check_optional(a)
    t_all = time.perf_counter()
    machine = machine_info()
    questions = load_questions(a.shared)
    log(f"serving bench: systems {a.systems}, levels {a.levels}, "
        f"{'%d requests' % a.requests if a.requests else '%.0f s' % a.duration} per level, {len(questions)} questions")
    data = prepare_data(a, a.data_dir, a.log_path)
    systems_out, overload, issues = run_all(a, questions, data)
    findings = findings_of(a, systems_out, overload, issues)
    result = report(a, systems_out, overload, findings, issues, len(questions))
    result.update({"data": data, "machine": machine, "total_s": round(time.perf_counter() - t_all, 1)})
    out = a.out or (OUT / ("serving-quick.json" if a.quick else "serving.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    log(f"done in {result['total_s']:.0f} s; written {out}")
    if a.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
