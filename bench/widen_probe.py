"""A shard's cost of a dense-first widening round at scale, in process (issue 13, widen15):
shard ``--shard`` of a ``bench.scale`` data dir loaded read-only from its snapshot
(``bench._internals.shard_state``), SciFact train queries with their MiniLM vectors, this shard's
idf (as ``bench.shard_parts``). Per query, as a served shard sees a widened one: the round-1
hybrid ``SearchRequest`` (N ``--n``, fetch_k 10, BM25 top-M ``--m``), then the BM25-only widening
round of ``Widening.next_round`` (N 0, M ``4 x --m``), then the round-1 request again (the
shard's widening cache, ``index/bm25/listed_cache.py`` where the tree has it, dropped before
each round 1: a query's first sight, as a served pass over more queries than it keeps). Reported:
thread-CPU ms p50 / mean / p95 of each (``--reps`` per query, the minimum kept). ``--dump`` pickles
each widening reply's BM25 list (slots, scores, dense scores, ids), listed count and fields'
slots, to compare two trees' replies. Run it with ``PYTHONPATH=<tree>/server:<tree>/client:<this
tree>`` to measure another tree's server code.

    python -m bench.widen_probe --data-dir bench/out/d1m --queries 100 --vectors q100.npy --json
"""

from __future__ import annotations

import argparse
import os
import pickle
import time

import numpy as np

from . import _internals
from ._common import emit_json, load_queries_qrels, log, machine_info, percentile, shard_probe_args


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shard_probe_args(ap, queries=100)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dump", default="", help="pickle the widening replies' BM25 lists here (old vs new)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sp, st = _internals.probe_shard(a)
    judged, _ = load_queries_qrels(a.shared, "train")
    texts = list(judged.values())[: a.queries]
    vecs = _internals.query_vectors(texts, a.vectors)
    an, ix = _internals.analyzer(), st.store.postings
    query_idf, _ = _internals.shard_idf(ix)
    avgdl = _internals.shard_avgdl(ix)
    P = sp.protocol

    def req(v, terms, n, m):
        return P.SearchRequest(P.QueryBatch(v[None], [terms], [query_idf(terms)], avgdl, 1.5, 0.75, None),
                               "hybrid", n, 0, 0, 10, m)

    t1, tw, t1b, dump = [], [], [], []
    for text, v in zip(texts, vecs):
        terms = an.tokens(text)
        v = np.ascontiguousarray(v, np.float32)
        r1, rw = req(v, terms, a.n, a.m), req(v, terms, 0, 4 * a.m)
        b1 = bw = b1b = np.inf
        for _ in range(a.reps):
            ix.__dict__.pop("_listed_cache", None)  # each round 1 a first sight of the query (a miss)
            t = time.thread_time_ns()
            st.search.search(r1)
            b1 = min(b1, time.thread_time_ns() - t)
            t = time.thread_time_ns()
            rep = st.search.search(rw)
            bw = min(bw, time.thread_time_ns() - t)
            ix.__dict__.pop("_listed_cache", None)
            t = time.thread_time_ns()
            st.search.search(r1)
            b1b = min(b1b, time.thread_time_ns() - t)
        t1.append(b1 / 1e6)
        tw.append(bw / 1e6)
        t1b.append(b1b / 1e6)
        lx = rep.lexical[0]
        dump.append((np.asarray(lx.slots).tolist(), np.asarray(lx.lexical).tobytes(), np.asarray(lx.dense).tobytes(),
                     list(lx.chunk_ids), rep.listed[0], [f.slots for f in rep.fields] if rep.fields else None))
    out = {"chunks": len(st.store.dense), "queries": len(texts), "n": a.n, "m": a.m, "machine": machine_info(),
           "load": round(os.getloadavg()[0], 2)}
    for lab, xs in (("round1", t1), ("widening", tw), ("round1_again", t1b)):
        out[lab] = {"p50_ms": round(percentile(xs, 50), 3), "mean_ms": round(float(np.mean(xs)), 3),
                    "p95_ms": round(percentile(xs, 95), 3)}
    if a.dump:
        with open(a.dump, "wb") as f:
            pickle.dump(dump, f)
    log(out)
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
