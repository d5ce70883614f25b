"""Retrieve latency on a data dir that is already built (for example ``bench.scale``'s 1M one),
one mode per pass: the server is started on a copy-free ``--data-dir`` (it is written to only
by the snapshot at stop), SciFact train queries are sent with their MiniLM vectors, c = 1, and
each pass reports client p50/p95 and the server's ``timings_ms`` medians. The last pass
interleaves hybrid with full_hybrid per query, as ``bench.scale`` does, to show what the exact
mode's full scans do to the next hybrid query's caches.

    python -m bench.serve_passes --data-dir bench/out/scale-1000000-hnsw --dense-index hnsw --json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import _internals
from ._common import DEFAULT_SHARED, OUT, emit_json, load_queries_qrels, log, machine_info, percentile, start_server


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a built data dir (served, then snapshotted at stop)")
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--queries", type=int, default=100, help="first N judged SciFact train queries")
    ap.add_argument("--passes", type=int, default=3, help="hybrid-only passes (the first is reported as warm-up)")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_client.client import OpRAGClient, query_request

    judged, _ = load_queries_qrels(a.shared, "train")
    texts = [judged[x] for x in list(judged)[: a.queries]]
    vecs = _internals.encoder("minilm", device="cpu").encode(texts, truncate=True)
    out: dict = {"data_dir": str(a.data_dir), "queries": len(texts), "passes": [], "machine": machine_info()}
    srv = start_server(a.data_dir, "--generator", "none", "--shards", str(a.shards), "--dense-index", a.dense_index,
                       "--monitor-fraction", "0", *a.server_arg, log_path=OUT / "serve-passes.log")
    try:
        with OpRAGClient(srv.target, timeout=600) as c:
            def one(text, v, mode, tim):
                t = time.perf_counter()
                r = c.stub.Retrieve(query_request(text, top_k=10, mode=mode, query_vector=v.tolist()))
                for k, x in r.timings_ms.items():
                    tim.setdefault(k, []).append(x)
                return (time.perf_counter() - t) * 1e3

            plans = [("warmup" if p == 0 else f"pass{p}", ("hybrid",)) for p in range(a.passes)]
            plans.append(("interleaved", ("hybrid", "full_hybrid")))
            for label, modes in plans:
                lat: dict[str, list[float]] = {m: [] for m in modes}
                tim: dict[str, list[float]] = {}
                for text, v in zip(texts, vecs):
                    for mode in modes:
                        lat[mode].append(one(text, v, mode, tim if mode == "hybrid" else {}))
                row = {"label": label, "hybrid_p50_ms": round(percentile(lat["hybrid"], 50), 2),
                       "hybrid_p95_ms": round(percentile(lat["hybrid"], 95), 2),
                       "server_timings_p50_ms": {k: round(percentile(x, 50), 2) for k, x in tim.items()}}
                if "full_hybrid" in lat:
                    row["full_p50_ms"] = round(percentile(lat["full_hybrid"], 50), 2)
                out["passes"].append(row)
                log(str(row))
    finally:
        srv.stop()
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
