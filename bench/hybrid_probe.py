"""Dense-first hybrid vs exact ``full_hybrid`` by ANN knob, in process (issue 13): every shard of
a data dir that ``bench.scale`` left is loaded read-only from its snapshot, the frontend's
``Retriever`` runs over them in this process (``bench._internals.in_process_retriever``: the
same merge, threshold bound and widening as a server, no transport), and queries (MiniLM
vectors) are retrieved in hybrid and full_hybrid mode, top_k 10: SciFact train queries, or
those of the other generators of :func:`bench._common.probe_texts` (``--query-source``: WikiText
and SciFact sentences, keyword queries), so the recall figure does not rest on one query set.

Per (query source, ``ef_search`` / ``nprobe``, N): Recall@10 of hybrid vs full_hybrid, how often the dense minimum the
shards reported equals exact mode's, the shares certified and widened, the one-sided widening
rounds, and the thread CPU ms of one hybrid Retrieve (all shards searched one after the other
on this thread: the sum of the shards' work plus the merge, not a served latency).

    python -m bench.hybrid_probe --data-dir bench/out/scale-1000000-hnsw --ef-search 512,256 --n 256,128 --json
    python -m bench.hybrid_probe --data-dir bench/out/scale-1000000-hnsw --query-source scifact,wikitext,terms --json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import QUERY_SOURCES, emit_json, log, machine_info, percentile, probe_texts, shard_probe_args


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shard_probe_args(ap, queries=100, shards=True)
    ap.add_argument("--ef-search", default="0", help="comma-separated (0: the index default)")
    ap.add_argument("--nprobe", default="0", help="comma-separated IVF lists probed (0: the index default)")
    ap.add_argument("--n", default="256", help="comma-separated dense-first windows N (candidates)")
    ap.add_argument("--either", default="", help="comma-separated hybrid.EITHER values to compare (a tree with it)")
    ap.add_argument("--query-source", default="scifact",
                    help=f"comma-separated query generators ({', '.join(QUERY_SOURCES)}; bench._common.probe_texts)")
    ap.add_argument("--ann-check", type=int, default=None,
                    help="the server's --ann-check (HNSW list check sample; 0: off; default: the server's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    _internals.one_thread()
    sources = a.query_source.split(",")
    queries = {}
    for src in sources:
        texts = probe_texts(src, a.queries, a.shared)
        cache = a.vectors if src == "scifact" else ""  # (the cache file holds the SciFact queries' vectors)
        queries[src] = (texts, _internals.query_vectors(texts, cache))
    t0 = time.perf_counter()
    dense = {} if a.ann_check is None else {"ann_check": a.ann_check}
    r, Spec, states = _internals.in_process_retriever(a.data_dir, a.shards, a.dense_index, dense)
    for st in states:
        st.search.warm()
    log(f"loaded {a.shards} shards ({sum(len(s.store.dense) for s in states)} chunks) in {time.perf_counter() - t0:.1f} s")
    asked: list[tuple[int, int]] = []
    hyb = _internals.hybrid_module()
    wid = hyb.Widening
    real = wid.next_round

    def spy(self, req):
        got = real(self, req)
        if got is not None:
            asked.append((got[1].n, got[1].m))
        return got
    wid.next_round = spy
    exact = {}
    for src, (texts, vecs) in queries.items():
        exact[src] = []
        for v, text in zip(vecs, texts):
            hits, _, _ = asyncio.run(r.retrieve(v[None], [text], [Spec(mode="full_hybrid", top_k=10)]))
            exact[src].append({h.chunk_id for h in hits[0]})
    out = {"chunks": sum(len(s.store.dense) for s in states), "queries": a.queries, "runs": [],
           "machine": machine_info()}
    grid = [(src, ef, n, e, p) for src in sources for ef in a.ef_search.split(",") for n in a.n.split(",")
            for e in (a.either.split(",") if a.either else [""]) for p in a.nprobe.split(",")]
    for src, ef, n, either, nprobe in [(src, int(ef), int(n), e, int(p)) for src, ef, n, e, p in grid]:
        texts, vecs = queries[src]
        if either:
            hyb.EITHER = either
        spec = Spec(mode="hybrid", top_k=10, candidates=n, ef_search=ef, nprobe=nprobe)
        asked.clear()
        rec, cpu, cert, widened = [], [], [], []
        for v, text, want in zip(vecs, texts, exact[src]):
            t = time.thread_time_ns()
            hits, _, infos = asyncio.run(r.retrieve(v[None], [text], [spec]))
            cpu.append((time.thread_time_ns() - t) / 1e6)
            rec.append(len(want & {h.chunk_id for h in hits[0]}) / max(1, len(want)))
            cert.append(infos[0].certified)
            widened.append(infos[0].widen_rounds > 0)
        run = {"query_source": src, "queries": len(texts), "ef_search": ef, "nprobe": nprobe, "n": n, "either": either, "recall10_vs_exact": round(float(np.mean(rec)), 4),
               "certified_share": round(float(np.mean(cert)), 4), "widened_share": round(float(np.mean(widened)), 4),
               "rounds_both": sum(1 for x, y in asked if x and y), "rounds_bm25_only": sum(1 for x, _ in asked if not x),
               "rounds_dense_only": sum(1 for _, y in asked if not y),
               "cpu_p50_ms": round(percentile(cpu, 50), 3), "cpu_p95_ms": round(percentile(cpu, 95), 3),
               "cpu_mean_ms": round(float(np.mean(cpu)), 3), "load": round(os.getloadavg()[0], 2)}
        out["runs"].append(run)
        log(run)
    wid.next_round = real
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
