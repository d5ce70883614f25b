"""Retrieve latency on a data dir that is already built (for example ``bench.scale``'s 1M one),
one mode per pass: the server is started on a copy-free ``--data-dir`` (it is written to only
by the snapshot at stop), SciFact train queries (or another generator's, ``--query-source``:
:func:`bench._common.probe_texts`) are sent with their MiniLM vectors, c = 1, and each pass
reports client p50/p95 and the server's ``timings_ms`` medians. The last pass interleaves
hybrid with full_hybrid per query, as ``bench.scale`` does, to show what the exact mode's full
scans do to the next hybrid query's caches; it also gives the served hybrid hits' Recall@10 vs
the exact ones.

    python -m bench.serve_passes --data-dir bench/out/scale-1000000-hnsw --dense-index hnsw --json

``--ingest N`` then adds N derived one-chunk documents with supplied vectors (``bench.scale``'s
derivation from ``--source``, other seed and ids ``more:<i>``), times a hybrid pass at once
(``after_ingest``) and two more after ``--settle`` seconds (``settled1/2``), before the
interleaved pass: the same server before an ingest, straight after it (its shards' BM25 deltas,
deferred HNSW inserts) and a while later. The data dir is
changed by it (copy it first). Every pass records its wall-clock start and end (``t0``, ``t1``:
to line up with the server log's timestamped merges and snapshots) and, at its start, the shards'
``ann_pending`` and ``merge_pending`` summed (Stats; ``--wait-settled`` also waits after the
settling time until both are 0, ``settle_wait_s``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from . import _internals
from ._common import DEFAULT_SHARED, OUT, QUERY_SOURCES, emit_json, log, machine_info, percentile, probe_texts, start_server


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a built data dir (served, then snapshotted at stop)")
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--queries", type=int, default=100, help="first N judged SciFact train queries (or N of --query-source)")
    ap.add_argument("--query-source", default="scifact", choices=QUERY_SOURCES,
                    help="query generator (bench._common.probe_texts): SciFact queries, WikiText / SciFact sentences, keywords")
    ap.add_argument("--passes", type=int, default=3, help="hybrid-only passes (the first is reported as warm-up)")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    ap.add_argument("--ingest", type=int, default=0, help="derived chunks to ingest before the passes")
    ap.add_argument("--source", type=Path, default=Path("bench/out/retrieval-data"),
                    help="bench.retrieval data dir whose chunks --ingest derives from (bench.scale's --source)")
    ap.add_argument("--settle", type=float, default=30.0, help="seconds between the after_ingest pass and the others")
    ap.add_argument("--wait-settled", action="store_true",
                    help="after --settle, also wait until no shard has deferred HNSW inserts or a BM25 merge pending")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_client.client import OpRAGClient, query_request

    texts = probe_texts(a.query_source, a.queries, a.shared)
    vecs = _internals.encoder("minilm", device="cpu").encode(texts, truncate=True)
    out: dict = {"data_dir": str(a.data_dir), "query_source": a.query_source, "queries": len(texts), "passes": [], "machine": machine_info()}
    srv = start_server(a.data_dir, "--generator", "none", "--shards", str(a.shards), "--dense-index", a.dense_index,
                       "--monitor-fraction", "0", *a.server_arg, log_path=OUT / "serve-passes.log")
    try:
        with OpRAGClient(srv.target, timeout=600) as c:
            def one(text, v, mode, tim, ids):
                t = time.perf_counter()
                r = c.stub.Retrieve(query_request(text, top_k=10, mode=mode, query_vector=v.tolist()))
                for k, x in r.timings_ms.items():
                    tim.setdefault(k, []).append(x)
                ids.append({h.chunk_id for h in r.hits})
                return (time.perf_counter() - t) * 1e3

            plans = [("warmup" if p == 0 else f"pass{p}", ("hybrid",)) for p in range(a.passes)]
            if a.ingest:  # the passes before, the ingest, a pass at once, the settling time, two passes
                plans += [("ingest", ()), ("after_ingest", ("hybrid",)), ("settle", ()),
                                ("settled1", ("hybrid",)), ("settled2", ("hybrid",))]
            plans.append(("interleaved", ("hybrid", "full_hybrid")))
            for label, modes in plans:
                if label == "settle":
                    time.sleep(a.settle)
                    if a.wait_settled:
                        out["settle_wait_s"] = round(_settled(c), 1)
                    continue
                if label == "ingest":
                    out["ingest"] = _ingest(c, a)
                    log(str(out["ingest"]))
                    continue
                lat: dict[str, list[float]] = {m: [] for m in modes}
                got: dict[str, list[set]] = {m: [] for m in modes}
                tim: dict[str, list[float]] = {}
                t0, pending = time.strftime("%H:%M:%S"), _pending(c)
                cpu0 = _tree_cpu(srv)
                nreq = len(texts) * len(modes)
                slow = []  # hybrid queries over SLOW_MS: when (to line up with the server log) and how long
                for text, v in zip(texts, vecs):
                    for mode in modes:
                        lat[mode].append(one(text, v, mode, tim if mode == "hybrid" else {}, got[mode]))
                        if mode == "hybrid" and lat[mode][-1] > SLOW_MS:
                            slow.append((time.strftime("%H:%M:%S"), round(lat[mode][-1])))
                row = {"label": label, "t0": t0, "t1": time.strftime("%H:%M:%S"), **pending,
                       "hybrid_p50_ms": round(percentile(lat["hybrid"], 50), 2),
                       "hybrid_p95_ms": round(percentile(lat["hybrid"], 95), 2),
                       "server_timings_p50_ms": {k: round(percentile(x, 50), 2) for k, x in tim.items()},
                       # the server process tree's CPU (frontend + shards) per request of the pass
                       "server_cpu_ms_per_request": round((sum(cpu1 := _tree_cpu(srv)) - sum(cpu0)) * 1e3 / nreq, 2),
                       # frontend first, then its children (shards, by pid)
                       "process_cpu_ms_per_request": [round((b - a) * 1e3 / nreq, 2) for a, b in zip(cpu0, cpu1)],
                       "load": round(os.getloadavg()[0], 2)}
                if slow:
                    row["slow"] = slow
                if "full_hybrid" in lat:
                    row["full_p50_ms"] = round(percentile(lat["full_hybrid"], 50), 2)
                    # Recall@10 of the served hybrid hits vs the served exact ones, per query
                    row["recall10_vs_exact"] = round(sum(len(h & e) / max(1, len(e)) for h, e in
                                                         zip(got["hybrid"], got["full_hybrid"])) / max(1, len(texts)), 4)
                out["passes"].append(row)
                log(str(row))
    finally:
        srv.stop()
    if a.json:
        emit_json(out)
    return out


#: a hybrid query slower than this is listed with its end time in its pass's row (``slow``)
SLOW_MS = 250.0


def _tree_cpu(srv) -> list[float]:
    """User + system CPU seconds so far of the server process, then of its children (shards) by pid."""
    import psutil

    root = psutil.Process(srv.proc.pid)
    procs = [root, *sorted(root.children(recursive=True), key=lambda p: p.pid)]
    return [p.cpu_times().user + p.cpu_times().system for p in procs]


def _pending(c) -> dict:
    """The shards' deferred HNSW inserts and pending BM25 merge postings, summed (Stats)."""
    sh = c.stats().shards
    return {k: sum(int(getattr(s, k, 0)) for s in sh) for k in ("ann_pending", "merge_pending")}


def _settled(c, poll_s: float = 0.5, limit_s: float = 600.0) -> float:
    """Seconds until :func:`_pending` is all 0 (at most ``limit_s``)."""
    t = time.perf_counter()
    while any(_pending(c).values()) and time.perf_counter() - t < limit_s:
        time.sleep(poll_s)
    return time.perf_counter() - t


def _ingest(c, a) -> dict:
    """Ingest ``a.ingest`` derived one-chunk documents (supplied vectors) in streams of 2,000."""
    from oprag_client.client import Doc

    from ._common import read_snapshot
    from .scale import derived

    t, n, t0 = time.perf_counter(), 0, time.strftime("%H:%M:%S")
    for texts, vecs in derived(read_snapshot(a.source), a.ingest, 0.5, seed=29):
        n += c.ingest([Doc(f"more:{n + i}", x, vector=v) for i, (x, v) in enumerate(zip(texts, vecs))]).chunks_written
    el = time.perf_counter() - t
    return {"chunks": n, "ingest_s": round(el, 1), "chunks_per_s": round(n / el), "t0": t0, "t1": time.strftime("%H:%M:%S")}


if __name__ == "__main__":
    main()
