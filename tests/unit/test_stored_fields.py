"""Stored chunk fields live in Arrow (issue 13): an applied batch's fields are copied out of the
message (its vectors are not kept alive), a snapshot's chunks.arrow is memory-mapped on load
(no Arrow allocation for the texts), replaced and deleted chunks leave the fields, the hash map
and Stats, and the records read back are the ones written."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from oprag_server import records
from oprag_server.shards.protocol import FetchRequest
from oprag_server.shards.state import ShardState

D = 16


def _table(n: int, gen: int = 1, prefix: str = "d", text=lambda i: f"text number {i} " + "x" * 300) -> pa.Table:
    texts = [text(i) for i in range(n)]
    v = np.random.default_rng(gen).standard_normal((n, D)).astype(np.float32)
    return pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"{prefix}{i}#0" for i in range(n)], doc_ids=[f"{prefix}{i}" for i in range(n)], titles=["t"] * n,
        texts=texts, metadata=[{"k": i % 3} for i in range(n)], ordinals=[0] * n, generations=[gen] * n,
        content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=v / np.linalg.norm(v, axis=1, keepdims=True))])


def test_fields_are_copied_out_of_the_batch_and_read_back():
    st = ShardState(0, D, None)
    t = _table(500)
    st.store.upsert(t, 1)
    held = sum(p.get_total_buffer_size() for p in st.store.fields._parts)
    assert held < t.drop_columns(["vector"]).nbytes * 1.05  # the vectors are not among the stored fields
    text_buf = t.column("text").chunks[0].buffers()[2]
    part_buf = st.store.fields._parts[0].column("text").chunks[0].buffers()[2]
    assert part_buf.address != text_buf.address  # a copy: the message can be freed
    rep = st.search.fetch(FetchRequest([3, 499, 10_000]))
    assert rep.found == [True, True, False] and rep.texts[0] == "text number 3 " + "x" * 300
    assert rep.doc_ids[:2] == ["d3", "d499"] and rep.metadata[0] == t.column("metadata")[3].as_py()
    assert st.store.chunks[7].generation == 1 and len(st.store.chunks) == 500


def test_replace_and_delete_leave_fields_maps_and_stats():
    st = ShardState(0, D, None)
    st.store.upsert(_table(3000), 1)
    one = st.stats().nbytes["chunks"]
    st.store.upsert(_table(3000, gen=2, text=lambda i: f"new text {i} " + "y" * 300), 2)  # every document replaced
    assert len(st.store.chunks) == 3000 and st.store.fields._rows == 3000  # dead rows compacted away
    assert abs(st.stats().nbytes["chunks"] - one) < one * 0.05
    slots = st.store.doc_slots["d5"]
    assert st.store.chunks[slots].text.startswith("new text 5 ") and st.store.doc_generation("d5") == 2
    assert len(st.store.hash_slots) == 3000
    st.store.delete([f"d{i}" for i in range(3000)], 3)
    assert not st.store.chunks and not st.store.hash_slots and st.stats().nbytes["chunks"] == 0


def test_duplicate_texts_share_a_hash_entry_until_deleted():
    st = ShardState(0, D, None)
    st.store.upsert(_table(4, text=lambda i: "same text"), 1)
    (h, held), = st.store.hash_slots.items()
    assert held == {0, 1, 2, 3}
    st.store.delete(["d0", "d1", "d2"], 2)
    assert st.store.hash_slots == {h: 3}


def test_snapshot_load_maps_the_fields(tmp_path):
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(_table(2000, text=lambda i: f"chunk {i} " + "z" * 2000), 1)
    st.snapshot()
    before = pa.total_allocated_bytes()
    again = ShardState(0, D, tmp_path)
    again.load(set())
    assert pa.total_allocated_bytes() - before < 2000 * 500  # the 4 MB of texts are not read in
    assert again.store.chunks[1234].text == f"chunk 1234 " + "z" * 2000
    assert again.search.fetch(FetchRequest([5])).texts == ["chunk 5 " + "z" * 2000]


def test_hit_fields_equal_the_records_over_parts_deletes_and_missing_slots():
    """What a search reply carries (``fetch`` -> ``hit_fields``, four columns) equals what the
    full records give, over several parts, deleted slots, unknown slots, repeats and any order."""
    st = ShardState(0, D, None)
    st.store.upsert(_table(300), 1)
    st.store.upsert(_table(200, gen=2, prefix="e"), 2)  # a second part
    st.store.delete([f"d{i}" for i in range(0, 300, 7)], 3)
    f = st.store.fields
    rng = np.random.default_rng(0)
    for slots in ([], [5], f.slots()[::-1].tolist(), rng.integers(-3, 600, 80).tolist(), [1, 1, 402, 1]):
        recs = f.records(slots)
        rep = st.search.fetch(FetchRequest(slots))
        assert rep.found == [r is not None for r in recs]
        assert rep.doc_ids == [r.doc_id if r else "" for r in recs]
        assert rep.titles == [r.title if r else "" for r in recs]
        assert rep.texts == [r.text if r else "" for r in recs]
        assert rep.metadata == [r.metadata if r else "" for r in recs]


def test_table_of_several_parts_is_in_slot_order_with_or_without_reordering():
    """``StoredFields.table`` skips the reordering take when the parts hold ascending slots;
    slots asked for out of order still come back in the order asked."""
    st = ShardState(0, D, None)
    for k in range(3):
        st.store.upsert(_table(50, gen=k + 1, prefix=f"p{k}-"), k + 1)
    f = st.store.fields
    slots = f.slots()
    assert len(f._parts) == 3 and slots.size == 150
    ids = f.table(slots).column("chunk_id").to_pylist()
    assert ids == [f"p{k}-{i}#0" for k in range(3) for i in range(50)]
    mixed = np.asarray([120, 3, 75, 4, 149], np.int64)
    assert f.table(mixed).column("chunk_id").to_pylist() == ["p2-20#0", "p0-3#0", "p1-25#0", "p0-4#0", "p2-49#0"]


def test_table_not_fresh_slices_consecutive_rows_and_equals_the_fresh_table(tmp_path):
    """``table(fresh=False)`` (what a snapshot writes) equals ``table()`` over parts with and
    without deleted rows, a memory-mapped part and any order asked; consecutive rows of a part
    are sliced (the part's buffer), others gathered; ``table()`` never shares a part's buffers."""
    st = ShardState(0, D, tmp_path)
    st.load(set())
    st.store.upsert(_table(300), 1)
    st.snapshot()  # part 0: the memory-mapped snapshot file
    st.store.upsert(_table(200, gen=2, prefix="e"), 2)
    st.store.upsert(_table(100, gen=3, prefix="g"), 3)
    f = st.store.fields
    rng = np.random.default_rng(1)
    for _ in range(3):
        for slots in (f.slots(), f.slots()[::-1].copy(), np.sort(rng.choice(f.slots(), 77, replace=False))):
            assert f.table(slots, fresh=False).equals(f.table(slots))
        st.store.delete([f"e{i}" for i in rng.integers(0, 200, 15)] + [f"d{i}" for i in rng.integers(0, 300, 5)],
                        st.store.applied_seq + 1)
    part0 = f._parts[0].column("text").chunks[0].buffers()[2].address
    one = f.slots()[:40]  # consecutive rows of the mapped part (before the first deleted one)
    one = one[one < f._parts[0].num_rows][:10]
    assert (np.diff(f._row[one]) == 1).all()
    assert f.table(one, fresh=False).column("text").chunks[0].buffers()[2].address == part0  # sliced
    assert f.table(one).column("text").chunks[0].buffers()[2].address != part0  # a copy
    assert st.store.batch(vectors=False).num_rows == len(st.store.chunks)
