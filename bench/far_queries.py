"""HYBRID against FULL_HYBRID for queries far from every chunk, on a mid-size HNSW corpus, served
(session 50; trial46 #8: far-off HYBRID queries at 40K chunks took 75-137 ms p50, FULL_HYBRID
11-24 ms, as the ANN check widened their beams to 2,048 and 8,192 on 20K-vector shards).

Corpus (seeded, made here): ``--chunks`` one-chunk documents with supplied vectors, 200 Gaussian
clusters in 384 dimensions (vector = normalise(centre + e), e ~ N(0, 0.7^2 / D I): cosine to its
unit centre ~0.82), each text 6-18 words of its cluster's own 30-word vocabulary plus 2-5 of 50 shared
words. Query rules (``--queries`` each, query vectors supplied):

* ``near``: a cluster centre plus noise, with 2-4 of that cluster's words;
* ``between``: the normalised sum of two chunks' vectors from different clusters, a word of each;
* ``far``: a random direction, with 3 words no chunk holds;
* ``far_words``: a random direction, with 2 of the shared words.

``--trees`` serves each given source tree (``PYTHONPATH=<tree>/server:<tree>/client``) on its
own data dir with the same corpus, all at once, and alternates rounds of each rule between them
(the order reversed every other round), so that a slow minute of this shared machine slows
every tree alike. Reported per tree and rule: HYBRID and FULL_HYBRID client p50 / p95 ms (each
the median over rounds of the round's percentile), HYBRID Recall@10 of FULL_HYBRID's chunk ids,
the share of HYBRID replies whose ids and scores equal FULL_HYBRID's, and the widest
``retrieval.ef_search`` reported.

    python -m bench.far_queries --chunks 40000 --trees /tmp/base,. --rounds 4 --json
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ._common import emit_json, log, machine_info, percentile, start_server

OUT = Path(__file__).resolve().parent / "out"
D, CLUSTERS, SHARED_WORDS = 384, 200, 50


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def corpus(n: int, seed: int = 46):
    """``(texts, float32[n, D] vectors, cluster of each chunk, centres, vocab)``."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((CLUSTERS, D)))
    vocab = [[f"c{c}w{j}" for j in range(30)] for c in range(CLUSTERS)]
    shared = [f"s{j}" for j in range(SHARED_WORDS)]
    cl = rng.integers(CLUSTERS, size=n)
    vecs = _unit(centres[cl] + 0.7 * rng.standard_normal((n, D)).astype(np.float32) / np.sqrt(D))
    texts = [" ".join([*rng.choice(vocab[c], size=int(rng.integers(6, 19))),
                       *rng.choice(shared, size=int(rng.integers(2, 6)))]) for c in cl]
    return texts, vecs, cl, centres, vocab, shared


def queries(rule: str, k: int, vecs, cl, centres, vocab, shared, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        if rule == "near":
            c = int(rng.integers(CLUSTERS))
            v = _unit(centres[c] + 0.3 * rng.standard_normal(D).astype(np.float32) / np.sqrt(D))
            t = " ".join(rng.choice(vocab[c], size=int(rng.integers(2, 5))))
        elif rule == "between":
            a, b = rng.integers(len(vecs), size=2)
            while cl[a] == cl[b]:
                b = rng.integers(len(vecs))
            v = _unit(vecs[a] + vecs[b])
            t = f"{rng.choice(vocab[cl[a]])} {rng.choice(vocab[cl[b]])}"
        elif rule == "far":
            v, t = _unit(rng.standard_normal(D)), " ".join(f"zq{int(x)}x" for x in rng.integers(10**6, size=3))
        else:  # far_words
            v, t = _unit(rng.standard_normal(D)), " ".join(rng.choice(shared, size=2))
        out.append((t, v))
    return out


RULES = ("near", "between", "far", "far_words")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=40000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--queries", type=int, default=30, help="queries per rule")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--trees", default=".", help="comma-separated source trees to serve side by side")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_client.client import Doc, OpRAGClient

    texts, vecs, cl, centres, vocab, shared = corpus(a.chunks)
    qs = {r: queries(r, a.queries, vecs, cl, centres, vocab, shared, 100 + i) for i, r in enumerate(RULES)}
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    srvs, clients = [], []
    res: dict = {"machine": machine_info(), "chunks": a.chunks, "shards": a.shards, "trees": {}}
    lat: dict = {}  # (tree, "h" | "e", rule) -> [(round p50, round p95)]
    try:
        for ti, tree in enumerate(trees):
            data = OUT / f"far-queries-{ti}"
            shutil.rmtree(data, ignore_errors=True)
            env = {**os.environ, "PYTHONPATH": f"{tree}/server:{tree}/client"}
            srvs.append(start_server(data, "--generator", "none", "--shards", str(a.shards), "--dense-index", "hnsw",
                                     "--monitor-fraction", "0", log_path=OUT / f"far-queries-{ti}.log", env=env))
            c = OpRAGClient(srvs[-1].target, timeout=600).__enter__()
            clients.append(c)
            t = time.perf_counter()
            for s in range(0, a.chunks, 5000):
                c.ingest([Doc(f"d{i:07d}", texts[i], vector=vecs[i]) for i in range(s, min(a.chunks, s + 5000))])
            while any(sh.ann_pending or sh.merge_pending or sh.seeds_pending for sh in c.stats().shards):
                time.sleep(0.5)  # (graph inserts, BM25 merges and the dense minimum's seeds, all settled)
            log(f"tree {tree}: {a.chunks} chunks in, graphs and seeds built, {time.perf_counter() - t:.1f} s")
        for c in clients:  # warm-up
            for r in RULES:
                for t, v in qs[r][:3]:
                    c.retrieve(t, query_vector=v.tolist(), top_k=10)
        same = {(ti, r): [] for ti in range(len(trees)) for r in RULES}
        ef = {(ti, r): 0 for ti in range(len(trees)) for r in RULES}
        for rd in range(a.rounds):
            order = range(len(trees)) if rd % 2 == 0 else reversed(range(len(trees)))
            for ti in order:
                c = clients[ti]
                for r in RULES:
                    hy, ex = [], []
                    for t, v in qs[r]:
                        t0 = time.perf_counter()
                        h = c.retrieve(t, query_vector=v.tolist(), top_k=10)
                        t1 = time.perf_counter()
                        e = c.retrieve(t, query_vector=v.tolist(), top_k=10, mode="full_hybrid")
                        t2 = time.perf_counter()
                        hy.append((t1 - t0) * 1e3)
                        ex.append((t2 - t1) * 1e3)
                        if rd == 0:
                            hi, ei = [x.chunk_id for x in h.hits], [x.chunk_id for x in e.hits]
                            same[(ti, r)].append((len(set(hi) & set(ei)) / max(1, len(ei)),
                                                  [(x.chunk_id, x.score) for x in h.hits] ==
                                                  [(x.chunk_id, x.score) for x in e.hits]))
                            ef[(ti, r)] = max(ef[(ti, r)], h.retrieval.ef_search)
                    lat[(ti, "h", r)] = lat.get((ti, "h", r), []) + [(percentile(hy, 50), percentile(hy, 95))]
                    lat[(ti, "e", r)] = lat.get((ti, "e", r), []) + [(percentile(ex, 50), percentile(ex, 95))]
                log(f"round {rd} tree {ti}: " + ", ".join(
                    f"{r} {lat[(ti, 'h', r)][-1][0]:.1f}/{lat[(ti, 'e', r)][-1][0]:.1f}" for r in RULES))
        for ti, tree in enumerate(trees):
            out = {}
            for r in RULES:
                h, e = np.array(lat[(ti, "h", r)]), np.array(lat[(ti, "e", r)])
                out[r] = {"hybrid_p50_ms": round(float(np.median(h[:, 0])), 2),
                          "hybrid_p95_ms": round(float(np.median(h[:, 1])), 2),
                          "full_p50_ms": round(float(np.median(e[:, 0])), 2),
                          "full_p95_ms": round(float(np.median(e[:, 1])), 2),
                          "recall10_vs_exact": round(float(np.mean([s[0] for s in same[(ti, r)]])), 4),
                          "identical_share": round(float(np.mean([s[1] for s in same[(ti, r)]])), 4),
                          "widest_ef_search": int(ef[(ti, r)])}
                log(f"{tree} {r}: hybrid p50 {out[r]['hybrid_p50_ms']} / p95 {out[r]['hybrid_p95_ms']} ms, full_hybrid "
                    f"p50 {out[r]['full_p50_ms']} ms, Recall@10 {out[r]['recall10_vs_exact']}, identical "
                    f"{out[r]['identical_share']}, widest ef_search {out[r]['widest_ef_search']}")
            res["trees"][str(tree)] = out
    finally:
        for c in clients:
            c.__exit__(None, None, None)
        for s in srvs:
            s.stop()
    if a.json:
        emit_json(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
