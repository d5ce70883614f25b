"""trial41: on a fresh install (after ``python -m oprag_server.precompile``) a shard still compiled numba
specialisations on first use, each holding its request loop 1.2-7.1 s: the first staging (term_ids._rows with a
writable title column beside a read-only text column) and the first search after a restart (kernels_fields.gather4
with columns from a snapshot's maps beside ones built in memory). Their arrays now go in read-only whatever their
source, so the signature ``warm()`` compiles is the only one; and precompile's end-to-end workload
(:mod:`oprag_server.warm_workload`) runs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from oprag_server import records, warm_workload
from oprag_server.index import kernels_fields, term_ids
from oprag_server.shards.state import ShardState


def _table(texts, titles):
    n = len(texts)
    ids = [f"d{i}" for i in range(n)]
    return pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in ids], doc_ids=ids, titles=titles, texts=texts, metadata=[{"k": i} for i in range(n)],
        ordinals=[0] * n, generations=[1] * n, content_hashes=texts, vectors=np.ones((n, 4), np.float32))])


def test_staging_and_fields_compile_nothing_beyond_warm(tmp_path):
    term_ids.warm()
    kernels_fields.warm()
    rows_sigs, gather_sigs = set(term_ids._rows.signatures), set(kernels_fields.gather4.signatures)
    texts = ["plain words", "café crème", "東京 検索", "rocket 🚀"]
    built = _table(texts, ["a title", "", "タイトル", "t"])  # buffers built in memory
    ipc = records.from_ipc(records.to_ipc(built.to_batches()[0]))  # a message's (read-only)
    mixed = built.set_column(built.column_names.index("text"), "text", ipc.column("text"))
    for t in (built, ipc, mixed):
        term_ids.TermTable().rows(t)
    sh = ShardState(0, 4, tmp_path)
    sh.load(set())
    sh.store.upsert(built, 1)
    sh.snapshot()
    loaded = ShardState(0, 4, tmp_path)
    loaded.load(set())  # the snapshot's columns, memory-mapped
    loaded.store.upsert(_table(["one more"], ["x"]).set_column(1, "doc_id", pa.array(["z"])), 2)
    for st in (sh, loaded):
        slots = np.asarray(st.store.fields.slots(), np.int64)
        assert st.store.fields.hit_utf8(slots[:1]) is not None and st.store.fields.hit_utf8(slots) is not None
    assert set(term_ids._rows.signatures) == rows_sigs and set(kernels_fields.gather4.signatures) == gather_sigs


def test_the_precompile_workload_runs(tmp_path):
    warm_workload.run(tmp_path)
    assert not any(tmp_path.iterdir())  # (its temporary directory is gone)
