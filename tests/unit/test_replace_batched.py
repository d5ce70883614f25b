"""A write that replaces (or deletes) many documents removes their old chunks together: one dense remove and one
stored-fields gather for the whole write (session 41: one by one, a replacing ingest's apply took ~0.6 ms a document,
~150 ms for 250 documents a shard, every query waiting for it under the commit's write lock). What it stores is the
same as before: the replaced documents' new chunks only, dense and BM25, for every dense index type; chunk vectors
from two generators."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index.dense import DenseIndex
from oprag_server.shards.fields import StoredFields
from oprag_server.shards.state import ShardState
from tests.unit.test_ivf_background import _table, _vectors

D = 32


@pytest.mark.parametrize("kind,how", [("flat", "gauss"), ("hnsw", "clustered"), ("ivf", "gauss")])
def test_a_replacing_write_removes_the_old_chunks_together(monkeypatch, kind, how):
    sh = ShardState(0, D, None, dense=DenseConfig(kind=kind, train_min=200, ann_check=0))
    x = _vectors(how, 900, 3, D)
    sh.store.upsert(_table(x[:600], 0), 1)
    calls = {"remove": 0, "pop": 0}
    for cls, name in ((DenseIndex, "remove"), (StoredFields, "pop")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _r=real, _n=name, **k: (calls.__setitem__(_n, calls[_n] + 1),
                                                                                _r(self, *a, **k))[1])
    t = _table(x[600:900], 100)  # documents d100..d399 again, other vectors and texts, generation 2
    t = t.set_column(t.column_names.index("generation"), "generation", pa.array([2] * 300, t.schema.field("generation").type))
    reply = sh.store.upsert(t, 2)
    assert (reply.replaced_docs, reply.removed, reply.added) == (300, 300, 300)
    assert calls == {"remove": 1, "pop": 1}
    reply = sh.store.delete([f"d{i}" for i in range(0, 50)] + ["d0", "absent"], 3)
    assert calls == {"remove": 2, "pop": 2}
    st = sh.store
    assert len(st.dense) == 550 and sorted(st.doc_slots) == sorted(f"d{i}" for i in range(50, 600))
    # the replaced documents hold their new vectors and texts only; the deleted ones nothing
    for d, row in (("d150", 650), ("d399", 899), ("d450", 450)):
        slot = st.doc_slots[d]
        np.testing.assert_array_equal(st.dense.vectors_of(np.asarray([slot]))[0], x[row])
        assert st.fields.records([slot])[0].text == f"chunk {row - 500 if row >= 600 else row} topic {(row - 500 if row >= 600 else row) % 7}"
    assert len(st.postings) == 550
