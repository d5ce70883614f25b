"""Probe (issue 13, inst16): what installing a finished BM25 background merge costs the shard's
request loop at a large shard. In process, single shard, postings only: the ``postings``
directory of a ``bench.scale`` snapshot is loaded into memory (no map; ``--mmap``: mapped, as a shard's after a restart),
optionally tiled ``--tile`` times (copy k of every chunk at slot ``k * D + slot``: the same
vocabulary, ``--tile`` times the chunks and postings) to reach ~500K chunks per shard from the
100K corpus. Per round: ``--delta`` chunks are added (each a copy of a random segment chunk's
terms) and ``--remove`` segment chunks removed, a background merge is started, and while its
thread runs ``--during`` more chunks are added, ``--remove`` more segment chunks and ``5 * --remove``
frozen ones removed, and as many replaced (removed and added again at the same slot); then,
the merge thread done, the SciFact queries are run once (as a served shard's queries during the merge would), the merge
thread is joined and the install is timed on this thread, in parts:

* ``start``: ``merge(background=True)`` (what the loop does to start it);
* ``install``: ``poll_merge()`` (the install proper), with the previous segment kept alive (wall
  and this thread's CPU time);
* ``drop``: dropping the previous segment, its wide rows and term bounds (what the install or the
  first query after it frees on the loop, timed apart);
* ``first query extra``: SciFact train queries' BM25 top-64 (``listed_top_scored`` with the
  listed cache, as the searcher calls it) right after the install, less the same pass again:
  what is rebuilt lazily for the new segment (wide rows, term bounds, seg_len);
* ``loop``: start + install + drop + first query extra.

Queries are checked against ``score_all`` (the numpy reference) after every install.

    python -m bench.install_probe --postings <data dir>/shard-0/snap-*/postings --tile 10 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

from ._common import DEFAULT_SHARED, load_queries_qrels


def _tiled(ix_mod, d: Path, tile: int, mmap: bool = False):
    from oprag_server.index.bm25.merging import _SEG
    from oprag_server.index.bm25.segment import Segment

    seg = Segment.load(d, mmap=mmap and tile == 1)
    doc_len = np.load(d / "doc_len.npy")
    D, P, T = seg.doc_slots.size, seg.slots.size, len(seg.terms)
    if tile > 1:
        counts = np.diff(seg.offsets)
        offsets = np.zeros(T + 1, np.int64)
        np.cumsum(counts * tile, out=offsets[1:])
        # per term: its postings, copy 0, copy 1, ... (slots ascending within a term)
        tid = np.repeat(np.arange(T), counts)
        within = np.arange(P) - np.repeat(seg.offsets[:-1], counts)
        slots = np.empty(P * tile, np.int32)
        tf = np.empty(P * tile, seg.tf.dtype)
        for k in range(tile):
            pos = offsets[tid] + k * counts[tid] + within
            slots[pos] = seg.slots + k * D
            tf[pos] = seg.tf
        doc_len_t = np.tile(np.diff(seg.doc_off), tile)
        doc_off = np.zeros(D * tile + 1, np.int64)
        np.cumsum(doc_len_t, out=doc_off[1:])
        seg = Segment(seg.terms, offsets, slots, tf, np.arange(D * tile, dtype=np.int32), doc_off,
                      np.tile(seg.doc_terms, tile), seg.vocab)
        doc_len = np.tile(doc_len, tile)
    seg.check()
    n = seg.doc_slots.size
    ix = ix_mod.PostingsIndex()
    ix._grow(n - 1)
    ix._seg, ix._seg_df, ix._n_live, ix._total_len = seg, seg.df(), n, int(doc_len.sum())
    ix._live[:n] = True
    ix._where[:n] = _SEG
    ix._doc_len[:n] = doc_len
    return ix


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--postings", type=Path, required=True)
    ap.add_argument("--tile", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delta", type=int, default=10000)
    ap.add_argument("--during", type=int, default=2000)
    ap.add_argument("--remove", type=int, default=200)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--mmap", action="store_true", help="(--tile 1) the segment mapped from the files, as after a "
                    "restart: the first install replaces a mapped segment")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_server.index import bm25 as ix_mod
    from oprag_server.index.analyzer import Analyzer  # noqa: F401
    from oprag_server.index.bm25.listed_top import listed_top_scored

    from . import _internals

    t = time.perf_counter()
    ix = _tiled(ix_mod, a.postings, a.tile, a.mmap)
    ix.MERGE_DIV = 10**9
    print(f"built {len(ix)} chunks, {ix.segment.n_postings} postings, {len(ix.segment.terms)} terms "
          f"in {time.perf_counter() - t:.1f} s", flush=True)
    an = _internals.analyzer()
    judged, _ = load_queries_qrels(a.shared, "train")
    texts = list(judged.values())[: a.queries]
    qterms = [an.tokens(x) for x in texts]
    rng = np.random.default_rng(16)
    seg0 = ix.segment
    version = [0]

    def tokens_of(slot_pos: int) -> list[str]:
        s = seg0
        return [s.terms[t] for t in s.doc_terms[int(s.doc_off[slot_pos]):int(s.doc_off[slot_pos + 1])].tolist()]

    def qpass() -> tuple[np.ndarray, list]:
        version[0] += 1  # (no answer from the listed cache of a previous pass)
        idf_fn, _ = _internals.shard_idf(ix)
        avgdl = ix.total_len / max(len(ix), 1)
        out, times = [], []
        for terms in qterms:
            idf = idf_fn(terms)
            t0 = time.perf_counter()
            s, v, listed, _ = listed_top_scored(ix, terms, idf, avgdl, 1.5, 0.75, 64, cache_version=version[0])
            times.append(time.perf_counter() - t0)
            out.append((terms, idf, avgdl, s, v, listed))
        return np.asarray(times), out

    def check(res) -> None:
        for terms, idf, avgdl, s, v, listed in res:
            rs, rv = ix.score_all(terms, idf, avgdl)
            got = dict(zip(s.tolist(), v.tolist()))
            ref = dict(zip(rs.tolist(), rv.tolist()))
            assert all(ref.get(k, 0.0) == x for k, x in got.items()), "score differs from score_all"
            top = np.sort(rv[rv != 0.0])[::-1][:64]
            assert np.array_equal(np.sort(v)[::-1][: top.size], top), "top-64 differs from score_all's"

    from oprag_server.index import kernels_delta, kernels_exact, kernels_topm, kernels_wide, kernels_wide_keep

    for k in (kernels_delta, kernels_exact, kernels_topm, kernels_wide, kernels_wide_keep):  # as a shard's warm-up:
        k.warm()  # writable and read-only arrays (a merged segment's are writable, a mapped one's read-only)
    qpass()
    qpass()
    next_slot = [len(ix._live)]

    def add(n: int) -> None:
        pos = rng.integers(0, seg0.doc_slots.size, n)
        slots = list(range(next_slot[0], next_slot[0] + n))
        next_slot[0] += n
        ix.add_batch(slots, [tokens_of(int(p)) for p in pos])
        version[0] += 1

    def remove_some(code: int, n: int, readd: bool) -> int:
        from oprag_server.index.bm25.merging import _SEG  # noqa: F401

        cand = np.flatnonzero(ix._where == code)
        if not cand.size:
            return 0
        pick = rng.choice(cand, min(n, cand.size), replace=False)
        for s in pick.tolist():
            ix.remove(s)
            if readd:
                ix.add_batch([s], [tokens_of(int(rng.integers(0, seg0.doc_slots.size)))])
        version[0] += 1
        return int(pick.size)

    from oprag_server.index.bm25.merging import _FROZEN, _SEG

    rounds = []
    for r in range(a.rounds):
        add(a.delta)
        remove_some(_SEG, a.remove, False)
        gc.collect()
        t0 = time.perf_counter()
        ix.merge(background=True)
        start = time.perf_counter() - t0
        # writes while the merge runs
        add(a.during)
        remove_some(_SEG, a.remove, False)
        remove_some(_SEG, a.remove, True)
        remove_some(_FROZEN, 5 * a.remove, False)
        remove_some(_FROZEN, 5 * a.remove, True)
        qpass()  # queries during the merge: the new delta's per-term lists built, as a served shard's would be
        th = ix._pending[0]
        th.join()
        old = ix.segment
        t0, c0 = time.perf_counter(), time.thread_time()
        ok = ix.poll_merge()
        install, install_cpu = time.perf_counter() - t0, time.thread_time() - c0
        assert ok
        t0 = time.perf_counter()
        sc = ix.__dict__.get("_topm_scratch")  # what the first query would release: the old segment's rows, bounds
        if sc is not None and sc.seg is old:
            sc.seg = sc.bounds = None
        if sc is not None and sc.wide is not None and sc.wide.seg is old:
            sc.wide = None
        del old, sc
        drop = time.perf_counter() - t0
        sc = ix.__dict__.get("_topm_scratch")
        ready = (sc.wide is not None and sc.wide.seg is ix.segment, sc.bounds is not None and sc.seg is ix.segment)
        rows0 = int((sc.wide.state != 0).sum()) if ready[0] else 0
        bounds0 = int((~np.isnan(sc.bounds[0])).sum()) if ready[1] else 0
        first, res = qpass()
        sc = ix.__dict__.get("_topm_scratch")
        rows1, bounds1 = int((sc.wide.state != 0).sum()), int((~np.isnan(sc.bounds[0])).sum())
        second, _ = qpass()
        check(res)
        extra = first - second
        row = {"round": r, "chunks": len(ix), "postings": ix.segment.n_postings, "build_s": round(ix.last_merge_s, 2),
               "start_ms": round(start * 1e3, 2), "install_ms": round(install * 1e3, 2),
               "install_cpu_ms": round(install_cpu * 1e3, 2),
               "drop_ms": round(drop * 1e3, 2), "first_pass_ms": round(first.sum() * 1e3, 1),
               "second_pass_ms": round(second.sum() * 1e3, 1),
               "first_query_extra_ms": round(extra.sum() * 1e3, 1), "first_query_ms": round(first[0] * 1e3, 1),
               "worst_query_extra_ms": round(extra.max() * 1e3, 1),
               "rows_built_after_install": rows1 - rows0, "bounds_built_after_install": bounds1 - bounds0}
        row["loop_ms"] = round(row["start_ms"] + row["install_ms"] + row["drop_ms"] + max(0.0, row["first_query_extra_ms"]), 1)
        rounds.append(row)
        print(json.dumps(row), flush=True)
    out = {"tile": a.tile, "rounds": rounds}
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
