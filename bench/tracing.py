"""Tracing overhead benchmark: the same server with and without ``--otlp-endpoint``.

One run:

1. Corpus: the first ``--docs`` SciFact documents (client loaders), ingested once by a
   ``--generator none`` server into ``bench/out/tracing-data/off`` (reused across runs when
   Stats shows them); the server is stopped (SIGTERM: snapshot) and the data directory copied
   to ``.../on``, so both servers hold byte-identical data.
2. An OTLP/gRPC receiver in this process (:class:`oprag_client.testing.OtlpSink`,
   opentelemetry-proto's TraceService on a grpc server, spans counted and dropped): tracing
   runs its real path, the SDK's ``BatchSpanProcessor`` + OTLP/gRPC exporter over loopback.
3. Per phase (``--phases``): two servers side by side on the two copies, ``off`` (defaults)
   and ``on`` (``--otlp-endpoint``), both with the phase's generator: ``retrieve`` (gRPC
   Retrieve, ``--generator none``) and ``query`` (gRPC Query, the default small generator,
   ``--max-new-tokens`` new tokens). After ``--warmup`` untimed requests to each, ``--rounds``
   rounds; a round sends the same ``--per-round`` SciFact questions (file order) one at a time
   to one server, then to the other, the order alternating between rounds (ABBA: machine
   drift falls on both alike). Only one server is loaded at any moment.
4. Per phase and system: p50/p95 over all timed requests (nearest rank, ``_common.percentile``),
   the ratio on/off of p50 and p95, and the median over rounds of the per-round p50 ratio (a
   paired figure, less sensitive to slow drift). The sink's span count checks that the ``on``
   server exported a trace for every request, warm-up included (1 request span + one span per
   executed step: 3 for Retrieve, embed and retrieve).

5. In process (``--micro``): the work one traced request adds, measured directly (the server's
   ``Tracing.export`` of a finished Retrieve's 3 spans into the same OTLP sink): wall time on the
   calling thread (on the request path: the server exports before it answers) and total CPU
   per request including the exporter thread. Unlike the end-to-end ratio this stays readable
   on a loaded machine; divided by an end-to-end p50 it bounds the overhead.

"No cost when off" is structural, not measured: with tracing off no tracing object exists
(no wrapper around ``QueryEngine.submit``, no gRPC interceptor, the OpenTelemetry SDK is never
imported; ``tests/unit/test_tracing.py``), so a build with tracing removed runs the same
per-request code as ``off`` on gRPC; on HTTP the only extra work is one boolean test.

``--json`` prints one JSON object as the last stdout line (also written to
``bench/out/tracing.json``); progress goes to stderr, server output to
``bench/out/tracing-server.log``. From the repository root, with the ``otel`` extra:

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.tracing --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from ._common import DEFAULT_SHARED, OUT, emit_json, ingest, load_corpus, log, machine_info, percentile, require, start_server

PHASES = {"retrieve": ("none", "Retrieve"), "query": ("smollm2", "Query")}


def prepare_data(a) -> tuple[Path, Path]:
    """Ingest ``a.docs`` SciFact documents into ``off`` (unless there) and copy it to ``on``."""
    from oprag_client.client import OpRAGClient

    off, on = a.data_dir / "off", a.data_dir / "on"
    docs = load_corpus(a.shared, wikitext=False)[: a.docs]
    srv = start_server(off, "--generator", "none", "--shards", str(a.shards), log_path=a.log)
    try:
        with OpRAGClient(srv.target, timeout=600) as c:
            have = c.stats().documents
            if have != len(docs):
                if have:
                    raise SystemExit(f"{off} holds {have} documents, not {len(docs)}: delete {a.data_dir} or change --docs")
                log(f"ingesting {len(docs)} documents into {off}")
                log(f"  {ingest(c, docs)}")
    finally:
        srv.stop()
    shutil.rmtree(on, ignore_errors=True)
    shutil.copytree(off, on)
    return off, on


def questions(shared: Path, n: int) -> list[str]:
    from oprag_client.evaluate import load_queries

    qs = list(load_queries(Path(shared) / "data" / "scifact" / "queries.jsonl").values())
    return qs[:n]


def run_phase(a, name: str, dirs: dict[str, Path], sink) -> dict:
    from oprag_client.client import OpRAGClient

    generator, rpc = PHASES[name]
    common = ["--generator", generator, "--shards", str(a.shards), "--max-new-tokens", str(a.max_new_tokens)]
    extra = {"off": [], "on": ["--otlp-endpoint", sink.endpoint]}
    qs = questions(a.shared, a.per_round)
    servers, clients = {}, {}
    try:
        for sys_ in ("off", "on"):
            servers[sys_] = start_server(dirs[sys_], *common, *extra[sys_], log_path=a.log)
            clients[sys_] = OpRAGClient(servers[sys_].target, timeout=300)

        def one(sys_: str, q: str) -> float:
            t0 = time.perf_counter()
            getattr(clients[sys_], rpc.lower())(q, top_k=10, max_new_tokens=a.max_new_tokens)
            return time.perf_counter() - t0

        spans0 = sink.count
        for sys_ in ("off", "on"):
            for q in qs[: a.warmup]:
                one(sys_, q)
        lat: dict[str, list[float]] = {"off": [], "on": []}
        round_p50: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(a.rounds):
            for sys_ in (("off", "on") if r % 2 == 0 else ("on", "off")):
                xs = [one(sys_, q) for q in qs]
                lat[sys_] += xs
                round_p50[sys_].append(percentile(xs, 50))
            log(f"  {name} round {r + 1}/{a.rounds}: p50 off {round_p50['off'][-1] * 1e3:.2f} ms, "
                f"on {round_p50['on'][-1] * 1e3:.2f} ms")
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()  # SIGTERM: the server flushes its span exporter before it exits
    out: dict = {"rpc": rpc, "generator": generator, "requests_per_system": len(lat["off"])}
    for sys_ in ("off", "on"):
        ms = [x * 1e3 for x in lat[sys_]]
        out[sys_] = {"p50_ms": round(percentile(ms, 50), 3), "p95_ms": round(percentile(ms, 95), 3),
                     "mean_ms": round(statistics.fmean(ms), 3)}
    out["p50_ratio_on_off"] = round(out["on"]["p50_ms"] / out["off"]["p50_ms"], 4)
    out["p95_ratio_on_off"] = round(out["on"]["p95_ms"] / out["off"]["p95_ms"], 4)
    out["median_round_p50_ratio"] = round(statistics.median(
        on / off for on, off in zip(round_p50["on"], round_p50["off"])), 4)
    # every request the ``on`` server answered (warm-up included) should arrive as 1 + steps spans
    out["spans_exported"] = sink.count - spans0
    out["spans_per_traced_request"] = round(out["spans_exported"] / (len(lat["on"]) + len(qs[: a.warmup])), 2)
    return out


def micro(sink, n: int) -> dict:
    """The work one traced request adds, in process, on the server's own objects: the hand-off
    on the request path (``Tracing.wrap`` queues the finished query to the exporter thread),
    the span building (``Tracing.export`` of a finished Retrieve, 3 spans; off the request path),
    both as wall time on the calling thread (median and p95 of ``n``), and this process's CPU
    time per request including the threads' batching, encoding and OTLP/gRPC sends to ``sink``
    (``time.process_time`` over ``n`` requests, flushed every 500 so no span is dropped)."""
    from . import _internals

    tracing, job = _internals.traced_retrieve_job(sink.endpoint)
    carrier = ("Retrieve", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    for _ in range(200):
        tracing.export(job, carrier=carrier)
    tracing.flush()
    handoff, build, c0, spans0 = [], [], time.process_time(), sink.count
    for i in range(n):
        t0 = time.perf_counter()
        tracing._later(job, carrier=carrier)
        t1 = time.perf_counter()
        tracing.export(job, carrier=carrier)
        build.append(time.perf_counter() - t1)
        handoff.append(t1 - t0)
        if i % 250 == 249:
            tracing.flush()
    tracing.flush()
    cpu = time.process_time() - c0
    tracing.shutdown()
    out = {"requests": n, "spans_received": sink.count - spans0, "spans_expected": 2 * 3 * n}
    for name, xs in (("handoff", handoff), ("build", build)):
        us = [x * 1e6 for x in xs]
        out[f"{name}_wall_p50_us"], out[f"{name}_wall_p95_us"] = round(percentile(us, 50), 1), round(percentile(us, 95), 1)
    out["cpu_per_request_us"] = round(cpu / (2 * n) * 1e6, 1)  # each iteration exports the job twice
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="folder holding data/scifact")
    ap.add_argument("--data-dir", type=Path, default=OUT / "tracing-data")
    ap.add_argument("--docs", type=int, default=1000, help="first N SciFact documents")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--phases", default="retrieve,query", help="comma list of: " + ", ".join(PHASES) + " ('' = in process only)")
    ap.add_argument("--rounds", type=int, default=10, help="ABBA rounds per phase")
    ap.add_argument("--per-round", type=int, default=50, help="questions per round and system")
    ap.add_argument("--query-per-round", type=int, default=15, help="--per-round of the query phase")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=8, help="new tokens per answer in the query phase")
    ap.add_argument("--micro", type=int, default=20000, help="in-process traced requests (0 = skip)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    a = ap.parse_args(argv)
    require("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
            "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", extra="otel", what="bench.tracing")
    from oprag_client.testing import OtlpSink

    OUT.mkdir(parents=True, exist_ok=True)
    a.log = OUT / "tracing-server.log"
    result: dict = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(a).items()}}
    with OtlpSink(keep=False) as sink:
        if a.micro:
            result["micro"] = micro(sink, a.micro)
            log(f"in process: {result['micro']}")
        phases = [p.strip() for p in a.phases.split(",") if p.strip()]
        off, on = prepare_data(a) if phases else (None, None)
        for name in phases:
            b = argparse.Namespace(**vars(a))
            if name == "query":
                b.per_round = a.query_per_round
            log(f"phase {name}")
            result[name] = run_phase(b, name, {"off": off, "on": on}, sink)
            log(f"  {result[name]}")
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    (OUT / "tracing.json").write_text(json.dumps(result, indent=1))
    if a.json:
        emit_json(result)


if __name__ == "__main__":
    main()
