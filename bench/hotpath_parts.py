"""Where a Retrieve's CPU goes at c=1 (issue 13 hot path): three measurements on one data dir.

``--part threads``: a server (``--generator none``, 2 shards) on ``--data-dir``; over
``--queries`` Retrieves with the query vector supplied, CPU time per request of every thread of
the frontend and of each shard process (``/proc/<pid>/task/*/stat``, utime + stime).

``--part phases``: one shard's snapshot loaded in this process (single-threaded BLAS and FAISS,
as in a shard process); CPU per hybrid ``search`` (N = 256, fetch_k 10) split by phase
(thread CPU time around each method: FAISS top-n, canonical refine, dense-minimum estimate, or
the compiled dense step of a tree that has it (``Searcher._kernel_tops``),
BM25 of the candidates, k-skyband, stored fields, chunk ids; the rest is glue), and the pickle /
unpickle of the reply.

``--part merge``: both shards' snapshots loaded in this process; their real replies to hybrid
queries (N = 256, fetch_k 10) pickled as the shards send them; CPU per query of the frontend's
unpickle of the two replies, and of collecting the carried fields plus the global merge and
fusion (``Retriever._merge``), each the best of three passes.

``--part warm``: one shard's start-up in a fresh process, snapshot load and kernel warm-up, with
numba's cache empty and then filled (:func:`warm_start`).

``--part grpc-floor``: a ``grpc.aio`` server whose ``Retrieve`` returns a prebuilt 10-hit
response (900-character texts): what the gRPC round trip alone costs here (p50, server and
client CPU per call).

Queries: chunk vectors of the snapshot perturbed by Gaussian noise (sigma 0.05 per
coordinate, renormalised), with four fixed English questions as the BM25 text. Needs psutil
(bench extra) for ``threads``.

    python -m bench.hotpath_parts --data-dir bench/out/retrieval-data --part threads,phases,grpc-floor --json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import emit_json, log, machine_info, percentile, read_snapshot, require

TEXTS = ["effects of vitamin D on bone density in older adults", "protein folding and the role of chaperones",
         "the history of the roman empire", "insulin resistance and type 2 diabetes risk"]


def _m(sp) -> tuple:
    """The BM25 top-m of a default hybrid request (``max(4 * top_k, 64)``) as the request's last
    argument; none for a tree without it."""
    return (64,) if "m" in getattr(sp.protocol.SearchRequest, "__dataclass_fields__", {}) else ()


def _queries(V: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = V[rng.integers(0, len(V), n)] + rng.normal(0, 0.05, (n, V.shape[1])).astype(np.float32)
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def _thread_cpu(pid: int) -> dict[tuple[str, str], float]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{t}/stat").read()
        except FileNotFoundError:
            continue
        f = st[st.rindex(")") + 2:].split()
        out[(t, st[st.index("(") + 1:st.rindex(")")])] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out


def threads(a, V: np.ndarray) -> dict:
    """CPU ms per request by process and thread name (threads under 0.01 ms left out)."""
    import psutil
    from oprag_client.client import OpRAGClient, query_request
    from oprag_client.testing import ServerProcess

    srv = ServerProcess.on_free_ports(a.data_dir, "--generator", "none", "--shards", "2", *a.server_arg).start()
    try:
        pids = {"frontend": srv.proc.pid} | {f"shard process {i}": p.pid for i, p in
                                             enumerate(psutil.Process(srv.proc.pid).children(recursive=True))}
        Q = _queries(V, a.queries)
        with OpRAGClient(srv.target) as c:
            reqs = [query_request(TEXTS[i % 4], top_k=10, mode=a.mode, query_vector=q.tolist()) for i, q in enumerate(Q)]
            for r in reqs[:50]:
                c.stub.Retrieve(r)
            before = {k: _thread_cpu(p) for k, p in pids.items()}
            lat = []
            for r in reqs:
                t = time.perf_counter()
                c.stub.Retrieve(r)
                lat.append((time.perf_counter() - t) * 1000)
            after = {k: _thread_cpu(p) for k, p in pids.items()}
    finally:
        srv.stop()
    rows: dict[str, float] = collections.Counter()
    for k in after:
        for (tid, name), v in after[k].items():
            ms = (v - before[k].get((tid, name), 0.0)) / len(reqs) * 1000
            if ms >= 0.01:
                rows[f"{k}: {name}"] += round(ms, 3)
    return {"mode": a.mode, "cpu_ms_per_request": dict(rows), "total_cpu_ms": round(sum(rows.values()), 3),
            "p50_ms": round(percentile(lat, 50), 2), "load": round(os.getloadavg()[0], 2)}


def phases(a, V: np.ndarray) -> dict:
    """One shard's hybrid search in process, CPU ms per query by phase."""
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    import faiss

    faiss.omp_set_num_threads(1)
    try:  # numpy's BLAS was loaded before the variables above were set: limit it now
        from threadpoolctl import threadpool_limits
        threadpool_limits(1)
    except ImportError:
        log("threadpoolctl missing: run with OPENBLAS_NUM_THREADS=1 for single-threaded BLAS")
    sp = _internals.shard_plane()
    st = _load_shard(sp, a.data_dir, 0, V.shape[1])
    acc: collections.Counter = collections.Counter()
    depth = [0]

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name, None)
        if f is None:  # a tree without that step
            return

        def timed(*args, **kw):
            if depth[0]:
                return f(*args, **kw)
            depth[0] += 1
            t = time.thread_time_ns()
            try:
                return f(*args, **kw)
            finally:
                acc[label] += time.thread_time_ns() - t
                depth[0] -= 1
        setattr(obj, name, timed)

    wrap(st.store.dense, "search", "dense top-n (FAISS)")
    wrap(st.search, "_refine", "canonical refine of the top-n")
    wrap(st.search, "_kernel_tops", "dense top-n: BLAS scan + compiled refine and sample minimum")
    wrap(st.search, "_dense_min_estimate", "dense-minimum estimate (sample)")
    wrap(st.store.postings, "score", "BM25 of the candidates")
    wrap(sp.search, "skyband", "k-skyband")
    wrap(st.search, "_fields", "stored fields of the skyband")
    wrap(st.store, "ids", "chunk ids")
    wrap(st.search, "_lexical_top", "BM25 top-m list (with its canonical dense scores)")
    wrap(st.search, "_skyband_slots", "k-skyband")
    an = _internals.analyzer()
    Q = _queries(st.store.dense.vectors, a.queries, seed=1)
    reqs = []
    for i, q in enumerate(Q):
        terms = an.tokens(TEXTS[i % 4])
        batch = sp.protocol.QueryBatch(q[None], [terms], [np.ones(len(terms))], 80.0, 1.5, 0.75, None)
        reqs.append(sp.protocol.SearchRequest(batch, "hybrid", 256, 0, 0, 10, *_m(sp)))
    for r in reqs[:50]:
        st.search.search(r)
    acc.clear()
    tot = pk = up = size = 0
    for r in reqs:
        t = time.thread_time_ns()
        rep = st.search.search(r)
        tot += time.thread_time_ns() - t
        t = time.thread_time_ns()
        b = pickle.dumps((1, True, rep), protocol=pickle.HIGHEST_PROTOCOL)
        pk += time.thread_time_ns() - t
        t = time.thread_time_ns()
        pickle.loads(b)
        up += time.thread_time_ns() - t
        size += len(b)
    n = len(reqs)
    parts = {k: round(v / n / 1e6, 3) for k, v in acc.most_common()}
    parts["rest (glue)"] = round((tot - sum(acc.values())) / n / 1e6, 3)
    return {"chunks": len(st.store.dense), "search_cpu_ms": round(tot / n / 1e6, 3), "parts_ms": parts,
            "reply_bytes": size // n, "pickle_ms": round(pk / n / 1e6, 3), "unpickle_ms": round(up / n / 1e6, 3),
            "load": round(os.getloadavg()[0], 2)}


def _load_shard(sp, data_dir: Path, i: int, dim: int):
    """Shard ``i``'s snapshot loaded in this process (from a copy: loading may write)."""
    tmp = Path(tempfile.mkdtemp())
    try:
        shutil.copytree(data_dir / f"shard-{i}", tmp / f"shard-{i}")
        st = sp.ShardState(i, dim, tmp)
        st.load()
        return st
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def merge(a, V: np.ndarray) -> dict:
    """The frontend's CPU per hybrid query on two shards' real replies (no transport)."""
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    sp = _internals.shard_plane()
    merge_fn, collect, spec_cls = _internals.retrieve_merge()
    shards = [_load_shard(sp, a.data_dir, i, V.shape[1]) for i in (0, 1)]
    an, spec = _internals.analyzer(), spec_cls(mode="hybrid", top_k=10, candidates=256)
    blobs = []
    for i, q in enumerate(_queries(V, a.queries, seed=1)):
        terms = an.tokens(TEXTS[i % 4])
        r = sp.protocol.SearchRequest(sp.protocol.QueryBatch(q[None], [terms], [np.ones(len(terms))], 80.0, 1.5,
                                                             0.75, None), "hybrid", 256, 0, 0, 10, *_m(sp))
        blobs.append([pickle.dumps((1, True, st.search.search(r)), protocol=pickle.HIGHEST_PROTOCOL) for st in shards])
    replies = [{s: pickle.loads(b)[2] for s, b in enumerate(bl)} for bl in blobs]

    def best(f) -> float:
        runs = []
        for _ in range(3):
            t = time.thread_time_ns()
            for i in range(len(blobs)):
                f(i)
            runs.append((time.thread_time_ns() - t) / len(blobs) / 1e3)
        return round(min(runs), 1)

    return {"unpickle_two_replies_us": best(lambda i: [pickle.loads(b) for b in blobs[i]]),
            "collect_and_merge_us": best(lambda i: (collect({}, replies[i], "fields"),
                                                    merge_fn(replies[i], 0, spec))),
            "load": round(os.getloadavg()[0], 2)}


def _floor_server(port: int, ready) -> None:  # a spawned process
    import grpc
    from oprag.v1 import oprag_pb2, oprag_pb2_grpc

    resp = oprag_pb2.RetrieveResponse(hits=[oprag_pb2.Hit(chunk_id=f"c{i}", doc_id="d", text="x" * 900, score=1.0)
                                            for i in range(10)])

    class Servicer(oprag_pb2_grpc.OpRAGServicer):
        async def Retrieve(self, request, context):  # noqa: N802 - the gRPC method name
            return resp

    async def main() -> None:
        s = grpc.aio.server()
        oprag_pb2_grpc.add_OpRAGServicer_to_server(Servicer(), s)
        s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start()
        ready.set()
        await s.wait_for_termination()

    asyncio.run(main())


def grpc_floor(a) -> dict:
    """p50 and CPU per call of a Retrieve answered with a prebuilt response."""
    import grpc
    from oprag.v1 import oprag_pb2, oprag_pb2_grpc
    from oprag_client.testing import free_port

    ctx = mp.get_context("spawn")
    port, ready = free_port(), ctx.Event()
    p = ctx.Process(target=_floor_server, args=(port, ready), daemon=True)
    p.start()
    try:
        ready.wait(60)
        stub = oprag_pb2_grpc.OpRAGStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        req = oprag_pb2.QueryRequest(question=TEXTS[0], query_vector=[0.05] * 384, top_k=10)
        for _ in range(200):
            stub.Retrieve(req)
        s0, c0, lat = _proc_cpu(p.pid), time.process_time(), []
        for _ in range(a.queries):
            t = time.perf_counter()
            stub.Retrieve(req)
            lat.append((time.perf_counter() - t) * 1000)
        n = a.queries
        return {"p50_ms": round(percentile(lat, 50), 3), "server_cpu_ms": round((_proc_cpu(p.pid) - s0) / n * 1000, 3),
                "client_cpu_ms": round((time.process_time() - c0) / n * 1000, 3), "load": round(os.getloadavg()[0], 2)}
    finally:
        p.terminate()
        p.join(10)


_WARM = """import sys, time
t0, c0 = time.perf_counter(), time.process_time()
from pathlib import Path
from bench import _internals
from bench.hotpath_parts import _load_shard
st = _load_shard(_internals.shard_plane(), Path(sys.argv[1]), 0, int(sys.argv[2]))
t1, c1 = time.perf_counter(), time.process_time()
warm = getattr(st.search, "warm", None)
if warm is not None:
    warm()
t2, c2 = time.perf_counter(), time.process_time()
print(round(t1 - t0, 3), round(c1 - c0, 3), round(t2 - t1, 3), round(c2 - c1, 3))
"""


def warm_start(a, V: np.ndarray) -> dict:
    """Shard start-up in a fresh process (imports + snapshot load, then ``Searcher.warm``, the
    compiled kernels of a tree that has them), wall / CPU s: once with numba's cache emptied
    (a temporary ``NUMBA_CACHE_DIR``: the first start after an install), then twice from it."""
    import subprocess
    import sys

    out = []
    with tempfile.TemporaryDirectory() as cache:
        for run in ("cold", "cached", "cached"):
            r = subprocess.run([sys.executable, "-c", _WARM, str(a.data_dir), str(V.shape[1])], check=True,
                               capture_output=True, text=True, env={**os.environ, "NUMBA_CACHE_DIR": cache})
            w = [float(x) for x in r.stdout.split()[-4:]]
            out.append({"run": run, "load_s": w[0], "load_cpu_s": w[1], "warm_s": w[2], "warm_cpu_s": w[3],
                        "loadavg": round(os.getloadavg()[0], 2)})
    return {"starts": out}


def _proc_cpu(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a data dir holding a 2-shard corpus")
    ap.add_argument("--part", default="threads,phases,grpc-floor")
    ap.add_argument("--mode", default="hybrid", help="threads: the retrieval mode")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--server-arg", action="append", default=[], help="threads: an extra server argument (repeatable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    parts = a.part.split(",")
    if "threads" in parts:
        require("psutil", what="the per-thread CPU of the server tree")
    V = read_snapshot(a.data_dir)["vectors"]
    out: dict = {"machine": machine_info(), "chunks": len(V)}
    for name, fn in (("threads", lambda: threads(a, V)), ("phases", lambda: phases(a, V)),
                     ("merge", lambda: merge(a, V)), ("grpc-floor", lambda: grpc_floor(a)),
                     ("warm", lambda: warm_start(a, V))):
        if name in parts:
            out[name] = fn()
            log(f"{name}: {out[name]}")
    if a.json:
        emit_json(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
