"""Retrieve latency while the shards write their periodic snapshots (issue 13, snap14).

A server on a copy of a data dir of ``--size`` chunks (built once with ``bench.scale``'s corpus:
the real chunks of ``--source`` plus derived ones, supplied vectors; kept under
``bench/out/snapstall-<size>-<kind>`` and reused) takes a steady trickle of ingest (``--docs``
one-chunk documents every ``--every`` s, so the frontend's snapshot loop finds writes and
snapshots every ~30 s) while one client sends hybrid Retrieve calls back to back
(``bench._common.hotpath_queries``: stored vectors plus noise, sent as ``query_vector``). The
shards log when each snapshot was written and how long it took (``shard i: snapshot written in
X s``); a query that overlaps such a window is counted as *during* a snapshot. Reported per
server tree: Retrieve p50 / p99 / max overall, during and outside snapshots, the snapshots'
times, the ingest calls' max latency.

``--trees name=PATH,...`` runs the server of each tree (``PYTHONPATH=PATH/server:...``, from
PATH) in turn, ``--rounds`` times (ABAB), each on a fresh copy of the data dir::

    python -m bench.snapshot_stall --size 100000 --trees new=.,base=/work/wt/snap14-base --json

``--shard-workers thread`` serves the shards on threads of the server (snap15).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ._common import (DEFAULT_SHARED, OUT, emit_json, hotpath_queries, log, machine_info, percentile, read_snapshot,
                      start_server)

_SNAP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) shard (\d+): snapshot written in ([\d.]+) s")
#: a snapshot's share of the shard's request loop (snap15's log line) and an idle merge's install
_LOOP = re.compile(r"ms of it on the request loop: start (\d+), merge install (\d+), adopt (\d+)"
                   r"(?:; of the merge install: (\d+) polls (\d+), longest other step ([\d.]+))?")
_SWAP = re.compile(r"BM25 merge installed: build ([\d.]+) s, swap ([\d.]+) ms")


def loop_shares(lines: list[str]) -> dict:
    """Per snapshot ``[start, merge install, adopt]`` ms on the shards' request loops (and, where
    the shard logs them, ``polls`` (count), their ms and the longest other step's ms before the
    writer starts: the install's), and the install ("swap") ms of every BM25 merge a shard logged."""
    snaps = [[float(x) for x in m.groups() if x is not None] for line in lines for m in _LOOP.finditer(line)]
    swaps = [float(m.group(2)) for line in lines for m in _SWAP.finditer(line)]
    return {"snapshot_loop_ms": snaps, "merge_swap_ms": swaps}


def _args(a, kind: str, workers: str = "process") -> list[str]:
    return ["--generator", "none", "--shards", str(a.shards), "--dense-index", kind, "--monitor-fraction", "0",
            "--shard-workers", workers]


def build(a, snap: dict, data: Path) -> None:
    """The data dir of ``a.size`` chunks (bench.scale's corpus), snapshotted by a clean stop."""
    from oprag_client.client import OpRAGClient

    from .scale import _batches, _caught_up, _docs

    shutil.rmtree(data, ignore_errors=True)
    srv = start_server(data, *_args(a, a.dense_index), log_path=OUT / "snapstall-build.log")
    try:
        with OpRAGClient(srv.target, timeout=3600) as c:
            t, n = time.perf_counter(), 0
            sa = SimpleNamespace(sigma=0.5, per_stream=2000)
            for batch in _batches(_docs(sa, a.size, snap, {"derive_s": 0.0}), 2000):
                n += c.ingest(batch).chunks_written
            log(f"built {n} chunks in {time.perf_counter() - t:.0f} s; index caught up {_caught_up(c):.0f} s later")
    finally:
        srv.stop(600)


def windows(lines: list[str]) -> list[tuple[int, float, float]]:
    """``(shard, start, end)`` (epoch seconds) of every snapshot the server's output reports."""
    out = []
    for line in lines:  # (two shard threads' lines may share one: snap15's thread shards)
        for m in _SNAP.finditer(line):
            end = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            out.append((int(m.group(3)), end - float(m.group(4)), end))
    return out


def _stats(ms: list[float]) -> dict:
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2),
            "max_ms": round(max(ms), 1)}


def run_once(a, tree: Path, base: Path, Q: np.ndarray, texts: list[str], snap: dict) -> dict:
    from oprag_client.client import Doc, OpRAGClient, query_request
    from oprag_client.testing import ServerProcess

    from .scale import derived

    data = OUT / "snapstall-run"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(base, data)
    env = {"PYTHONPATH": f"{tree}/server:{tree}/client:{tree}"}
    srv = ServerProcess.on_free_ports(data, *_args(a, a.dense_index, a.shard_workers), log_path=OUT / "snapstall-server.log", env=env,
                                      cwd=tree).start(600)
    lat: list[tuple[float, float]] = []  # (start epoch s, ms)
    ing: list[float] = []
    stop = threading.Event()
    try:
        with OpRAGClient(srv.target, timeout=600) as c:
            reqs = [query_request(t, top_k=10, mode="hybrid", query_vector=v.tolist()) for t, v in zip(texts, Q)]
            for r in reqs[:20]:
                c.stub.Retrieve(r)

            def ingest():
                blocks, i = derived(snap, 10**9, 0.5, seed=99, block=a.docs), 0
                while not stop.is_set():
                    texts_b, vecs = next(blocks)
                    docs = [Doc(f"trickle:{i + j}", t, vector=v) for j, (t, v) in enumerate(zip(texts_b, vecs))]
                    i += len(docs)
                    t0 = time.perf_counter()
                    c.ingest(docs)
                    ing.append((time.perf_counter() - t0) * 1000)
                    stop.wait(a.every)

            th = threading.Thread(target=ingest, daemon=True)
            th.start()
            t_end, k = time.time() + a.duration, 0
            while time.time() < t_end:
                r = reqs[k % len(reqs)]
                k += 1
                t0, p0 = time.time(), time.perf_counter()
                c.stub.Retrieve(r)
                lat.append((t0, (time.perf_counter() - p0) * 1000))
            stop.set()
            th.join(120)
    finally:
        stop.set()
        lines = list(srv.lines)
        srv.stop(600)
    wins = windows(lines)
    during = [ms for t, ms in lat if any(s <= t + ms / 1000 and t <= e for _, s, e in wins)]
    outside = [ms for t, ms in lat if not any(s <= t + ms / 1000 and t <= e for _, s, e in wins)]
    t0 = lat[0][0] if lat else 0.0
    slowest = sorted(lat, key=lambda x: -x[1])[:5]
    return {"tree": str(tree), "load_after": os.getloadavg()[0],
            "slowest": [(round(t - t0, 2), round(ms, 1)) for t, ms in slowest],
            "windows": [(sh, round(s - t0, 2), round(e - t0, 2)) for sh, s, e in wins],
            "queries": _stats([ms for _, ms in lat]), "during_snapshot": _stats(during),
            "outside_snapshot": _stats(outside), "snapshots_s": [round(e - s, 2) for _, s, e in wins],
            "ingest_calls": len(ing), "ingest_max_ms": round(max(ing), 1) if ing else None,
            "ingest_p50_ms": round(percentile(ing, 50), 1) if ing else None, **loop_shares(lines)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=Path("/work/main/bench/out/retrieval-data"),
                    help="data dir of a finished bench.retrieval run (real chunks and vectors)")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--shard-workers", default="process", choices=("process", "thread"),
                    help="the served shards: processes or threads of the server (the build uses processes)")
    ap.add_argument("--data", type=Path, default=None, help="the base data dir (built when it has no snapshot)")
    ap.add_argument("--trees", default="new=.", help="name=PATH,...: server trees to compare")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--duration", type=float, default=70.0, help="seconds of queries per run (~2 snapshots)")
    ap.add_argument("--docs", type=int, default=20, help="documents per trickle ingest call")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between trickle ingest calls")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    snap = read_snapshot(a.source)
    base = a.data or OUT / f"snapstall-{a.size}-{a.dense_index}"
    if not (base / "shard-0" / "CURRENT").exists():
        build(a, snap, base)
    Q, texts = hotpath_queries(snap, a.queries)
    trees = [(n, Path(p).resolve()) for n, p in (x.split("=", 1) for x in a.trees.split(","))]
    result: dict = {"machine": machine_info(), "size": a.size, "dense_index": a.dense_index,
                    "shard_workers": a.shard_workers, "runs": []}
    for rnd in range(a.rounds):
        for name, tree in trees:
            load = os.getloadavg()[0]
            res = run_once(a, tree, base, Q, texts, snap)
            res.update(name=name, round=rnd, load_before=load)
            log(res)
            result["runs"].append(res)
    shutil.rmtree(OUT / "snapstall-run", ignore_errors=True)
    if a.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
