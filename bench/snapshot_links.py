"""What a snapshot writes after a spilled background merge (issue 13: the merged segment's files
are hard links to the spill's, ``index/bm25/files.py``), in process, one tree (whatever
``oprag_server`` imports: run it with ``PYTHONPATH=<tree>/server`` per tree to compare).

A shard (``ShardState``, a data dir of its own under ``--work``) takes ``--chunks`` synthetic
chunks of 60 Zipf-distributed terms from a 30,000-term vocabulary (seed 0; D = 8 vectors: the
dense side is not what this measures), merges and snapshots them, then takes a third as many
more, whose idle background merge spills its segment (>= 64 MiB of arrays at the default size),
and is snapshotted again. Reported for that second snapshot: wall seconds, the bytes the process
wrote (``/proc/self/io`` ``write_bytes``: what reached the block layer, the fsyncs included), the
segment's array bytes and whether it was spilled.

    python -m bench.snapshot_links --chunks 150000 --work /tmp/lp --json
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import time
from pathlib import Path

import numpy as np

from ._common import emit_json, log


def _upsert(st, rng, p, vocab, lo: int, hi: int, seq: int) -> None:
    import pyarrow as pa  # noqa: PLC0415

    from oprag_server import records  # noqa: PLC0415
    n = hi - lo
    texts = [" ".join(vocab[w] for w in row) for row in rng.choice(len(vocab), size=(n, 60), p=p)]
    st.store.upsert(pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"d{i}#0" for i in range(lo, hi)], doc_ids=[f"d{i}" for i in range(lo, hi)],
        titles=[""] * n, texts=texts, metadata=[{}] * n, ordinals=[0] * n, generations=[1] * n,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=np.full((n, 8), 8 ** -0.5, np.float32))]), seq)


def _write_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("write_bytes"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=150_000)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (emptied)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_server.shards.state import ShardState  # noqa: PLC0415
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    rng = np.random.default_rng(0)
    vocab = [f"t{i}" for i in range(30_000)]
    p = 1.0 / np.arange(1, 30_001) ** 1.05
    p /= p.sum()
    ShardState.IDLE_QUIET_S = 0.0
    st = ShardState(0, 8, a.work)
    for i, lo in enumerate(range(0, a.chunks, 20_000)):
        _upsert(st, rng, p, vocab, lo, min(a.chunks, lo + 20_000), i + 1)
    st.store.postings.merge()
    st.snapshot()
    _upsert(st, rng, p, vocab, a.chunks, a.chunks + a.chunks // 3, 10 ** 6)
    px = st.store.postings
    if not px.merging:
        st.idle_wait()
        st.idle_step()
    px.wait_merge()
    seg_bytes = px.segment.nbytes()[0]
    t0, w0 = time.perf_counter(), _write_bytes()
    st.snapshot()
    out = {"chunks": a.chunks + a.chunks // 3, "spilled": px.spills, "segment_bytes": int(seg_bytes),
           "snapshot_s": round(time.perf_counter() - t0, 3), "write_bytes": _write_bytes() - w0}
    log(f"snapshot after a spilled merge: {out}")
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
