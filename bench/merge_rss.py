"""The resident memory one BM25 merge adds to a shard (issue 13: the 1M tree's RSS peak was a
shard's merge), measured in process on a shard that ``bench.scale`` left: its segment is loaded
from the snapshot as a server maps it (read-only file maps), the last ``--delta-share`` of its
chunks are copied into a delta at new slots (a bulk ingest's tail: their real terms, term
frequency 1), ``--remove-share`` of them are also removed from the segment (a replace workload),
and ``seg_merge.merge`` builds the new segment with a spill directory, as a background merge
does. A thread samples ``VmRSS`` / ``RssAnon`` / ``RssFile`` of this process every 10 ms.

    python -m bench.merge_rss --data-dir bench/out/scale-1000000-hnsw --json
    python -m bench.merge_rss --data-dir bench/out/scale-1000000-hnsw --remove-share 0.1 --json

Prints the merge's seconds, the RSS before, at the peak and after (bytes; anonymous and
file-backed parts), and the peak's rise over the start.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import emit_json, log, machine_info


def _mem() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in ("VmRSS", "RssAnon", "RssFile"):
            out[k] = int(line.split()[1]) * 1024
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=Path("bench/out/scale-1000000-hnsw"))
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--delta-share", type=float, default=0.1, help="share of the segment's chunks copied into the delta")
    ap.add_argument("--remove-share", type=float, default=0.0, help="share of the copied chunks removed from the segment")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    _internals.one_thread()
    from oprag_server.index.bm25.seg_merge import merge

    st = _internals.shard_state(a.data_dir, a.shard, "hnsw")
    seg = st.store.postings._seg  # noqa: SLF001 - the shard's current segment (a file map after a load)
    n_docs = seg.doc_slots.size
    cut = int(n_docs * (1.0 - a.delta_share))
    moved = np.asarray(seg.doc_slots[cut:], np.int64)
    top = int(seg.doc_slots[-1]) + 1 if n_docs else 0
    seg_live = np.ones(top, bool)
    gone = moved[: int(moved.size * a.remove_share)]
    seg_live[gone] = False
    lo, hi = int(seg.doc_off[cut]), int(seg.doc_off[-1])
    tids = np.asarray(seg.doc_terms[lo:hi], np.int64)
    slots = np.repeat(moved + top, np.diff(np.asarray(seg.doc_off[cut:])))
    key = np.sort((tids << 32) | slots)
    tf = np.ones(key.size, np.uint16)
    tids = slots = None
    log(f"segment {seg.n_postings} postings, {n_docs} chunks; delta {key.size} postings of {moved.size} chunks; "
        f"{gone.size} chunks removed")
    out_dir = Path(tempfile.mkdtemp(dir=a.data_dir.parent, prefix="merge-rss-"))
    trace, stop = [], threading.Event()

    def sample() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            trace.append((time.perf_counter() - t0, _mem()))
            time.sleep(0.01)

    base = _mem()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        new = merge(seg, seg_live, list(seg.terms), key, tf, moved + top, out_dir=out_dir)
        seconds = time.perf_counter() - t
    finally:
        stop.set()
        th.join()
    peak = max((m for _, m in trace), key=lambda m: m["VmRSS"], default=base)
    after = _mem()
    out = {"postings": int(seg.n_postings), "delta_postings": int(key.size), "removed_chunks": int(gone.size),
           "new_postings": int(new.n_postings), "merge_s": round(seconds, 2), "rss_before": base, "rss_peak": peak,
           "rss_after": after, "rss_rise_bytes": peak["VmRSS"] - base["VmRSS"],
           "anon_rise_bytes": peak["RssAnon"] - base["RssAnon"], "file_rise_bytes": peak["RssFile"] - base["RssFile"],
           "machine": machine_info()}
    del new
    shutil.rmtree(out_dir, ignore_errors=True)
    log({k: v for k, v in out.items() if k != "machine"})
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
