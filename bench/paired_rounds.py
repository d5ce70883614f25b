"""Paired A/B of served Retrieve latency on a noisy machine: every arm's server is up at once (each
on its own copy of ``--data-dir``) and short rounds of ``--per`` queries alternate among the arms
(order reversed every other round), so that a slow minute of the machine hits every arm alike.
Reported per arm: the median, min and max of the rounds' p50 (ms), the server's ``retrieve`` p50,
and each arm's median ratio to the first arm's round p50 (c = 1, top_k 10, query vector supplied).

An arm is ``TREE|SERVER ARGS|QOS[|DATA DIR]``: a source tree, extra ``oprag serve`` arguments, ``1`` to
have this client hold a CPU latency QoS request of 0 us (``/dev/cpu_dma_latency``, what ``oprag
serve --cpu-latency-us 0`` holds; root) during that arm's rounds only. The request is
machine-wide, so arms that differ by it must use this client-held form, not the server flag (a
server holding it would speed up every arm's rounds), and optionally the arm's own data dir instead of
``--data-dir`` (two index builds of one corpus).

Queries: ``bench.hotpath``'s (stored chunk vectors + noise, the chunk's first 200 characters as
text), or with ``--scifact`` the 809 judged SciFact train queries with their MiniLM vectors.

    python -m bench.paired_rounds --data-dir bench/out/retrieval-data --arm '.||0' --arm '.||1' --rounds 16
    python -m bench.paired_rounds --data-dir bench/out/retrieval-data --arm '.||1' --arm '.|--shard-workers thread|1'
    python -m bench.paired_rounds --data-dir bench/out/scale-1000000-hnsw --link --scifact --arm '<old tree>|--dense-index hnsw|0' --arm '.|--dense-index hnsw|0'
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ._common import DEFAULT_SHARED, emit_json, hotpath_queries, log, machine_info, percentile, probe_texts, read_snapshot


def scifact_queries(shared: Path, path: Path | None) -> tuple[list[str], np.ndarray]:
    """The 809 SciFact train query texts and their MiniLM vectors float32[809, 384]: from the
    ``.npz`` ``path`` (keys ``texts``, ``vectors``) when it exists, else computed (``../shared``
    and the embedder) and saved there when ``path`` is given."""
    if path is not None and path.exists():
        z = np.load(path)
        return [str(t) for t in z["texts"]], z["vectors"].astype(np.float32)
    from . import _internals

    texts = probe_texts("scifact", 809, shared)
    Q = _internals.query_vectors(texts, "")
    if path is not None:
        np.savez(path, texts=np.array(texts), vectors=Q)
    return texts, Q


def _copy(src: Path, dst: Path, link: bool) -> None:
    """``src`` copied to ``dst``; with ``link`` the files inside ``snap-*`` directories hard-linked instead."""
    if not link:
        shutil.copytree(src, dst)
        return
    for root, _, files in os.walk(src):
        r = Path(root)
        out = dst / r.relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        snap = any(part.startswith("snap-") for part in r.relative_to(src).parts)
        for f in files:
            (os.link if snap else shutil.copy2)(r / f, out / f)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--arm", action="append", required=True, help="TREE|SERVER ARGS|QOS (repeatable)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--per", type=int, default=100, help="queries per arm per round")
    ap.add_argument("--mode", default="hybrid")
    ap.add_argument("--scifact", action="store_true", help="SciFact train queries instead of perturbed chunks")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--queries-file", type=Path, default=None,
                    help="with --scifact: an .npz of the query texts and vectors, read when it exists (no "
                         "../shared or embedder needed), else written there (for a machine without them)")
    ap.add_argument("--work", type=Path, default=Path("bench/out/paired"), help="where the data dir copies go")
    ap.add_argument("--link", action="store_true",
                    help="hard-link the snapshot files into each arm's copy (one page cache for every arm: two plain "
                         "copies of a 1M data dir, 5 GB each, thrashed this machine's page cache at 40-68 ms a query); "
                         "snapshots are never written in place, and the rest (logs, CURRENT) is copied")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_client.client import OpRAGClient, query_request
    from oprag_client.testing import ServerProcess
    from oprag_server.cpu_latency import hold, release

    total = a.rounds * a.per
    if a.scifact:
        texts, Q = scifact_queries(a.shared, a.queries_file)
        reps = total // len(texts) + 1
        texts, Q = (texts * reps)[:total], np.concatenate([Q] * reps)[:total]
    else:
        Q, texts = hotpath_queries(read_snapshot(a.data_dir), total)
    reqs = [query_request(t, top_k=10, mode=a.mode, query_vector=q.tolist()) for t, q in zip(texts, Q)]
    arms = [tuple((x.split("|") + [""])[:4]) for x in a.arm]
    srvs, clients = [], []
    p50 = {x: [] for x in a.arm}
    ret = {x: [] for x in a.arm}
    try:
        for i, (tree, args, _, data) in enumerate(arms):
            d = a.work / f"arm{i}"
            shutil.rmtree(d, ignore_errors=True)
            _copy(Path(data) if data else a.data_dir, d, a.link)
            env = {"PYTHONPATH": f"{tree}/server:{tree}/client:{tree}"}
            srvs.append(ServerProcess.on_free_ports(d, "--generator", "none", "--shards", "2", *args.split(), env=env).start())
            clients.append(OpRAGClient(srvs[-1].target).__enter__())
        for c in clients:
            for r in reqs[:30]:
                c.stub.Retrieve(r)
        for rd in range(a.rounds):
            part = reqs[rd * a.per:(rd + 1) * a.per]
            for i in (range(len(arms)) if rd % 2 == 0 else reversed(range(len(arms)))):
                req = hold(0 if arms[i][2] == "1" else -1)
                lat, sv = [], []
                try:
                    for r in part:
                        t = time.perf_counter()
                        rep = clients[i].stub.Retrieve(r)
                        lat.append((time.perf_counter() - t) * 1000)
                        sv.append(rep.timings_ms.get("retrieve", 0.0))
                finally:
                    release(req)
                p50[a.arm[i]].append(percentile(lat, 50))
                ret[a.arm[i]].append(percentile(sv, 50))
            log(f"round {rd}: " + " ".join(f"{p50[x][-1]:.2f}" for x in a.arm) + f" (load {os.getloadavg()[0]:.2f})")
    finally:
        for c in clients:
            c.__exit__(None, None, None)
        for s in srvs:
            s.stop()
    base = np.array(p50[a.arm[0]])
    out = {"arms": [], "rounds": a.rounds, "per": a.per, "mode": a.mode, "scifact": a.scifact, "machine": machine_info()}
    for x in a.arm:
        v = np.array(p50[x])
        row = {"arm": x, "p50_ms_median": round(float(np.median(v)), 2), "p50_ms_min": round(float(v.min()), 2),
               "p50_ms_max": round(float(v.max()), 2), "server_retrieve_p50_ms": round(float(np.median(ret[x])), 2),
               "ratio_to_first": round(float(np.median(v / base)), 3), "round_p50s": [round(float(y), 2) for y in v]}
        out["arms"].append(row)
        log(row)
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
