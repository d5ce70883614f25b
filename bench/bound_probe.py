"""Dense-first hybrid's threshold bound by ``--lexical-candidates`` M on an existing data dir
(for example one ``bench.scale`` left in ``bench/out/scale-<size>-<kind>``): per M, a server is
started on a copy of the data dir with ``--lexical-candidates M``, and SciFact train queries
(MiniLM vectors supplied) are retrieved in hybrid and full_hybrid mode, top_k 10. Reports per M
Recall@10 of hybrid vs full_hybrid, the share of hybrid queries whose top-k the bound certified,
the share widened, the mean widening rounds and hybrid Retrieve p50 / p95 (c = 1).

    python -m bench.bound_probe --data-dir bench/out/scale-100000-flat --m 16,64,256 --json
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import DEFAULT_SHARED, emit_json, load_queries_qrels, log, machine_info, percentile, start_server


def probe(data: Path, m: int, extra: list[str], q: dict) -> dict:
    from oprag_client.client import OpRAGClient, query_request

    with tempfile.TemporaryDirectory(dir=data.parent) as tmp:
        copy = Path(tmp) / "data"
        shutil.copytree(data, copy)
        srv = start_server(copy, "--generator", "none", "--monitor-fraction", "0", "--lexical-candidates", str(m),
                           *extra)
        try:
            with OpRAGClient(srv.target, timeout=600) as c:
                lat, rec, info = [], [], []
                for text, v in zip(q["texts"], q["vecs"]):
                    hyb = query_request(text, top_k=10, query_vector=v.tolist())
                    t = time.perf_counter()
                    r = c.stub.Retrieve(hyb)
                    lat.append((time.perf_counter() - t) * 1000)
                    ex = c.stub.Retrieve(query_request(text, top_k=10, mode="full_hybrid", query_vector=v.tolist()))
                    want = {h.chunk_id for h in ex.hits}
                    rec.append(len(want & {h.chunk_id for h in r.hits}) / max(1, len(want)))
                    info.append((r.retrieval.certified, r.retrieval.widen_rounds))
        finally:
            srv.stop()
    return {"m": m, "recall10_vs_exact": round(float(np.mean(rec)), 4),
            "certified_share": round(float(np.mean([ce for ce, _ in info])), 4),
            "widened_share": round(float(np.mean([w > 0 for _, w in info])), 4),
            "mean_widen_rounds": round(float(np.mean([w for _, w in info])), 3),
            "retrieve_p50_ms": round(percentile(lat, 50), 2), "retrieve_p95_ms": round(percentile(lat, 95), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a served data dir (copied, not changed)")
    ap.add_argument("--m", default="16,64,256", help="comma-separated --lexical-candidates values")
    ap.add_argument("--queries", type=int, default=100, help="first N judged SciFact train queries")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    judged, _ = load_queries_qrels(a.shared, "train")
    qids = list(judged)[: a.queries]
    vecs = _internals.encoder("minilm", device="cpu").encode([judged[x] for x in qids], truncate=True)
    q = {"texts": [judged[x] for x in qids], "vecs": vecs}
    out = {"machine": machine_info(), "data_dir": str(a.data_dir), "runs": []}
    for m in [int(x) for x in a.m.split(",")]:
        out["runs"].append(probe(a.data_dir, m, a.server_arg, q))
        log(out["runs"][-1])
    if a.json:
        emit_json(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
