"""Probe (snap15): where ``snapshot.adopt``'s time on the shard's thread goes at 1M. It loads one
shard of a copy of the 1M data dir in process, upserts 10K chunks and snapshots, twice, timing the
map + ``read_all``, ``fields.adopt`` and the drop of the fields' former parts (round 1: dropped by
another thread, reporting this thread's longest gap meanwhile). Run at a5aa240. From 0345f52 on,
``SnapshotJob`` itself frees the former parts on a thread of its own (``oprag-snapshot-drop``), so
"drop old parts" then reads ~0.

    mkdir -p bench/out/probe && cp -a /work/main/bench/out/scale-1000000-hnsw/shard-0 bench/out/probe/
    flock /work/wt/bench.lock python -m bench.adopt_probe bench/out/probe && rm -rf bench/out/probe
"""
import hashlib, sys, time
from pathlib import Path
import numpy as np, pyarrow as pa
from oprag_server import records
from oprag_server.config import DenseConfig
from oprag_server.shards import snapshot as S
from oprag_server.shards.state import ShardState

d = Path(sys.argv[1])
t = time.perf_counter()
st = ShardState(0, 384, d, dense=DenseConfig(kind="hnsw"))
st.load(set())
print(f"load {time.perf_counter() - t:.1f} s, chunks {len(st.store.chunks)}", flush=True)
real_map = S.chunk_files.map_chunks
times = {}
def timed_map(p):
    t = time.perf_counter(); out = real_map(p); times["map+read_all"] = time.perf_counter() - t; return out
S.chunk_files.map_chunks = timed_map
F = type(st.store.fields)
real_adopt = F.adopt
held = []
def timed_adopt(self, table, slots):
    held.append(self._parts)  # keep the old parts alive: their drop is timed apart
    t = time.perf_counter(); real_adopt(self, table, slots); times["fields.adopt (no drop)"] = time.perf_counter() - t
F.adopt = timed_adopt
for rnd in range(2):
    n, lo = 10000, 10_000_000 + rnd * 10000
    texts = [f"probe chunk {i} lighthouse keeper wind tide {i % 97}" for i in range(lo, lo + n)]
    v = np.random.default_rng(rnd).standard_normal((n, 384)).astype(np.float32)
    b = records.make_chunk_batch(chunk_ids=[f"p{i}#0" for i in range(lo, lo + n)], doc_ids=[f"p{i}" for i in range(lo, lo + n)],
        titles=[""] * n, texts=texts, metadata=[{}] * n, ordinals=[0] * n, generations=[1] * n,
        content_hashes=[hashlib.sha256(x.encode()).hexdigest() for x in texts], vectors=v / np.linalg.norm(v, axis=1, keepdims=True))
    st.store.upsert(pa.Table.from_batches([b]), st.store.applied_seq + 1)
    if rnd == 1:  # touch the stored fields (as fetches would): the mapping's pages resident
        t = time.perf_counter(); st.store.batch(vectors=False); print(f"touch all fields {time.perf_counter() - t:.1f} s")
    job = st.snapshot_begin()
    t = time.perf_counter(); job.wait(); total = time.perf_counter() - t
    if rnd == 0:
        t = time.perf_counter(); held.clear(); times["drop old parts"] = time.perf_counter() - t
    else:  # dropped by another thread: how long is this thread kept from running Python meanwhile?
        import threading
        old = held.pop()
        th = threading.Thread(target=old.clear); t = time.perf_counter(); last = t; gap = 0.0
        th.start(); del old
        while th.is_alive():
            now = time.perf_counter(); gap = max(gap, now - last); last = now
        times["drop old parts in a thread: took"] = time.perf_counter() - t
        times["... longest gap of this thread"] = gap
    print(f"round {rnd}: snapshot {total:.1f} s;", {k: f"{v * 1e3:.0f} ms" for k, v in times.items()}, flush=True)
