"""What a shard's BM25 delta (the postings of writes since its last merge) costs a hybrid query,
by its size (issue 13, settle11: the threshold of the idle merge). In process, single-threaded:
shard ``--shard`` of a ``bench.scale`` data dir is loaded from its snapshot (read-only,
``bench._internals.shard_state``); derived chunks (``bench.scale``'s derivation from ``--source``,
seed 29, as ``bench.serve_passes --ingest``) are added to its postings alone (new slots above the
store's, no merge) until the delta holds each ``--shares`` fraction of the segment's postings; at
each step the BM25 work of a hybrid query is timed (thread CPU per query, SciFact train queries,
this shard's idf as ``bench.shard_parts``): the top-M kernel (``listed_top``, M 64) plus the BM25
of the query's dense top-``--n`` candidates (taken once from the loaded shard), in a first pass
(the delta's per-term lists built on first use) and a second (cached, as a server's later
queries of the same terms), then once more after merging it (the first pass rebuilds the wide
rows of the new segment).

    python -m bench.delta_cost --data-dir bench/out/scale-1000000-hnsw --shares 0.03125,0.0625,0.125,0.25 --json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import emit_json, log, machine_info, percentile, read_snapshot, shard_probe_args


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shard_probe_args(ap, queries=100)
    ap.add_argument("--source", type=Path, default=Path("bench/out/retrieval-data"))
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--shares", default="0.03125,0.0625,0.125,0.25")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_server.index.bm25.listed_top import listed_top

    from .scale import derived
    from .shard_parts import _queries

    sp, st = _internals.probe_shard(a)
    ix = st.store.postings
    ix.MERGE_DIV = 10**9  # this bench merges when it says so
    qs = _queries(a, st)
    avgdl = _internals.shard_avgdl(ix)
    cands = []
    for v, terms, idf in qs:
        rep = st.search.search(sp.protocol.SearchRequest(sp.protocol.QueryBatch(v[None], [terms], [idf], avgdl, 1.5,
                                                                                  0.75, None), "hybrid", a.n, 0, 0, 0, 0))
        cands.append(np.asarray(rep.candidates[0].slots, np.int64))

    def one_pass() -> list[float]:
        out = []
        for (_, terms, idf), c in zip(qs, cands):
            t = time.thread_time_ns()
            ix.score(c, terms, idf, avgdl, 1.5, 0.75)
            listed_top(ix, terms, idf, avgdl, 1.5, 0.75, 64)
            out.append((time.thread_time_ns() - t) / 1e6)
        return out

    def point(label: str) -> dict:
        first, second = one_pass(), one_pass()
        row = {"label": label, "delta_postings": int(ix._delta.n), "segment_postings": int(ix.segment.n_postings),  # noqa: SLF001
               "first_p50_ms": round(percentile(first, 50), 3), "first_mean_ms": round(float(np.mean(first)), 3),
               "cached_p50_ms": round(percentile(second, 50), 3), "cached_mean_ms": round(float(np.mean(second)), 3),
               "load": round(os.getloadavg()[0], 2)}
        log(row)
        return row

    out = {"chunks": len(ix), "queries": len(qs), "points": [point("loaded")], "machine": machine_info()}
    seg_p = ix.segment.n_postings
    an, slot = st.store.analyzer, int(st.store.next_slot)
    blocks = derived(read_snapshot(a.source), 10**7, 0.5, seed=29)
    for share in [float(x) for x in a.shares.split(",")]:
        while ix._delta.n < share * seg_p:  # noqa: SLF001
            texts, _ = next(blocks)
            toks = [an.tokens(x) for x in texts]
            ix.add_batch(list(range(slot, slot + len(toks))), toks)
            slot += len(toks)
        ix.drain_delta()
        out["points"].append(point(f"delta {share:g}"))
    t = time.perf_counter()
    ix.merge()
    out["merge_s"] = round(time.perf_counter() - t, 2)
    out["points"].append(point("merged"))
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
