"""One shard's hybrid ``search`` at scale, in process, part by part (issue 13: the HNSW / IVF
round of a shard): shard ``--shard`` of a data dir that ``bench.scale`` left is loaded read-only
from its snapshot (``bench._internals.shard_state``), SciFact train queries are encoded with
MiniLM, their BM25 idf and average length are this shard's (rank_bm25's formula, epsilon 0.25,
as ``bench.topm_probe``), and each query runs one hybrid ``SearchRequest`` (N ``--n``,
``--ef-search``, fetch_k 10, BM25 top-M ``--m``; M 0 leaves the BM25 list out).

Reported per query, single-threaded (BLAS, FAISS): thread CPU ms of the whole ``search`` and
*exclusive* CPU ms of each wrapped part (a part's time excludes the wrapped parts it calls),
p50 / mean; the dense minimum the shard reports against the exact one (a full scan of the
shard's vectors, canonical near its lowest score): the share of queries where it is exact and
the mean gap; and the ANN's recall of the exact dense top-N (set overlap).

    python -m bench.shard_parts --data-dir bench/out/scale-100000-hnsw --queries 200 --json
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import emit_json, load_queries_qrels, log, machine_info, percentile, shard_probe_args

#: (object attribute path, method, label); objects: "st" ShardState, "dense", "postings", "mod"
PARTS = [
    ("search", "_dense_tops", "dense top-n (glue)"),
    ("dense", "search", "ANN search (FAISS) in {parent}"),
    ("search", "_refine", "canonical refine (glue)"),
    ("search", "_canonical", "canonical scores"),
    ("search", "_ann_lows", "dense minimum (glue)"),
    ("search", "_dense_min_estimate", "dense-minimum sample estimate"),
    ("postings", "score", "BM25 of the dense candidates"),
    ("search", "_lexical_top", "BM25 top-M (glue)"),
    ("mod", "listed_top", "BM25 top-M kernel (listed_top)"),
    ("search", "_skyband_slots", "k-skyband (glue)"),
    ("mod", "skyband", "k-skyband"),
    ("search", "_fields", "stored fields of the skyband"),
    ("store", "ids", "chunk ids"),
    ("mod", "top_k_order", "top_k_order"),
]


class _Timer:
    """Exclusive thread-CPU time per label of wrapped callables (nested calls subtracted)."""

    def __init__(self) -> None:
        self.acc: collections.Counter = collections.Counter()
        self.stack: list[list] = []

    def wrap(self, obj, name: str, label: str) -> None:
        f = getattr(obj, name, None)
        if f is None:
            return

        def timed(*args, **kw):
            lab = label.format(parent=self.stack[-1][1] if self.stack else "-") if "{" in label else label
            self.stack.append([0, lab])
            frame = self.stack[-1]
            t = time.thread_time_ns()
            try:
                return f(*args, **kw)
            finally:
                dt = time.thread_time_ns() - t
                self.stack.pop()
                self.acc[lab] += dt - frame[0]
                if self.stack:
                    self.stack[-1][0] += dt
        setattr(obj, name, timed)


def _queries(a, st) -> list[tuple]:
    """(vector float32[D], terms, idf float64[T]) of the first ``a.queries`` judged train queries."""
    judged, _ = load_queries_qrels(a.shared, "train")
    texts = list(judged.values())[: a.queries]
    vecs = _internals.query_vectors(texts, a.vectors)
    an, ix = _internals.analyzer(), st.store.postings
    query_idf, _ = _internals.shard_idf(ix)  # the server's floor (the query terms' mean is ~10x lower)
    out = []
    for text, v in zip(texts, vecs):
        terms = an.tokens(text)
        out.append((np.ascontiguousarray(v, np.float32), terms, query_idf(terms)))
    return out


def _request(sp, q: tuple, avgdl: float, mode: str = "hybrid", n: int = 256, ef: int = 0, m: int = 64):
    """The one-query SEARCH a frontend sends a shard for ``q`` (vector, terms, idf) of :func:`_queries`: BM25 k1 1.5,
    b 0.75, the shard's ``avgdl``, top_k 10; ``n`` dense candidates, ``ef`` the HNSW beam (0: the default), ``m`` the
    BM25 list."""
    v, terms, idf = q
    return sp.protocol.SearchRequest(sp.protocol.QueryBatch(v[None], [terms], [idf], avgdl, 1.5, 0.75, None), mode, n,
                                     ef, 0, 10, m)


def _exact(st, q: np.ndarray, n: int) -> tuple[float, set]:
    """The exact canonical dense minimum over the shard's live vectors and the exact top-n slots."""
    dense = st.store.dense
    approx = dense.score_all(q[None])[0]
    err = dense.score_error(q)
    slots = dense.slots
    near = np.flatnonzero(approx <= np.float64(approx.min()) + 2.0 * err)
    low = float(st.search._canonical(q, near).min())  # noqa: SLF001
    top = np.argpartition(-approx, n - 1)[:n]
    return low, set(slots[top].tolist())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shard_probe_args(ap, queries=200)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--m", default="64", help="comma-separated BM25 list lengths (0: none)")
    ap.add_argument("--ef-search", default="0", help="comma-separated (0: the index default)")
    ap.add_argument("--accuracy", action="store_true", help="also the dense minimum and ANN recall vs exact")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="sleep between queries (a served shard waits ~3-5 ms between them: caches go cold)")
    ap.add_argument("--warm-pass", action="store_true",
                    help="run every query once before the timed pass (as a served pass after the warm-up one: the "
                         "memory-mapped postings / fields pages the queries touch are mapped already)")
    ap.add_argument("--bare", action="store_true", help="no part timers (the whole search's time alone)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    _internals.one_thread()
    t0 = time.perf_counter()
    sp = _internals.shard_plane()
    st = _internals.shard_state(a.data_dir, a.shard, a.dense_index)
    log(f"loaded shard {a.shard} ({len(st.store.dense)} chunks) in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    st.search.warm()
    log(f"warm {time.perf_counter() - t0:.1f} s")
    qs = _queries(a, st)
    timer = _Timer()
    objs = {"search": st.search, "dense": st.store.dense, "postings": st.store.postings, "mod": sp.search,
            "store": st.store}
    for obj, name, label in ([] if a.bare else PARTS):
        timer.wrap(objs[obj], name, label)
    avgdl = _internals.shard_avgdl(st.store.postings)
    out = {"chunks": len(st.store.dense), "queries": len(qs), "n": a.n, "runs": [], "machine": machine_info()}
    for ef in [int(x) for x in a.ef_search.split(",")]:
        for m in [int(x) for x in a.m.split(",")]:
            reqs = [_request(sp, q, avgdl, "hybrid", a.n, ef, m) for q in qs]
            for r in (reqs if a.warm_pass else reqs[:10]):
                st.search.search(r)
            timer.acc.clear()
            tot, reps = [], []
            for r in reqs:
                if a.gap_ms:
                    time.sleep(a.gap_ms / 1e3)
                t = time.thread_time_ns()
                reps.append(st.search.search(r))
                tot.append((time.thread_time_ns() - t) / 1e6)
            k = len(reqs)
            run = {"ef_search": ef, "m": m, "gap_ms": a.gap_ms, "search_p50_ms": round(percentile(tot, 50), 3),
                   "search_p95_ms": round(percentile(tot, 95), 3), "search_mean_ms": round(float(np.mean(tot)), 3),
                   "parts_mean_ms": {lb: round(v / k / 1e6, 3) for lb, v in timer.acc.most_common()},
                   "knobs": st.store.dense.last_knobs}
            run["parts_mean_ms"]["rest"] = round(run["search_mean_ms"] - sum(run["parts_mean_ms"].values()), 3)
            if a.accuracy:
                hit, gap, rec = [], [], []
                for (v, _, _), rep in zip(qs, reps):
                    low, top = _exact(st, v, a.n)
                    got = float(rep.dense_min[0])
                    hit.append(got == low)
                    gap.append(got - low)
                    rec.append(len(top & set(np.asarray(rep.candidates[0].slots).tolist())) / max(1, len(top)))
                run |= {"dense_min_exact_share": round(float(np.mean(hit)), 4),
                        "dense_min_gap_mean": float(np.mean(gap)), "dense_min_gap_max": float(np.max(gap)),
                        "ann_recall_of_exact_top_n": round(float(np.mean(rec)), 4)}
            run["load"] = round(os.getloadavg()[0], 2)
            out["runs"].append(run)
            log(run)
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
