"""The fields a search reply carries, read from the stored UTF-8 bytes (issue 13 hot path, shard
side: ``StoredFields.hit_utf8``, ``shards.carried.CarriedFields``): the same values as
``hit_fields`` (null / empty titles and metadata included), the same pickled bytes as the plain
``FetchReply`` of those values, and a plain ``FetchReply`` on the other side."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pyarrow as pa
import pytest

from oprag_server import records
from oprag_server.shards.carried import CarriedFields
from oprag_server.shards.fields import FIELDS, StoredFields
from oprag_server.shards.strcols import StrColumn
from oprag_server.shards.protocol import FetchReply, FetchRequest
from oprag_server.shards.state import ShardState

D = 16


def _table(n: int, gen: int = 1, prefix: str = "d", text=lambda i: f"text number {i} " + "x" * 300) -> pa.Table:
    texts = [text(i) for i in range(n)]
    v = np.random.default_rng(gen).standard_normal((n, D)).astype(np.float32)
    return pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"{prefix}{i}#0" for i in range(n)], doc_ids=[f"{prefix}{i}" for i in range(n)],
        titles=[None if i % 4 == 1 else "" if i % 4 == 2 else "t\u00ef" for i in range(n)],
        texts=texts, metadata=[{"k": i % 3} if i % 2 else {} for i in range(n)], ordinals=[0] * n,
        generations=[gen] * n, content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=v / np.linalg.norm(v, axis=1, keepdims=True))])


def _plain(st: ShardState, slots: list[int]) -> FetchReply:
    """The decoded fields (``StoredFields.hit_fields``: the reference the bytes are read against)."""
    found, doc_ids, titles, texts, metadata = st.store.fields.hit_fields(slots)
    return FetchReply(found, doc_ids, titles, texts, metadata, slots)


def _cols(rep) -> tuple:
    return rep.found, list(rep.doc_ids), list(rep.titles), list(rep.texts), list(rep.metadata), rep.slots


def test_carried_fields_equal_the_fetched_ones_and_pickle_to_the_same_bytes(tmp_path):
    st = ShardState(0, D, None)
    st.store.upsert(_table(300, text=lambda i: f"t\u00e9xt {i} \u4e2d\u6587 " + "\U0001f600" * (i % 5)), 1)
    st.store.upsert(_table(200, gen=2, prefix="e"), 2)  # a second part
    st.store.delete([f"d{i}" for i in range(0, 300, 7)], 3)
    live = st.store.fields.slots()
    rng = np.random.default_rng(1)
    cases = [live[:1], live[:40], live[-30:], rng.choice(live[live < 300], 25, replace=False),
             rng.choice(live, 19, replace=False)]  # (the last spans both parts)
    carried = 0
    for slots in cases:
        slots = np.asarray(slots, np.int64)
        rep, plain = st.search._fields(slots), _plain(st, slots.tolist())
        carried += isinstance(rep, CarriedFields)
        assert _cols(rep) == _cols(plain)
        b = pickle.dumps((1, True, rep), protocol=pickle.HIGHEST_PROTOCOL)
        assert b == pickle.dumps((1, True, plain), protocol=pickle.HIGHEST_PROTOCOL)
        back = pickle.loads(b)[2]
        assert type(back) is FetchReply and _cols(back) == _cols(plain)
    assert carried == 5  # every one came from the bytes, also the one spanning two parts (read part by part)


def test_hit_utf8_reads_nulls_and_empties_as_hit_fields_does():
    n = 8
    cols = {
        "chunk_id": [f"c{i}" for i in range(n)], "doc_id": [f"d\u00fc{i}" for i in range(n)],
        "title": [None, "", "t", "\u00fc", None, "x" * 50, "", "y"],
        "text": ["", "a", "\u00e9" * 9, "b", "c", "", "d", "e"],
        "metadata": [None, "", "{}", '{"a": 1}', "", None, '{"b": "\u00fc"}', "{}"],
        "ordinal": list(range(n)), "generation": [1] * n, "content_hash": ["h"] * n,
    }
    table = pa.table({k: pa.array(v, pa.int32() if k == "ordinal" else pa.uint64() if k == "generation"
                                  else pa.string()) for k, v in cols.items()})
    i = table.schema.get_field_index("metadata")  # "" but no null: the column without a validity list
    no_null = table.set_column(i, "metadata", pa.array([m or "" for m in cols["metadata"]], pa.string()))
    for t, off in ((table, 0), (table.slice(2), 2), (no_null, -1)):  # a sliced part: the arrays' offset
        f = StoredFields()
        f.add(t.select(list(FIELDS)), list(range(t.num_rows)), list(range(t.num_rows)), copy=False)
        for slots in ([0], list(range(t.num_rows)), [t.num_rows - 1, 0, 1, 1]):
            found, d, ti, x, m = f.hit_fields(slots)
            blob, lens = f.hit_utf8(np.asarray(slots, np.int64))
            at = np.cumsum([0, *lens])
            got = [blob[at[k]:at[k + 1]].decode() for k in range(len(lens))]
            assert got == d + ti + x + m, off
            assert m.count("{}") >= 1 and "" not in m  # (null and "" metadata read "{}")


def test_hit_utf8_refuses_what_it_cannot_read_from_one_buffer():
    st = ShardState(0, D, None)
    st.store.upsert(_table(50), 1)
    st.store.upsert(_table(50, gen=2, prefix="e"), 2)
    f = st.store.fields
    blob, lens = f.hit_utf8(np.array([60, 0, 61], np.int64))  # two parts: read part by part, in order
    at = np.cumsum([0, *lens])
    _, d, ti, x, m = f.hit_fields([60, 0, 61])
    assert [blob[at[k]:at[k + 1]].decode() for k in range(len(lens))] == d + ti + x + m
    assert f.hit_utf8(np.array([0, 10_000], np.int64)) is None  # not stored
    assert f.hit_utf8(np.array([-1], np.int64)) is None
    assert f.hit_utf8(np.zeros(0, np.int64)) is None
    chunked = pa.concat_tables([_table(3).select(list(FIELDS)), _table(3, prefix="z").select(list(FIELDS))])
    g = StoredFields()
    g.add(chunked, list(range(6)), list(range(6)), copy=False)  # a mapped file of two record batches
    blob, lens = g.hit_utf8(np.array([4, 1, 5], np.int64))  # a column of two chunks: read from both buffers
    at = np.cumsum([0, *lens])
    assert [blob[at[k]:at[k + 1]].decode() for k in range(len(lens))] == sum(g.hit_fields([4, 1, 5])[1:], [])
    assert StrColumn.of(chunked.column("text")).starts.tolist() == [0, 3]
    nul = StoredFields()
    t = _table(3).select(list(FIELDS))
    t = t.set_column(t.schema.get_field_index("text"), "text", pa.array(["a", None, "c"], pa.string()))
    nul.add(t, [0, 1, 2], [0, 1, 2], copy=False)
    assert nul.hit_utf8(np.array([0], np.int64)) is None  # a null text: hit_fields' own path
    assert nul.hit_fields([1])[3] == [None]  # (what the plain path carries there)


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_hit_utf8_of_plain_columns_in_one_compiled_gather_equals_hit_fields(kind):
    """Every column one array without nulls (int32 or int64 offsets, a sliced part, empty values):
    the compiled gather (``kernels_fields``) gives the bytes hit_fields' strings have."""
    n = 9
    cols = {"chunk_id": [f"c{i}" for i in range(n)], "doc_id": [f"d\u00fc{i}" for i in range(n)],
            "title": ["", "t", "\u00fc" * 3, "", "x" * 70, "y", "", "z", "w"],
            "text": ["a", "\u00e9" * 9, "", "b", "c" * 300, "", "d", "e", "\u4e2d\u6587"],
            "metadata": ["", "{}", '{"a": 1}', "", '{"b": "\u00fc"}', "", "{}", '{"c": [1]}', ""],
            "ordinal": list(range(n)), "generation": [1] * n, "content_hash": ["h"] * n}
    table = pa.table({k: pa.array(v, pa.int32() if k == "ordinal" else pa.uint64() if k == "generation" else kind)
                      for k, v in cols.items()})
    from oprag_server.shards.fields import _HIT
    for t in (table, table.slice(3)):
        f = StoredFields()
        f.add(t.select(list(FIELDS)), list(range(t.num_rows)), list(range(t.num_rows)), copy=False)
        assert all(c.plain() for c in f._readers(0, _HIT))  # (the compiled path)
        for slots in ([0], list(range(t.num_rows)), [t.num_rows - 1, 0, 2, 2]):
            _, d, ti, x, m = f.hit_fields(slots)
            blob, lens = f.hit_utf8(np.asarray(slots, np.int64))
            at = np.cumsum([0, *lens])
            assert [blob[at[k]:at[k + 1]].decode() for k in range(len(lens))] == d + ti + x + m
            assert "" not in m and len(lens) == 4 * len(slots)
        assert f.hit_utf8(np.array([0, t.num_rows], np.int64)) is None


def test_fetch_reads_the_stored_bytes_when_every_slot_is_live_and_decodes_otherwise():
    """FETCH (``FieldsMixin.fetch``: the frontend's fetch of hits whose fields no reply carried, and
    ``--shard-workers inline``'s fields after the merge) from the stored UTF-8 bytes: the same
    values as the decoded path, over two parts; a slot deleted meanwhile is ``found`` False."""
    st = ShardState(0, D, None)
    st.store.upsert(_table(120, text=lambda i: f"t\u00e9xt {i} " + "\U0001f600" * (i % 3)), 1)
    st.store.upsert(_table(80, gen=2, prefix="e"), 2)
    live = st.store.fields.slots()
    for slots in (live[:5].tolist(), [int(live[-1]), int(live[3]), int(live[130])]):
        rep = st.search.fetch(FetchRequest(slots))
        assert isinstance(rep, CarriedFields) and _cols(rep)[:5] == _cols(_plain(st, slots))[:5]
    gone = int(live[4])
    st.store.delete([st.store.fields.hit_fields([gone])[1][0]], 3)
    rep = st.search.fetch(FetchRequest([int(live[0]), gone]))
    assert not isinstance(rep, CarriedFields) and list(rep.found) == [True, False]
    assert list(rep.doc_ids) == [_plain(st, [int(live[0])]).doc_ids[0], ""]
