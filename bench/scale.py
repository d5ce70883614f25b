"""How cost grows with corpus size (issue 13; a first version: sizes are run one by one, each on
its own data dir, with supplied vectors so no chunk is embedded by the server).

Corpus of size S: every real chunk of a finished ``bench.retrieval`` data dir (SciFact +
WikiText-2 valid, with their MiniLM vectors, read from its snapshot; ``--source``) as
bring-your-own-vector documents (``Doc(chunks=...)``), plus S - real derived one-chunk
distractor documents. Derived chunk i (seeded): base real chunk ``b = rng.integers(real)``;
text = the sentences of b and of a second random real chunk, shuffled (real vocabulary and its
distribution, no new words); vector = normalise(v_b + e), e ~ N(0, sigma^2 I) with sigma =
``--sigma`` / sqrt(D) (cosine to v_b about 1 / sqrt(1 + sigma^2)), so the derived vectors keep
the real vectors' cluster structure. Never uniform random vectors.

Per size (and ``--dense-index``): ingest rate with supplied vectors, Retrieve p50/p95 of hybrid
and full_hybrid (SciFact train queries, MiniLM query vectors sent as ``query_vector``),
Recall@10 of hybrid vs full_hybrid, SciFact nDCG@10 (documents ranked by their best chunk),
RSS of the server process tree (after the queries, and again after the restart: the latter
without what ingest left allocated), the shards' bytes by component (``Stats``), snapshot bytes,
restart-to-READY seconds, and the seconds spent deriving the corpus and in the whole size.

    python -m bench.scale --source bench/out/retrieval-data --sizes 20000,100000 --json
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import (DEFAULT_SHARED, OUT, emit_json, load_queries_qrels, log, machine_info, percentile,
                      read_snapshot, require, start_server)


def derived(snap: dict, n: int, sigma: float, seed: int = 13) -> tuple[list[str], np.ndarray]:
    """``n`` derived chunk texts and unit float32[n, D] vectors (see the module docstring)."""
    rng = np.random.default_rng(seed)
    V, texts = snap["vectors"], snap["text"]
    base = rng.integers(0, len(texts), n)
    other = rng.integers(0, len(texts), n)
    out = []
    for b, o in zip(base.tolist(), other.tolist()):
        sents = [s for s in re.split(r"(?<=[.!?])\s+", texts[b] + " " + texts[o]) if s.strip()]
        rng.shuffle(sents)
        out.append(" ".join(sents))
    vec = V[base] + rng.standard_normal((n, V.shape[1])).astype(np.float32) * (sigma / np.sqrt(V.shape[1]))
    return out, (vec / np.linalg.norm(vec, axis=1, keepdims=True)).astype(np.float32)


def tree_rss(pid: int) -> int:
    import psutil

    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def run_size(a, size: int, kind: str, snap: dict, q) -> dict:
    from oprag_client.client import Doc, OpRAGClient, query_request
    from oprag_client.evaluate import ndcg_at_k

    real = len(snap["text"])
    by_doc: dict[str, list[int]] = {}
    for i, d in enumerate(snap["doc_id"]):
        by_doc.setdefault(d, []).append(i)
    docs = [Doc(d, title=snap["title"][rows[0]], chunks=[(snap["text"][r], snap["vectors"][r]) for r in rows])
            for d, rows in by_doc.items()]
    t_all = time.perf_counter()
    extra_t, extra_v = derived(snap, max(0, size - real), a.sigma)
    derive_s = time.perf_counter() - t_all
    docs += [Doc(f"syn:{i}", t, vector=v) for i, (t, v) in enumerate(zip(extra_t, extra_v))]
    data = OUT / f"scale-{size}-{kind}"
    shutil.rmtree(data, ignore_errors=True)
    args = ["--generator", "none", "--shards", str(a.shards), "--dense-index", kind, "--monitor-fraction", "0"]
    srv = start_server(data, *args, log_path=OUT / "scale-server.log")
    try:
        with OpRAGClient(srv.target, timeout=3600) as c:
            t = time.perf_counter()
            chunks = sum(c.ingest(docs[i:i + a.per_stream]).chunks_written for i in range(0, len(docs), a.per_stream))
            ingest_s = time.perf_counter() - t
            log(f"{size} {kind}: {chunks} chunks ingested in {ingest_s:.1f} s")
            lat: dict[str, list[float]] = {"hybrid": [], "full_hybrid": []}
            tops: dict[str, list[list[str]]] = {"hybrid": [], "full_hybrid": []}
            ndcg = []
            for text, v, qid in zip(q["texts"], q["vecs"], q["qids"]):
                for mode in lat:
                    req = query_request(text, top_k=10, mode=mode, query_vector=v.tolist())
                    t = time.perf_counter()
                    r = c.stub.Retrieve(req)
                    lat[mode].append((time.perf_counter() - t) * 1000)
                    tops[mode].append([h.chunk_id for h in r.hits])
                    if mode == "hybrid":
                        ranked = list(dict.fromkeys(h.doc_id for h in r.hits))
                        ndcg.append(ndcg_at_k(ranked, q["qrels"][qid], 10))
            rss = tree_rss(srv.proc.pid)
        srv.stop()
        snap_bytes = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
        t = time.perf_counter()
        srv.start()
        restart_s = time.perf_counter() - t
        rss_restarted = tree_rss(srv.proc.pid)  # served from the snapshot: no ingest buffers
        with OpRAGClient(srv.target) as c:
            comp: dict[str, int] = {}
            for sh in c.stats().shards:
                for k in ("postings_bytes", "terms_bytes", "vectors_bytes", "ann_bytes", "chunks_bytes"):
                    comp[k] = comp.get(k, 0) + int(getattr(sh, k, 0))
    finally:
        srv.stop()
    recall = [len(set(h) & set(f)) / max(1, len(f)) for h, f in zip(tops["hybrid"], tops["full_hybrid"])]
    return {"chunks": chunks, "dense_index": kind,
            "retrieve_p50_ms": round(percentile(lat["hybrid"], 50), 2),
            "retrieve_p95_ms": round(percentile(lat["hybrid"], 95), 2),
            "full_p50_ms": round(percentile(lat["full_hybrid"], 50), 2),
            "recall10_vs_exact": round(float(np.mean(recall)), 4),
            "ndcg10_scifact": round(float(np.mean(ndcg)), 4),
            "rss_bytes": rss, "bytes_per_chunk": round(rss / max(chunks, 1)),
            "snapshot_bytes": snap_bytes, "ingest_chunks_per_s": round(chunks / ingest_s),
            "restart_s": round(restart_s, 2), "rss_after_restart_bytes": rss_restarted,
            "shard_bytes_by_component": comp, "derive_s": round(derive_s, 1),
            "wall_s": round(time.perf_counter() - t_all, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=OUT / "retrieval-data",
                    help="data dir of a finished bench.retrieval run (real chunks and vectors)")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--sizes", default="20000,100000,1000000")
    ap.add_argument("--dense-index", default="flat,hnsw", help="comma-separated dense index kinds")
    ap.add_argument("--queries", type=int, default=200, help="first N judged SciFact train queries")
    ap.add_argument("--sigma", type=float, default=0.5, help="noise of derived vectors (see module docstring)")
    ap.add_argument("--per-stream", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    require("psutil", what="the RSS measurement")
    snap = read_snapshot(a.source)
    judged, qrels = load_queries_qrels(a.shared, "train")
    qids = list(judged)[: a.queries]
    vecs = _internals.encoder("minilm", device="cpu").encode([judged[x] for x in qids], truncate=True)
    q = {"qids": qids, "texts": [judged[x] for x in qids], "vecs": vecs, "qrels": qrels}
    result: dict = {"machine": machine_info(), "sizes": {}}
    for kind in a.dense_index.split(","):
        for size in [int(s) for s in a.sizes.split(",")]:
            result["sizes"][f"{size}/{kind}"] = run_size(a, size, kind, snap, q)
            log(result["sizes"][f"{size}/{kind}"])
        ks = [k for k in result["sizes"] if k.endswith(f"/{kind}")]
        if len(ks) > 1:
            lo, hi = result["sizes"][ks[0]], result["sizes"][ks[-1]]
            result[f"p50_growth_{kind}"] = round(hi["retrieve_p50_ms"] / lo["retrieve_p50_ms"], 2)
    if a.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
