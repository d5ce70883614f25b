"""Typed metadata (issue 15 item 4): the same value keeps its type through every ingestion path
(CLI JSONL loader, Python client ``Doc``, raw wire ``Document``) into storage, filters and hit
metadata; ``True`` matches only boolean true, numbers by numeric value, null drops the key; old
string-only data still loads and stays strings."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_retrieval import DIM
from test_retrieval_ops import Corpus, _vec

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, metadata_of, query_request
from oprag_client.loaders import load_jsonl
from oprag_server import metadata as md
from oprag_server.config import LimitsConfig
from oprag_server.engine.ingest import validate_document
from oprag_server.service import convert
from oprag_server.shards.state import ShardState


def _wire(pb):
    """``pb`` after a trip over the wire (serialised and parsed again)."""
    return type(pb).FromString(pb.SerializeToString())


def _store(c: Corpus, doc_id: str, pb_doc, rng) -> None:
    """Ingest one wire document as the server does: its metadata through metadata.of_document."""
    doc = _wire(pb_doc)
    assert validate_document(doc, LimitsConfig()) is None
    c.put(doc_id, [doc.text], _vec(rng, 1), md.of_document(doc))


def _filtered(c: Corpus, qv, flt: dict) -> set[str]:
    """Doc ids of a filtered retrieval, filters built by the Python client and converted by the server."""
    spec_filters = convert.filters(_wire(query_request("q", filters=flt)).filters)
    hits, _ = c.retrieve("alpha", qv, mode="dense", top_k=50, filters=spec_filters)
    return {h.doc_id for h in hits}


def _hit_metadata(c: Corpus, qv, doc_id: str) -> dict:
    """The metadata a client reads from the wire Hit of ``doc_id``."""
    hits, _ = c.retrieve("alpha", qv, mode="dense", top_k=100)
    pb = [h for h in convert._hits(hits) if h.doc_id == doc_id]
    assert len(pb) == 1
    return metadata_of(_wire(pb[0]))


def test_issue_case_jsonl_true_and_client_true_both_match_boolean_filter(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "jsonl", "text": "alpha one", "metadata": {"published": True}}) + "\n")
    [loaded] = list(load_jsonl([tmp_path / "a.jsonl"]))
    c = Corpus(n_shards=2)
    _store(c, "jsonl", loaded.to_pb(), rng)
    _store(c, "client", Doc("client", "alpha two", metadata={"published": True}).to_pb(), rng)
    _store(c, "string", Doc("string", "alpha three", metadata={"published": "true"}).to_pb(), rng)
    _store(c, "one", Doc("one", "alpha four", metadata={"published": 1}).to_pb(), rng)
    qv = _vec(rng, 1)[0]
    assert _filtered(c, qv, {"published": True}) == {"jsonl", "client"}
    assert _filtered(c, qv, {"published": "true"}) == {"string"}
    assert _filtered(c, qv, {"published": 1}) == {"one"}  # a bool never equals a number
    assert _filtered(c, qv, {"published": 1.0}) == {"one"}  # numbers compare by numeric value
    assert _filtered(c, qv, {"published": [True, "true"]}) == {"jsonl", "client", "string"}
    assert _hit_metadata(c, qv, "jsonl") == {"published": True}
    hits, _ = c.retrieve("alpha", qv, mode="dense", top_k=10)
    legacy = {h.doc_id: dict(h.metadata) for h in convert._hits(hits)}
    assert legacy["jsonl"] == {"published": "true"} and legacy["one"] == {"published": "1"}


def test_null_drops_the_key_in_every_path(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "text": "t", "metadata": {"x": None, "y": 2}}) + "\n")
    [loaded] = list(load_jsonl([tmp_path / "a.jsonl"]))
    raw = oprag_pb2.Document(id="a", text="t", typed_metadata={"x": oprag_pb2.MetadataValue(),
                                                               "y": oprag_pb2.MetadataValue(int_value=2)})
    for pb in (loaded.to_pb(), Doc("a", "t", metadata={"x": None, "y": 2}).to_pb(), raw):
        assert md.of_document(_wire(pb)) == {"y": 2}


@pytest.mark.parametrize("value, reason", [
    ([1, 2], "metadata 'k' is a list: values must be string, integer, float or boolean"),
    ({"a": 1}, "metadata 'k' is a dict: values must be string, integer, float or boolean"),
    (2**63, "metadata 'k': integer 9223372036854775808 is outside signed 64-bit; send it as a string"),
    (math.nan, "metadata 'k': nan is not a finite number; send a finite float or a string"),
])
def test_values_of_no_metadata_type_are_rejected_alike(tmp_path, value, reason):
    with pytest.raises(ValueError, match=f"^{reason}$".replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Doc("a", "t", metadata={"k": value}).to_pb()
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "text": "t", "metadata": {"k": value}}) + "\n")
    with pytest.raises(ValueError, match="a.jsonl:1: metadata 'k'"):
        list(load_jsonl([tmp_path / "a.jsonl"]))
    with pytest.raises(ValueError, match=f"metadata 'k'"):
        md.check_value("k", value)


def test_raw_wire_nan_and_duplicate_keys_are_rejected_with_a_reason():
    lim = LimitsConfig()
    nan = oprag_pb2.Document(id="a", text="t", typed_metadata={"k": oprag_pb2.MetadataValue(float_value=math.nan)})
    assert validate_document(nan, lim) == "metadata 'k': nan is not a finite number; send a finite float or a string"
    both = oprag_pb2.Document(id="a", text="t", metadata={"k": "x"},
                              typed_metadata={"k": oprag_pb2.MetadataValue(int_value=1)})
    assert validate_document(both, lim) == "metadata key 'k' is in both metadata and typed_metadata: send it once"


def test_an_empty_metadata_key_rejects_the_document_like_an_empty_filter_key():
    lim = LimitsConfig()
    for doc in (oprag_pb2.Document(id="mk", text="t", metadata={"": "v"}),
                oprag_pb2.Document(id="mk", text="t", typed_metadata={"": oprag_pb2.MetadataValue(int_value=1)})):
        reason = validate_document(_wire(doc), lim)
        assert reason is not None and "empty" in reason and "metadata key" in reason
    with pytest.raises(convert.InvalidArgument, match="empty key"):  # the filter side already refused it
        convert.filters(_wire(query_request("q", filters={"": "v"})).filters)


def test_a_metadata_key_no_filter_could_name_rejects_the_document():
    lim = LimitsConfig()
    ok, long = "k" * 1024, "k" * 1025
    assert validate_document(_wire(oprag_pb2.Document(id="mk", text="t", metadata={ok: "v"})), lim) is None
    convert.filters(_wire(query_request("q", filters={ok: "v"})).filters)  # the longest key stored is filterable
    for doc in (oprag_pb2.Document(id="mk", text="t", metadata={long: "v"}),
                oprag_pb2.Document(id="mk", text="t", typed_metadata={"é" * 513: oprag_pb2.MetadataValue(int_value=1)})):
        reason = validate_document(_wire(doc), lim)
        assert reason is not None and "bytes of UTF-8; the limit is 1024" in reason and "shorten the key" in reason
    with pytest.raises(convert.InvalidArgument, match="1025 bytes of UTF-8; the limit is 1024"):
        convert.filters(_wire(query_request("q", filters={long: "v"})).filters)


def test_filter_values_are_checked():
    with pytest.raises(convert.InvalidArgument, match="has a null value"):
        convert.filters([oprag_pb2.MetadataFilter(key="k", typed_values=[oprag_pb2.MetadataValue()])])
    with pytest.raises(convert.InvalidArgument, match="not a finite number"):
        convert.filters([oprag_pb2.MetadataFilter(key="k", typed_values=[oprag_pb2.MetadataValue(float_value=math.inf)])])
    got = convert.filters([oprag_pb2.MetadataFilter(key="k", values=["1"], typed_values=[oprag_pb2.MetadataValue(int_value=1)])])
    assert got == (("k", ("1", 1)),) and isinstance(got[0][1][1], int)


def test_match_key_keeps_types_apart_and_numbers_by_value():
    assert md.match_key(True) != md.match_key(1) != md.match_key("1")
    assert md.match_key(1) == md.match_key(1.0) and hash(md.match_key(1)) == hash(md.match_key(1.0))
    assert md.match_key(2**53 + 1) != md.match_key(float(2**53))
    assert md.match_key(False) != md.match_key(0) and md.match_key(0) == md.match_key(-0.0)


keys = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)
values = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
    st.integers(md.INT64_MIN, md.INT64_MAX),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
)


def _paths(meta: dict, tmp_path) -> dict:
    """The wire Document of ``meta`` from each ingestion path."""
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"id": "d", "text": "alpha", "metadata": meta}) + "\n", encoding="utf-8")
    [loaded] = list(load_jsonl([f]))
    raw = oprag_pb2.Document(id="d", text="alpha", typed_metadata={
        k: oprag_pb2.MetadataValue() if v is None else convert.metadata_value(v) for k, v in meta.items()})
    return {"cli-jsonl": loaded.to_pb(), "python-client": Doc("d", "alpha", metadata=meta).to_pb(), "raw-grpc": raw}


def _same(a: dict, b: dict) -> bool:
    """Equal keys, values and types (-0.0 and 0.0 told apart)."""
    return a.keys() == b.keys() and all(
        type(a[k]) is type(b[k]) and (a[k] == b[k] and (not isinstance(a[k], float) or
                                                       math.copysign(1, a[k]) == math.copysign(1, b[k])))
        for k in a)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(meta=st.dictionaries(keys, values, max_size=6))
def test_random_typed_metadata_round_trips_identically_through_every_path(meta, tmp_path):
    want = {k: v for k, v in meta.items() if v is not None}
    rng = np.random.default_rng(1)
    for path, pb in _paths(meta, tmp_path).items():
        c = Corpus(n_shards=2)
        _store(c, "d", pb, rng)
        qv = _vec(rng, 1)[0]
        got = _hit_metadata(c, qv, "d")
        assert _same(got, want), (path, got, want)
        for k, v in want.items():  # every stored value is found by a filter for itself
            assert _filtered(c, qv, {k: v}) == {"d"}, (path, k, v)
        # the store survives a snapshot: its batch reads back with the same types
        batch = c.shards[0].store.batch() if c.shards[0].store.chunks else c.shards[1].store.batch()
        assert _same(md.loads(batch.column("metadata")[0].as_py()), want)


def test_snapshot_with_string_metadata_still_loads_and_stays_strings(tmp_path):
    """Data written before typed metadata holds JSON objects of strings only; it loads as strings."""
    c = Corpus(n_shards=1)
    old = c.shards[0]
    old.data_dir = tmp_path
    rng = np.random.default_rng(2)
    c.put("old", ["alpha"], _vec(rng, 1), {"published": "true", "n": "1"})
    old.snapshot()
    stored = old.store.batch().column("metadata")[0].as_py()
    assert json.loads(stored) == {"n": "1", "published": "true"}
    new = ShardState(0, DIM, tmp_path)
    new.load(set())
    assert new.store.allowed([("published", ("true",))]).tolist() == [0]
    assert new.store.allowed([("published", (True,))]).tolist() == []
    assert new.store.allowed([("n", (1,))]).tolist() == [] and new.store.allowed([("n", ("1",))]).tolist() == [0]
    assert md.loads(new.store.chunks[0].metadata) == {"n": "1", "published": "true"}


def test_numpy_scalars_are_their_python_values_in_doc_metadata_and_filters():
    """trial14: ``np.int64(3)`` (what pandas and numpy hand out) was refused as
    "metadata 'n' is a int64", and ``np.bool_(True)`` as "is a bool: values must be ... boolean"."""
    import numpy as np

    from oprag_client.client import query_request

    pb = Doc("a", "t", metadata={"i": np.int64(3), "f": np.float32(2.5), "b": np.bool_(True), "s": np.str_("x"),
                                 "u": np.uint8(7)}).to_pb()
    assert md.of_document(_wire(pb)) == {"i": 3, "f": 2.5, "b": True, "s": "x", "u": 7}
    assert pb.typed_metadata["b"].WhichOneof("kind") == "bool_value"
    req = query_request("q", filters={"year": np.int64(2001), "tag": [np.bool_(False), np.float64(1.5)]})
    got = {f.key: [getattr(v, v.WhichOneof("kind")) for v in f.typed_values] for f in req.filters}
    assert got == {"year": [2001], "tag": [False, 1.5]}
    with pytest.raises(ValueError, match=r"^metadata 'n': integer 18446744073709551615 is outside signed 64-bit"):
        Doc("a", "t", metadata={"n": np.uint64(2**64 - 1)}).to_pb()


@pytest.mark.parametrize("value, words", [(None, "is None:"), (object(), "is an object:"), (b"x", "is a bytes:")])
def test_a_refused_type_is_named_in_plain_words(value, words):
    from oprag_client.client import query_request

    with pytest.raises(ValueError, match=f"^metadata filter 'k' {words} values must be string, integer, float or boolean$"):
        query_request("q", filters={"k": value})


@pytest.mark.parametrize("value, words", [(None, "metadata filter 'topic' is None: values must be string, integer"),
                                          (math.inf, "metadata filter 'topic': inf is not a finite number")])
def test_a_bad_filter_value_is_called_a_filter(value, words):
    """trial35: ``retrieve("x", filters={"topic": None})`` said "metadata 'topic' is None", as if
    a document's metadata were wrong; the server calls it a metadata filter."""
    from oprag_client.client import query_request

    with pytest.raises(ValueError) as ei:
        query_request("q", filters={"topic": value})
    assert str(ei.value).startswith(words), str(ei.value)
