"""Packed own vectors (``Document.vectors_f32`` + ``vector_dim``): the client packs numpy
vectors, the server unpacks them with one ``np.frombuffer`` to the same unit vectors as the
repeated-float form, and a wrong byte length, width or a mix of both forms fails the stream
(IngestError -> INVALID_ARGUMENT, nothing stored)."""

from __future__ import annotations

import numpy as np
import pytest

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc
from oprag_server import records
from oprag_server.engine.documents import IngestError, supplied_vectors

D = 8
RNG = np.random.default_rng(5)
V = RNG.standard_normal((3, D))


def test_client_packs_numpy_vectors_and_server_matches_the_float_form():
    one = Doc("a", "whole text", vector=V[0]).to_pb()
    assert one.vector_dim == D and len(one.vectors_f32) == D * 4 and not one.vector
    assert np.frombuffer(one.vectors_f32, "<f4").tolist() == V[0].astype(np.float32).tolist()
    as_floats = Doc("a", "whole text", vector=V[0].astype(np.float32).tolist()).to_pb()
    assert not as_floats.vectors_f32 and len(as_floats.vector) == D  # lists keep the old form
    a, b = supplied_vectors(0, one, D), supplied_vectors(0, as_floats, D)
    assert [t for t, _ in a] == ["whole text"] and np.array_equal(a[0][1], b[0][1])
    many = Doc("b", chunks=[("first", V[1]), ("second", V[2].astype(np.float32))]).to_pb()
    assert [c.text for c in many.chunks] == ["first", "second"] and not any(c.vector for c in many.chunks)
    got = supplied_vectors(0, many, D)
    ref = records.unit_rows([V[1].astype(np.float32), V[2].astype(np.float32)], D)
    assert [t for t, _ in got] == ["first", "second"]
    np.testing.assert_array_equal(np.stack([v for _, v in got]), ref)
    assert got[0][1].dtype == np.float32


def test_client_rejects_bad_numpy_vectors():
    with pytest.raises(ValueError, match="1-D"):
        Doc("a", "t", vector=V[:2]).to_pb()
    with pytest.raises(ValueError, match="one width"):
        Doc("a", chunks=[("x", V[0]), ("y", V[1][:4])]).to_pb()


def _doc(data: bytes, dim: int, chunks=0, **kw) -> oprag_pb2.Document:
    return oprag_pb2.Document(id="p", text="" if chunks else "t", vectors_f32=data, vector_dim=dim,
                              chunks=[oprag_pb2.ChunkVector(text=f"c{i}") for i in range(chunks)], **kw)


@pytest.mark.parametrize("doc, msg", [
    (_doc(V[0].astype("<f4").tobytes()[:-4], D), "28 bytes; 1 row"),  # one value short
    (_doc(V[:2].astype("<f4").tobytes(), D), "64 bytes"),  # two rows for a one-chunk document
    (_doc(V[:2].astype("<f4").tobytes(), D, chunks=3), "3 row"),  # fewer rows than chunks
    (_doc(V[0].astype("<f4").tobytes(), D // 2, chunks=2), "a vector has 4 values .*width 8"),  # right bytes, wrong width
    (_doc(V[0].astype("<f4").tobytes(), 0),  # trial48 #6: the message says what to set
     r"vectors_f32 holds 32 bytes but vector_dim is 0: set vector_dim to the vectors. width \(8 for this index\)"),
    (_doc(b"", D), "0 bytes"),
    (_doc(V[0].astype("<f4").tobytes(), D, vector=[1.0] * D), "one form"),
    (_doc(np.full(D, np.nan, "<f4").tobytes(), D), "NaN"),
    (_doc(np.zeros(D, "<f4").tobytes(), D), "all zeros"),
])
def test_bad_packed_vectors_fail_the_stream(doc, msg):
    with pytest.raises(IngestError, match=f"document 4 .*{msg}.*nothing was stored"):
        supplied_vectors(4, doc, D)


def test_packed_rows_is_little_endian_and_copies_nothing_wrong():
    data = np.arange(1, D + 1, dtype=">f4").astype("<f4").tobytes()
    v = records.packed_rows(data, 1, D, D)
    np.testing.assert_allclose(v[0] * np.linalg.norm(np.arange(1, D + 1)), np.arange(1, D + 1), rtol=1e-6)


def test_one_matrix_per_message_gives_each_document_its_own_unit_vectors():
    """``supplied_vectors_many`` (the ingest load stage, per message) returns exactly what
    ``supplied_vectors`` returns per document, bit for bit, for packed one-vector documents
    (normalised together), chunked and float-form documents and documents without vectors;
    a bad packed row fails with the error naming that document."""
    from oprag_server.engine.documents import supplied_vectors_many

    rng = np.random.default_rng(11)
    W = rng.standard_normal((40, D)) * rng.uniform(1e-3, 1e3, (40, 1))  # widely varying norms
    docs = [Doc(f"p{i}", f"text {i}", vector=W[i]).to_pb() for i in range(30)]
    docs[4] = Doc("c", chunks=[("x", W[30]), ("y", W[31])]).to_pb()
    docs[9] = Doc("f", "floats", vector=W[32].tolist()).to_pb()
    docs[17] = Doc("e", "embed me").to_pb()
    numbered = [(100 + 2 * i, d) for i, d in enumerate(docs)]  # (numbers need not be consecutive)
    got = supplied_vectors_many(numbered, D)
    want = [supplied_vectors(n, d, D) for n, d in numbered]
    assert got[17] is None and want[17] is None
    for g, w in zip(got, want):
        if w is not None:
            assert [t for t, _ in g] == [t for t, _ in w]
            assert all(np.array_equal(a, b) and a.dtype == np.float32 for (_, a), (_, b) in zip(g, w))
    bad = list(numbered)
    zero = Doc("z", "zeros", vector=np.zeros(D)).to_pb()
    bad[21] = (142, zero)
    with pytest.raises(IngestError, match=r"document 142 \('z'\).*all zeros"):
        supplied_vectors_many(bad, D)
    assert supplied_vectors_many([], D) == []


def test_a_nan_in_one_chunk_names_that_chunk_not_the_wire_field_alone():
    """trial37 #5: "vectors_f32 contains NaN or infinity" named a field the Python user never wrote,
    and not which chunk."""
    rows = V[:3].astype("<f4").copy()
    rows[0], rows[1, 2] = 0.0, np.nan  # (chunk 0 all zeros: the NaN one is named, as the error is the NaN)
    with pytest.raises(IngestError, match=r"document 4 .*a vector \(vectors_f32\) of chunk 1 contains NaN"):
        supplied_vectors(4, _doc(rows.tobytes(), D, chunks=3), D)
    with pytest.raises(IngestError, match=r"document 4 .*a vector \(vectors_f32\) contains NaN"):
        supplied_vectors(4, _doc(np.full(D, np.inf, "<f4").tobytes(), D), D)
