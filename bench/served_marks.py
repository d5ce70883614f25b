"""Where a served Retrieve's time goes outside the shards' search, over gRPC (issue 13, fe15).

The real server (``python -m oprag_server`` through :func:`_serve`, which installs the marks
first) on ``--data-dir``, SciFact train queries with their MiniLM vectors, c = 1, hybrid,
top_k 10, the server's defaults. Every process stamps ``time.perf_counter`` (CLOCK_MONOTONIC:
one clock for client, frontend and shards):

* client: before and after each ``Retrieve``;
* frontend (one JSON line per Retrieve): the servicer's entry, after ``query_job``, the
  retriever's entry and exit, each pipe call (shard, time), each reader callback (shard, entry,
  exit: the read and unpickle of its frames), each ``gather_partial`` (start, resolved), the
  fetches (``_materialise``), the engine's return, the response built, the bytes ready; the
  loop thread's CPU over the handler;
* shards (one line per op): the read of the request (asked, done), receive, dispatch end, thread CPU
  of the dispatch, reply pickled, reply written, reply bytes; a FIELDS request right behind a
  search (``--shard-workers inline``: shards/gather.py) is reported as its own parts;
* ``--shard-workers inline`` (``--server-args``): shard 0's search on the loop (start, end).

No server code is changed: the marks are wrappers installed in the server process (and, by
name, in the spawned shards). ``--passes`` passes over the queries; all but the first are reported
(median, p10, p90 and mean of each part per request, us). The last pass's hits (ids, scores, ranks,
fields, ``certified``, ``widen_rounds``) go to ``<out>/hits.json``, to compare two trees' replies;
``OPRAG_BENCH_MARKS_DUMP=1`` also keeps every search reply's pickle (``<out>/marks.shard<i>.bodies``)
for in-process replays. With ``PYTHONPATH=<old>/server:<old>/client:<this tree>`` the server run
is the old tree's (the marks wrap functions both have).

    python -m bench.served_marks --data-dir bench/out/d1m --dense-index hnsw --queries 100 --passes 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

_ENV = "OPRAG_BENCH_MARKS"
pc = time.perf_counter


def _shard_run(*args, **kw):
    """Shard entry point: ``worker.run`` with ``dispatch`` and ``Pipe.send`` stamped."""
    from oprag_server.shards import worker  # noqa: PLC0415

    out = open(f"{os.environ[_ENV]}.shard{args[0]}", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    inner, cur, stamp = worker.dispatch, {}, {}
    dump = open(f"{os.environ[_ENV]}.shard{args[0]}.bodies", "ab") if os.environ.get(_ENV + "_DUMP") else None  # noqa: SIM115

    def dispatch(table, op, req):
        cur.clear()
        cur.update(stamp)  # (the read of this request: r0 when the loop asked for it, r1 when it had it)
        stamp.clear()
        cur["op"], cur["recv"], c0 = op.value, pc(), time.thread_time()
        try:
            return inner(table, op, req)
        finally:
            cur["end"], cur["cpu"] = pc(), time.thread_time() - c0

    def send(self, obj):
        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        t = pc()
        worker.writev_all(self.fd, [memoryview(worker.frame_head(len(body))), memoryview(body).cast("B")])
        if cur:
            cur["pickled"], cur["sent"], cur["bytes"] = t, pc(), len(body)
            if dump is not None and cur["op"] == "search":  # the reply, for an in-process replay
                dump.write(len(body).to_bytes(8, "little") + body)
                dump.flush()
            out.write(json.dumps(cur) + "\n")
            cur.clear()

    orig_recv = worker.Pipe.recv

    def recv(self):
        stamp["r0"] = pc()
        out = orig_recv(self)
        stamp["r1"] = pc()
        return out

    worker.Pipe.recv = recv
    worker.dispatch = dispatch
    worker.Pipe.send = send
    return worker.run(*args, **kw)


def _shard_main(*args) -> None:
    """``worker.main`` (the spawned shard's target) with :func:`_shard_run` in place of ``worker.run``."""
    from oprag_server.shards import worker  # noqa: PLC0415

    _shard_run(*args)
    worker.exit_now(0)


def _install() -> None:
    """Frontend marks (in the server process, before it starts)."""
    from oprag_server.operators import retrieve as rmod  # noqa: PLC0415
    from oprag_server.service import convert, servicer  # noqa: PLC0415
    from oprag_server.shards import pool as pool_mod  # noqa: PLC0415
    from oprag_server.shards import transport, worker  # noqa: PLC0415

    worker.main = _shard_main  # the shard processes' target, pickled by name for the spawned shards
    out = open(f"{os.environ[_ENV]}.frontend", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    cur: dict = {}
    pre: dict = {}  # the gRPC layers' marks of the call before the servicer's entry
    from oprag_server.service import interceptors  # noqa: PLC0415

    orig_icpt, orig_lenient = interceptors.StatusInterceptor.intercept_service, interceptors.lenient

    async def intercept_service(self, continuation, details):
        pre.clear()
        pre["i0"] = pc()
        return await orig_icpt(self, continuation, details)

    def lenient(deserializer):
        inner = orig_lenient(deserializer)
        if inner is None:
            return None

        def decode(raw):
            pre["d0"] = pc()
            try:
                return inner(raw)
            finally:
                pre["d1"] = pc()

        return decode

    interceptors.StatusInterceptor.intercept_service, interceptors.lenient = intercept_service, lenient

    async def Retrieve(self, request, context):  # noqa: N802 - the servicer's, with marks
        cur.clear()
        cur.update(t0=pc(), cpu0=time.thread_time(), calls=[], reads=[], gathers=[], **pre)
        job = self._job(request, generate=False)
        cur["job"] = pc()
        await self._read_your_writes(request, context)
        job = await self.rt.query.submit(job)
        cur["submitted"] = pc()
        resp = convert.retrieve_response(job, include_trace=request.include_trace)
        cur["response"] = pc()
        raw = self._fits(resp, request)
        cur["t1"], cur["cpu"] = pc(), time.thread_time() - cur.pop("cpu0")
        cur["resp_bytes"] = len(raw)
        out.write(json.dumps(cur) + "\n")
        return raw

    servicer.OpRAGServicer.Retrieve = Retrieve
    orig_ret, orig_mat = rmod.Retriever.retrieve, rmod.Retriever._materialise

    async def retrieve(self, *a, **k):
        cur["r0"] = pc()
        try:
            return await orig_ret(self, *a, **k)
        finally:
            cur["r1"] = pc()

    async def materialise(self, *a, **k):
        cur["m0"] = pc()
        try:
            return await orig_mat(self, *a, **k)
        finally:
            cur["m1"] = pc()

    rmod.Retriever.retrieve, rmod.Retriever._materialise = retrieve, materialise
    orig_gp = pool_mod.ShardPool.gather_partial

    async def gather_partial(self, op, *a, **k):
        t = pc()
        try:
            return await orig_gp(self, op, *a, **k)
        finally:
            if "gathers" in cur:
                cur["gathers"].append((op.value, t, pc()))

    pool_mod.ShardPool.gather_partial = gather_partial
    orig_call, orig_read = transport.PipeTransport.call, transport.PipeTransport._on_readable

    def call(self, op, request, into=None):
        t = pc()
        try:
            return orig_call(self, op, request, into)
        finally:
            if "calls" in cur:
                cur["calls"].append((self.shard_id, op.value, t, pc()))

    def on_readable(self):
        t = pc()
        try:
            return orig_read(self)
        finally:
            if "reads" in cur:
                cur["reads"].append((self.shard_id, t, pc()))

    transport.PipeTransport.call, transport.PipeTransport._on_readable = call, on_readable
    from oprag_server.shards import inline  # noqa: PLC0415

    orig_inline = inline.InlineTransport._inline

    def run_inline(self, op, request, fut):  # --shard-workers inline: shard 0 searched on the loop
        t = pc()
        ran = orig_inline(self, op, request, fut)
        if ran and "calls" in cur:
            cur.setdefault("inline", []).append((self.shard_id, op.value, t, pc()))
        return ran

    inline.InlineTransport._inline = run_inline


def _serve(argv: list[str]) -> None:
    _install()
    from oprag_server.cli import main  # noqa: PLC0415

    sys.exit(main(argv, prog="python -m oprag_server"))


def _med(xs):
    return float(np.median(xs)) if xs else float("nan")


def summarise(client: list[tuple[float, float]], fe: list[dict], shards: dict[int, list[dict]]) -> dict:
    """Per request (c = 1: the i-th client call is the i-th frontend line; each shard's search
    lines in order), the parts in us; medians and p10/p90."""
    idx = {s: 0 for s in shards}
    m: dict[str, list[float]] = {}

    def add(k, v):
        m.setdefault(k, []).append(v * 1e6)

    for (cs, cr), f in zip(client, fe):
        searches = [g for g in f["gathers"] if g[0] == "search"]
        add("client", cr - cs)
        add("grpc_in", f["t0"] - cs)
        if "i0" in f and "d1" in f:  # grpc_in's parts: to the interceptor, the decode, to the servicer
            add("grpc_in_to_interceptor", f["i0"] - cs)
            add("grpc_in_interceptor_to_decode", f["d0"] - f["i0"])
            add("grpc_in_decode", f["d1"] - f["d0"])
            add("grpc_in_decode_to_servicer", f["t0"] - f["d1"])
        add("query_job", f["job"] - f["t0"])
        add("engine_before", f["r0"] - f["job"])
        add("retrieve", f["r1"] - f["r0"])
        if not searches:
            continue
        add("retrieve_prologue", searches[0][1] - f["r0"])
        round_calls = [c for c in f["calls"] if c[1] == "search"]
        rows = []
        for sh, _op, t, t_end in round_calls:
            r = shards[sh][idx[sh]]
            idx[sh] += 1
            rows.append((sh, t, t_end, r))
        ns = len(round_calls) // len(searches) if searches else 0
        add("rounds", len(searches) / 1e6)
        r1 = rows[:ns]
        g0, g1 = searches[0][1], searches[0][2]
        add("r1_calls", max(x[2] for x in r1) - g0)
        reads = [x for x in f["reads"] if g0 <= x[1] <= g1]
        slow = max(r1, key=lambda x: x[3]["sent"])
        for sh, t, _te, r in r1:
            add(f"s{sh}_wake", r["recv"] - t)
            add(f"s{sh}_dispatch_wall", r["end"] - r["recv"])
            add(f"s{sh}_dispatch_cpu", r["cpu"])
            add(f"s{sh}_pickle", r["pickled"] - r["end"])
            add(f"s{sh}_writev", r["sent"] - r["pickled"])
            add(f"s{sh}_reply_kb", r["bytes"] / 1e9)
            rd = [x for x in reads if x[0] == sh]
            if rd:
                add(f"s{sh}_fe_wake", rd[-1][1] - r["sent"])
                add(f"s{sh}_read_unpickle", sum(x[2] - x[1] for x in rd))
                add(f"s{sh}_reads", len(rd) / 1e6)
        for sh, op, t, t_end in f.get("inline", []):
            if op == "search" and g0 <= t <= g1:
                add(f"s{sh}_inline_start", t - g0)
                add(f"s{sh}_inline_search", t_end - t)
                add(f"s{sh}_inline_end_to_resolved", g1 - t_end)
        add("slowest_dispatch_wall", slow[3]["end"] - slow[3]["recv"])
        add("slowest_send_to_end", slow[3]["end"] - g0)
        add("start_skew", abs(r1[0][3]["recv"] - r1[-1][3]["recv"]))
        last_read = max((x[2] for x in reads), default=g1)
        add("task_resume", g1 - last_read)
        add("slowest_end_to_resolved", g1 - slow[3]["end"])
        nxt = searches[1][1] if len(searches) > 1 else f.get("m0", f["r1"])
        add("merge_r1", nxt - g1)
        if len(searches) == 1:
            add("merge_r1_only1", nxt - g1)
            add("retrieve_minus_slowest_1r", (f["r1"] - f["r0"]) - (slow[3]["end"] - slow[3]["recv"]))
            add("client_minus_slowest_1r", (cr - cs) - (slow[3]["end"] - slow[3]["recv"]))
            add("client_1r", cr - cs)
        else:
            add("widen_rounds_wall", searches[-1][2] - searches[1][1])
            add("client_widened", cr - cs)
        if "m0" in f:
            add("after_last_round_merge", f["m0"] - searches[-1][2])
            add("materialise", f["m1"] - f["m0"])
            add("retrieve_tail", f["r1"] - f["m1"])
        add("engine_after", f["submitted"] - f["r1"])
        add("response", f["response"] - f["submitted"])
        add("fits", f["t1"] - f["response"])
        add("grpc_out", cr - f["t1"])
        add("fe_loop_cpu", f["cpu"])
        add("resp_kb", f["resp_bytes"] / 1e9)
        add("retrieve_minus_slowest", (f["r1"] - f["r0"]) - (slow[3]["end"] - slow[3]["recv"]))
        add("client_minus_slowest", (cr - cs) - (slow[3]["end"] - slow[3]["recv"]))
        add("client_minus_retrieve", (cr - cs) - (f["r1"] - f["r0"]))
    out = {}
    for k, v in m.items():
        a = np.asarray(v)
        out[k] = {"p50": round(float(np.median(a)), 1), "p10": round(float(np.percentile(a, 10)), 1),
                  "p90": round(float(np.percentile(a, 90)), 1), "mean": round(float(a.mean()), 1), "n": len(a)}
    return out


def main(argv=None) -> dict:
    from ._common import served_args  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    served_args(ap)
    ap.add_argument("--passes", type=int, default=2, help="every pass after the first is reported")
    ap.add_argument("--out", type=Path, default=Path("bench/out/marks"))
    ap.add_argument("--shared", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--server-args", default="", help="more `oprag serve` options, e.g. '--shard-workers inline'")
    ap.add_argument("--qos", action="store_true", help="the client holds a CPU latency QoS request of 0 us")
    a = ap.parse_args(argv)
    from oprag_client.client import OpRAGClient, query_request  # noqa: PLC0415
    from oprag_client.testing import ServerProcess  # noqa: PLC0415

    from . import _internals  # noqa: PLC0415
    from ._common import DEFAULT_SHARED, OUT, REPO, emit_json, load_queries_qrels, log, machine_info  # noqa: PLC0415

    judged, _ = load_queries_qrels(a.shared or DEFAULT_SHARED, "train")
    texts = [judged[x] for x in list(judged)[: a.queries]]
    vecs = _internals.encoder("minilm", device="cpu").encode(texts, truncate=True)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = str(a.out.resolve() / "marks")
    for p in a.out.glob("marks.*"):
        p.unlink()

    class Marked(ServerProcess):
        def command(self):
            return [sys.executable, "-m", "bench.served_marks", "--serve", *super().command()[3:]]

    srv = Marked.on_free_ports(a.data_dir, "--generator", "none", "--shards", str(a.shards), "--dense-index",
                               a.dense_index, "--monitor-fraction", "0", *a.server_args.split(), log_path=OUT / "served-marks.log",
                               env={**os.environ, _ENV: stem}, cwd=REPO).start(300)
    client, replies = [], []
    from oprag_server.cpu_latency import hold, release  # noqa: PLC0415

    qos = hold(0 if a.qos else -1)
    try:
        with OpRAGClient(srv.target, timeout=600) as c:
            for p in range(a.passes):
                if p == 1 or a.passes == 1:  # the first pass warms up (reported: every later one)
                    client.clear()
                    n0 = _lines(stem + ".frontend")
                for text, v in zip(texts, vecs):
                    req = query_request(text, top_k=10, mode="hybrid", query_vector=v.tolist())
                    t = pc()
                    r = c.stub.Retrieve(req)
                    client.append((t, pc()))
                    if p == a.passes - 1:
                        replies.append(r)
                log(f"pass {p} done, load {os.getloadavg()[0]:.2f}")
    finally:
        release(qos)
        srv.stop()
    hits = [[(h.chunk_id, h.score, h.dense_score, h.lexical_score, h.dense_rank, h.lexical_rank, h.doc_id, h.text)
             for h in r.hits] + [(r.retrieval.certified, r.retrieval.widen_rounds)] for r in replies]
    (a.out / "hits.json").write_text(json.dumps(hits))  # the last pass's replies (old vs new: equal)
    fe = _read(stem + ".frontend")[n0:]
    shards = {}
    for s in range(a.shards):
        if not os.path.exists(f"{stem}.shard{s}"):  # a shard searched in the server (inline)
            continue
        rows = [r for r in _read(f"{stem}.shard{s}") if r["op"] == "search"]
        n = sum(1 for f in fe for x in f["calls"] if x[0] == s and x[1] == "search")
        shards[s] = rows[len(rows) - n:]
    res = {"data_dir": str(a.data_dir), "queries": len(texts), "machine": machine_info(),
           "load": os.getloadavg()[0], "parts_us": summarise(client, fe, shards)}
    for s in range(a.shards):  # a FIELDS request sent right behind a search (shards/gather.py fields_later)
        rows = _read(f"{stem}.shard{s}") if os.path.exists(f"{stem}.shard{s}") else []
        pairs = [(x, y) for x, y in zip(rows, rows[1:]) if x["op"] == "search" and y["op"] == "fields"]
        pairs = pairs[-len(shards.get(s, [])):] if shards.get(s) else []
        for k, vals in ((f"s{s}_fields_dispatch_wall", [y["end"] - y["recv"] for _, y in pairs]),
                        (f"s{s}_search_sent_to_fields_dispatch", [y["recv"] - x["sent"] for x, y in pairs]),
                        (f"s{s}_fields_reply_kb", [y["bytes"] / 1e9 for _, y in pairs])):
            if vals:
                a_ = np.asarray(vals) * 1e6
                res["parts_us"][k] = {"p50": round(float(np.median(a_)), 1), "p10": round(float(np.percentile(a_, 10)), 1),
                                      "p90": round(float(np.percentile(a_, 90)), 1), "mean": round(float(a_.mean()), 1),
                                      "n": len(a_)}
    for k, v in res["parts_us"].items():
        log(f"{k:28s} p50 {v['p50']:9.1f}  p10 {v['p10']:9.1f}  p90 {v['p90']:9.1f}  mean {v['mean']:9.1f}  n {v['n']}")
    if a.json:
        emit_json(res)
    return res


def _lines(path: str) -> int:
    return len(_read(path)) if os.path.exists(path) else 0


def _read(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _serve(sys.argv[2:])
    else:
        main()
