"""Client inputs a new user gets wrong (the new-user trial, issue 13): text that is not valid
Unicode, an empty query vector, vectors holding strings. Each is a ValueError that names the
field and what to pass, raised before anything is sent (protobuf's own error was a bare
``UnicodeEncodeError``; ``query_vector=[]`` silently meant "embed the question"; a document
vector ``["0.1", "0.2"]`` was parsed and stored)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import Doc, ingest_messages, query_request
from oprag_client.inputs import clear_session_request, delete_request

SURROGATE = "unpaired surrogate"


@pytest.mark.parametrize("kw, field", [
    ({"question": "\ud800"}, "question"),
    ({"question": "q", "session_id": "a\udfffb"}, "session_id"),
    ({"question": "q", "filters": {"topic": ["ok", "x\ud800"]}}, "filters['topic'][1]"),
    ({"question": "q", "filters": {"topic": "x\ud800"}}, "filters['topic']"),
    ({"question": "q", "filters": {"k\ud800": 1}}, "filters key"),
])
def test_query_text_with_a_lone_surrogate_names_the_field(kw, field):
    with pytest.raises(ValueError) as ei:
        query_request(**kw)
    msg = str(ei.value)
    assert not isinstance(ei.value, UnicodeError)
    assert msg.startswith(field) and SURROGATE in msg and "pass valid Unicode" in msg


@pytest.mark.parametrize("doc, field", [
    (Doc("d1", "caf\ud800"), "document 'd1': text"),
    (Doc("d1", "t", title="\udfff"), "document 'd1': title"),
    (Doc("d1", "t", metadata={"lang": "x\ud800"}), "document 'd1': metadata['lang']"),
    (Doc("d1", chunks=[("fine", [0.1]), ("bad\ud800", [0.2])]), "document 'd1': chunks[1]"),
])
def test_document_text_with_a_lone_surrogate_names_the_field(doc, field):
    with pytest.raises(ValueError) as ei:
        doc.to_pb()
    assert not isinstance(ei.value, UnicodeError)
    assert str(ei.value).startswith(field) and SURROGATE in str(ei.value)
    with pytest.raises(ValueError, match=SURROGATE):  # and through ingest's message packing
        list(ingest_messages([doc]))


def test_delete_and_clear_session_ids_with_a_lone_surrogate():
    with pytest.raises(ValueError, match=r"^doc_ids\[1\] has an unpaired surrogate"):
        delete_request(["ok", "b\ud800"])
    with pytest.raises(ValueError, match=r"^session_id has an unpaired surrogate"):
        clear_session_request("\ud800")
    assert list(delete_request(iter(["a", "b"])).doc_ids) == ["a", "b"]


@pytest.mark.parametrize("empty", [[], (), np.zeros(0, np.float32)])
def test_an_empty_query_vector_is_a_value_error_not_no_vector(empty):
    with pytest.raises(ValueError, match=r"^query_vector is empty: .*None to let the server embed"):
        query_request("q", query_vector=empty)
    assert list(query_request("q", query_vector=None).query_vector) == []  # None: the server embeds


@pytest.mark.parametrize("vec", [["0.1", "x"], ["0.1", "0.2"], [0.1, "0.2"], [0.1, None], [0.1, b"1"]])
def test_vectors_with_strings_or_other_non_numbers_are_refused(vec):
    bad = next(i for i, x in enumerate(vec) if not isinstance(x, float))
    with pytest.raises(ValueError, match=rf"^query_vector\[{bad}\] is .*not a number"):
        query_request("q", query_vector=vec)
    with pytest.raises(ValueError, match=rf"^document 'd1': vector\[{bad}\] is .*not a number"):
        Doc("d1", "text", vector=vec).to_pb()
    with pytest.raises(ValueError, match=rf"^document 'd1': chunks\[0\] vector\[{bad}\] is"):
        Doc("d1", chunks=[("a chunk", vec)]).to_pb()
    with pytest.raises(ValueError, match=r"document 'd1': vector\["):  # a dict from a JSON line, as the loaders pass
        list(ingest_messages([{"id": "d1", "text": "t", "vector": vec}]))


def test_string_arrays_are_refused_not_parsed():
    strs = np.array(["0.1", "0.2"])
    with pytest.raises(ValueError, match=r"^query_vector has dtype <U3, not numbers"):
        query_request("q", query_vector=strs)
    with pytest.raises(ValueError, match=r"^document 'd1': vector has dtype <U3"):
        Doc("d1", "t", vector=strs).to_pb()


def test_numbers_still_convert_as_before():
    assert list(query_request("q", query_vector=[1, 0.5, np.float32(0.25)]).query_vector) == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match=r"query_vector\[3\] is True \(bool\), not a number"):  # fix21e: not sent as 1.0
        query_request("q", query_vector=[1, 0.5, np.float32(0.25), True])
    pb = Doc("d1", "t", vector=(1, 2.5)).to_pb()
    assert list(pb.vector) == [1.0, 2.5]
    assert list(Doc("d1", "t").to_pb().vector) == []  # no vector: the server embeds the text
    pb = Doc("d1", chunks=[("a", np.array([1, 2], np.int32)), ("b", np.array([3, 4], np.int32))]).to_pb()
    assert pb.vector_dim == 2 and np.frombuffer(pb.vectors_f32, "<f4").tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("make, words", [
    (lambda: query_request(123), "question must be a string, got int 123"),
    (lambda: query_request("q", session_id=5), "session_id must be a string, got int 5"),
    (lambda: query_request("q", filters=[("lang", "en")]), "filters must be a dict {key: value or [values]}, got list"),
    (lambda: Doc(7, "seven").to_pb(), "document id must be a string, got int 7: pass str(7)"),
    (lambda: Doc("d", 3.5).to_pb(), "document text must be a string, got float 3.5"),
    (lambda: Doc("d", "t", title=["x"]).to_pb(), "document title must be a string, got list ['x']"),
])
def test_wrong_types_are_type_errors_naming_the_field(make, words):
    """Were protobuf's 'bad argument type for built-in operation' (no field named) or, for a list
    of filters, an AttributeError ('list' object has no attribute 'items')."""
    with pytest.raises(TypeError) as ei:
        make()
    assert words in str(ei.value)
    assert query_request(None).question == "" and Doc("d", b"bytes").to_pb().text == "bytes"


@pytest.mark.parametrize("make, words", [
    (lambda: Doc("e1", "t", vector=[]), "document 'e1': vector is empty: pass its embedding (D floats), or leave vector None"),
    (lambda: Doc("e1", "t", vector=()), "document 'e1': vector is empty: pass its embedding"),
    (lambda: Doc("e1", "t", vector=np.array([], np.float32)), "document 'e1': vector is empty: pass its embedding"),
    (lambda: Doc("e2", "t", chunks=[]), "document 'e2': chunks is empty: give at least one (text, vector) pair"),
    (lambda: Doc("e3", chunks=[("a", [0.5, 0.5]), ("b", [])]), "document 'e3': chunks[1] vector is empty: a precomputed chunk needs"),
    (lambda: Doc("e3", chunks=[("a", np.array([], np.float32))]), "document 'e3': chunk vectors are empty: a precomputed chunk"),
    (lambda: Doc("e4", chunks=[("a", None)]), "document 'e4': chunks[0] vector is None: a precomputed chunk needs its embedding"),
])
def test_an_empty_document_or_chunk_vector_is_refused_before_sending(make, words):
    """trial46 #11 / trial48 #3: on the wire an empty vector (or chunks=[]) reads as "no vector", so the server
    embedded the text with its own model, silently mixing it into a bring-your-own-vectors corpus (the CLI's JSON
    lines and Parquet inputs refuse the same); trial48 #4: the chunk message no longer advises None, which the server
    refuses for a chunk."""
    with pytest.raises(ValueError) as e:
        make().to_pb()
    assert str(e.value).startswith(words), str(e.value)
    assert "None to let the server" not in str(e.value) or "chunk" not in str(e.value)


def test_a_mapping_with_empty_chunks_is_refused_like_a_doc():
    from oprag_client.client import _as_pb
    with pytest.raises(ValueError, match="chunks is empty"):
        _as_pb({"id": "m", "text": "t", "chunks": []})
    assert _as_pb({"id": "m", "text": "t"}).text == "t"
