"""The BM25 top-m of one shard (dense-first hybrid's BM25 list): the wide-term path
(:mod:`oprag_server.index.kernels_wide`, the server's default), MaxScore alone and reading every
query term's list, in process on a data dir that ``bench.scale`` left
(``bench/out/scale-<size>-<kind>``): shard 0 is loaded from its snapshot, SciFact queries are
analysed, idf is rank_bm25's formula with this shard's document frequencies (epsilon 0.25: a
negative idf becomes 0.25 x the average idf over the shard's whole vocabulary, as the server's
``CorpusStats.query_idf`` does over the corpus; until 2026-12-01 this probe averaged over the
query's own terms, a floor ~10x lower that let the pruning skip the stop words), and
each path runs over all the queries in its own pass (so one path's reads do not warm the
caches for the other); their top-m must agree (asserted), the pruned path's time is reported
next to the full one's.

    python -m bench.topm_probe --data-dir bench/out/scale-1000000-hnsw --dense-index hnsw --m 64,16 --json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


from . import _internals
from ._common import DEFAULT_SHARED, emit_json, log, machine_info, percentile, scifact_dir


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--m", default="64")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    lt, st = _internals.bm25_top_m(a.data_dir, a.dense_index)
    ix = st.store.postings
    log(f"loaded shard 0 ({len(ix)} chunks) in {time.perf_counter() - t0:.1f} s")
    an = _internals.analyzer()
    with open(scifact_dir(a.shared) / "queries.jsonl") as f:
        texts = [json.loads(line)["text"] for line in f][: a.queries]
    n = len(ix)
    avgdl = _internals.shard_avgdl(ix)
    query_idf, avg_idf = _internals.shard_idf(ix)
    queries = []
    for text in texts:
        terms = an.tokens(text)
        if not terms:
            continue
        idf = query_idf(terms)  # rank_bm25's epsilon floor over the vocabulary
        queries.append((terms, idf))
    lt.listed_top(ix, queries[0][0], queries[0][1], avgdl, 1.5, 0.75, 1)  # compile / warm
    out = {"chunks": n, "queries": len(queries), "average_idf": round(avg_idf, 3), "by_m": {}, "machine": machine_info()}
    log(f"average idf {avg_idf:.3f}: idf floor {0.25 * avg_idf:.3f}")
    for m in [int(x) for x in a.m.split(",")]:
        # one pass per path: interleaving them per query let the full path's reads of the
        # common terms' lists warm the caches for the pruned path's probes (4.5 ms p50 at 500K
        # chunks per shard that way, 11-13 ms in separate passes and in a served shard)
        paths = ("wide", "pruned", "full")
        ms: dict[str, list] = {p: [] for p in paths}
        got: dict[str, list] = {p: [] for p in paths}
        for path in paths:
            lt._PRUNE = path != "full"  # noqa: SLF001
            lt._WIDE = path == "wide"  # noqa: SLF001
            for terms, idf in queries:
                t = time.perf_counter()
                s, sc, _ = lt.listed_top(ix, terms, idf, avgdl, 1.5, 0.75, m)
                ms[path].append((time.perf_counter() - t) * 1e3)
                got[path].append(sorted(sc.tolist(), reverse=True)[:m])
        assert got["pruned"] == got["full"] == got["wide"], "the paths' top-m differ"
        lt._PRUNE = lt._WIDE = True  # noqa: SLF001
        out["by_m"][m] = {p: {"p50_ms": round(percentile(v[5:], 50), 3), "p95_ms": round(percentile(v[5:], 95), 3)}
                          for p, v in ms.items()}
        log(f"m {m}: {out['by_m'][m]}")
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
