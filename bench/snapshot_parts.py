"""What a shard's snapshot after a write costs with the earlier files linked (format 5: the stored fields' and the
HNSW vectors' parts, :mod:`oprag_server.shards.chunk_files`, :mod:`oprag_server.index.ann_vectors`) against every
file written again (what the previous format did), side by side on one shard of a real data dir, in process.

    HF_HUB_OFFLINE=1 python -m bench.snapshot_parts --data-dir bench/out/scale-1000000-hnsw --shard 0 --json

The shard's current snapshot is hard-linked into a scratch data dir beside it (same file system) and loaded with
``--dense-index hnsw``; then per round: ``--add`` new chunks (stored texts under new ids, each vector a stored one
plus noise, renormalised) and a snapshot, the two arms alternating (``whole``: the stored fields and the vectors with
no earlier file to link, so every row is written, as before format 5; ``parts``: as the server does now). Both arms
do the same BM25 step. ``--arms merged,parts`` compares that step instead: ``merged`` merges the BM25 delta into a new
segment before writing (as every snapshot did before session 55), ``parts`` writes a small delta beside the linked
segment (:mod:`oprag_server.index.bm25.delta_files`). Reports each snapshot's seconds (the shard's log line: merge,
files), the bytes of the files it wrote (not linked from the snapshot before it) and the ratio of the arms' medians.

    HF_HUB_OFFLINE=1 python -m bench.snapshot_parts --data-dir bench/out/scale-1000000-hnsw --shard 0 --arms merged,parts --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np


def _current(d: Path) -> Path:
    return d / (d / "CURRENT").read_text().strip()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one snapshot per arm")
    ap.add_argument("--add", type=int, default=2000, help="new chunks before each snapshot")
    ap.add_argument("--arms", default="whole,parts", choices=["whole,parts", "merged,parts"],
                    help="whole,parts: every file written vs linked; merged,parts: BM25 merged first vs its delta beside")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import pyarrow as pa  # noqa: PLC0415

    from oprag_server import records  # noqa: PLC0415
    from oprag_server.config import DenseConfig  # noqa: PLC0415
    from oprag_server.index.bm25 import delta_files  # noqa: PLC0415
    from oprag_server.shards.state import ShardState  # noqa: PLC0415

    src = args.data_dir / f"shard-{args.shard}"
    snap = src / (src / "CURRENT").read_text().strip()
    scratch = args.data_dir.parent / f".{args.data_dir.name}-snapshot-parts"
    shutil.rmtree(scratch, ignore_errors=True)
    d = scratch / f"shard-{args.shard}"
    d.mkdir(parents=True)
    shutil.copytree(snap, d / snap.name, copy_function=os.link)  # (snapshot files are never written in place)
    (d / "CURRENT").write_text(snap.name)
    dim = int(json.loads((snap / "meta.json").read_text())["dim"])
    lines: list[str] = []
    st = ShardState(args.shard, dim, scratch, dense=DenseConfig(kind="hnsw"))
    st.say = lines.append  # (the shard's log lines: the snapshot's parts)
    t = time.perf_counter()
    st.load(set())
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    arms = tuple(args.arms.split(","))
    out: dict[str, list] = {a: [] for a in arms}
    keeps = delta_files.keeps
    try:
        slots = st.store.fields.slots()
        seq = st.store.applied_seq
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                pick = rng.choice(slots, args.add, replace=False)
                recs = st.store.fields.records(pick)
                vecs = st.store.dense.vectors_of(pick) + rng.normal(0, 0.05, (args.add, dim)).astype(np.float32)
                vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
                ids = [f"bench-{r}-{arm}-{i}" for i in range(args.add)]
                texts = [x.text for x in recs]
                batch = records.make_chunk_batch(
                    chunk_ids=[f"{i}#0" for i in ids], doc_ids=ids, titles=[x.title for x in recs], texts=texts,
                    metadata=[{}] * args.add, ordinals=[0] * args.add, generations=[1] * args.add,
                    content_hashes=[hashlib.sha256(x.encode()).hexdigest() for x in texts], vectors=vecs)
                seq += 1
                st.store.upsert(pa.Table.from_batches([batch]), seq)
                if arm == "whole":  # nothing to link: every row written, as before format 5
                    st.store.fields.prefix = None
                    st.store.dense.ann._parts = None  # noqa: SLF001
                delta_files.keeps = (lambda ix: False) if arm == "merged" else keeps  # (merged: as before session 55)
                del lines[:]
                before = {p.stat().st_ino for p in _current(d).rglob("*") if p.is_file()}
                t = time.perf_counter()
                st.snapshot()
                wall = time.perf_counter() - t
                line = next((x for x in lines if "snapshot written" in x), "")
                m = re.search(r"BM25 merge ([\d.]+) s, files ([\d.]+) s", line)
                new = sum(p.stat().st_size for p in _current(d).rglob("*")
                          if p.is_file() and p.stat().st_ino not in before)
                out[arm].append({"wall_s": round(wall, 2), "merge_s": float(m.group(1)) if m else None,
                                 "files_s": float(m.group(2)) if m else None, "bytes_new": new})
    finally:
        delta_files.keeps = keeps
        st.txns.wal.close()
        shutil.rmtree(scratch, ignore_errors=True)

    def med(arm: str, k: str) -> float:
        return float(np.median([x[k] for x in out[arm]]))

    res = {"snapshot": snap.name, "chunks": int(len(slots)), "added_per_snapshot": args.add,
           "load_s": round(load_s, 1), "rounds": out,
           "files_s_p50": {a: med(a, "files_s") for a in out}, "wall_s_p50": {a: med(a, "wall_s") for a in out},
           "merge_s_p50": {a: med(a, "merge_s") for a in out},
           f"files_ratio_parts_to_{arms[0]}": round(med("parts", "files_s") / med(arms[0], "files_s"), 3),
           f"wall_ratio_parts_to_{arms[0]}": round(med("parts", "wall_s") / med(arms[0], "wall_s"), 3)}
    print(json.dumps(res, indent=1) if args.json else res)
    return res


if __name__ == "__main__":
    main()
