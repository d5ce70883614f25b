"""What a snapshot's HNSW files cost after a write: the whole FAISS file (format 4) vs the graph plus linked vector
parts (format 5, :mod:`oprag_server.index.ann_vectors`), side by side on one shard's structure.

    HF_HUB_OFFLINE=1 python -m bench.hnsw_parts --data-dir bench/out/scale-1000000-hnsw --shard 0 --json

Loads the shard's HNSW structure from its snapshot (either format), writes it once in parts (what the first snapshot
after an upgrade does), then per round adds ``--add`` vectors (perturbed copies of stored rows, as a write would) and
writes the structure both ways into a scratch directory beside the data (same file system), each followed by the
fsyncs a snapshot does; the two ways alternate in order. Reports each way's seconds per round (write, fsync) and
the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np


def _fsync(paths) -> float:
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--add", type=int, default=2000, help="vectors added before each round's writes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import faiss  # noqa: PLC0415

    from oprag_server.config import DenseConfig  # noqa: PLC0415
    from oprag_server.index import ann_vectors  # noqa: PLC0415
    from oprag_server.index.ann import AnnIndex  # noqa: PLC0415
    from oprag_server.index.ann_copies import hnsw_storage  # noqa: PLC0415

    d = args.data_dir / f"shard-{args.shard}"
    snap = d / (d / "CURRENT").read_text().strip()
    meta = np.load(snap / "dense.npz")
    ann = AnnIndex(int(json.loads((snap / "meta.json").read_text())["dim"]), DenseConfig(kind="hnsw"))
    t = time.perf_counter()
    ann.load(snap / "dense.faiss", meta["ann_slot"], int(meta["trained_at"]))
    load_s = time.perf_counter() - t
    n0 = int(ann._index.ntotal)  # noqa: SLF001
    scratch = args.data_dir / ".hnsw_parts_bench"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    rng = np.random.default_rng(0)
    rows = {"whole": [], "parts": []}
    try:
        first = scratch / "first"
        first.mkdir()
        ann._mut.count += 1  # noqa: SLF001 - (as a change would: the first write in parts writes every row)
        t = time.perf_counter()
        ann.write(first / "dense.faiss")
        prime = {"write_s": time.perf_counter() - t, "fsync_s": _fsync(ann_vectors.files(first / "dense.faiss"))}
        prev = first
        for r in range(args.rounds):
            st = hnsw_storage(ann._index)  # noqa: SLF001
            src = st[rng.integers(0, st.shape[0], args.add)]
            x = src + rng.normal(0, 0.05, src.shape).astype(np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            at = ann.ann_slot.size
            s = np.arange(at + 10**9, at + 10**9 + args.add, dtype=np.int64)  # (slots of their own)
            ann.add(s, x, (np.concatenate([ann.ann_slot, s]), None))
            ann.insert_pending()
            for way in (("whole", "parts") if r % 2 == 0 else ("parts", "whole")):
                out = scratch / f"r{r}-{way}"
                out.mkdir()
                t = time.perf_counter()
                if way == "whole":
                    faiss.write_index(ann._index, str(out / "dense.faiss"))  # noqa: SLF001 - format 4
                    files = [out / "dense.faiss"]
                else:
                    ann.write(out / "dense.faiss")
                    files = ann_vectors.files(out / "dense.faiss")
                w = time.perf_counter() - t
                rows[way].append({"write_s": round(w, 3), "fsync_s": round(_fsync(files), 3),
                                  "bytes_new": sum(p.stat().st_size for p in files if p.stat().st_nlink == 1)})
                if way == "parts":  # (a snapshot keeps only the last one: the next links from here)
                    shutil.rmtree(prev)
                    prev = out
                else:
                    shutil.rmtree(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def med(way: str) -> float:
        return float(np.median([x["write_s"] + x["fsync_s"] for x in rows[way]]))

    res = {"snapshot": snap.name, "vectors": n0, "added_per_round": args.add, "load_s": round(load_s, 2),
           "first_write_in_parts": {k: round(v, 3) for k, v in prime.items()}, "rounds": rows,
           "whole_s_p50": round(med("whole"), 3), "parts_s_p50": round(med("parts"), 3),
           "ratio_parts_to_whole": round(med("parts") / med("whole"), 3)}
    print(json.dumps(res, indent=1) if args.json else res)
    return res


if __name__ == "__main__":
    main()
