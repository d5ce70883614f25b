"""The client's query vector conversion (client/oprag_client/vectors.py, issue 13, front12): a numpy
array gives the same request bytes as a list of ``float(x)``; other inputs as before."""

from __future__ import annotations

import re

import numpy as np
import pytest

from oprag_client.client import Doc, query_request
from oprag_client.vectors import floats


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_vectors_give_the_same_request_as_float_lists(dtype):
    v = np.random.default_rng(1).standard_normal(384).astype(dtype)
    v[:3] = [np.float32(-0.0), 1e-30, 3.4e38] if dtype != np.float16 else [-0.0, 1e-5, 6e4]
    got = floats(v)
    assert all(type(x) is float for x in got) and got == [float(x) for x in v]
    assert query_request("q", query_vector=v).SerializeToString() == \
        query_request("q", query_vector=[float(x) for x in v]).SerializeToString()


def test_other_inputs_convert_element_by_element():
    assert floats(None) == [] and floats([1, 2.5]) == [1.0, 2.5] and floats((np.float32(0.5),)) == [0.5]
    assert floats(np.arange(3)) == [0.0, 1.0, 2.0]  # ints: float(x) each
    for bad in (np.ones((2, 384), np.float32), np.ones((1, 384)), np.float32(1.0)):  # a matrix, a row matrix, a 0-d
        with pytest.raises(ValueError, match=r"one vector \(shape \(D,\)\)"):
            floats(bad)
    with pytest.raises(ValueError):
        floats(["x"])


@pytest.mark.parametrize("chunk, what", [
    (("a", [1.0] * 4, "extra"), "chunks[0] is a tuple of 3 items: each chunk is a (text, vector) pair"),
    (["a"], "chunks[0] is a list of 1 items: each chunk is a (text, vector) pair"),
    ("ab", "chunks[0] is a str: each chunk is a (text, vector) pair"),
    ({"text": "a", "vector": [1.0]}, "chunks[0] is a dict of 2 items: each chunk is a (text, vector) pair"),
    (7, "chunks[0] is a int: each chunk is a (text, vector) pair"),
])
def test_a_chunk_that_is_not_a_text_vector_pair_is_named(chunk, what):
    """trial50: a 3-tuple chunk gave Python's bare "too many values to unpack (expected 2)"."""
    with pytest.raises(ValueError) as e:
        Doc("np23", chunks=[chunk]).to_pb()
    assert str(e.value) == f"document 'np23': {what}"


@pytest.mark.parametrize("bad", [{"a": 1.0}, {1: 0.5, 2: 0.25}, {0.5, 0.25}])
def test_a_mapping_or_set_as_a_vector_is_refused_as_such(bad):
    """trial50: ``vector={"a": 1}`` was read as its keys ("vector[0] is 'a' (str)"), and a dict of numbers or a set
    would have been sent as its keys, in no meaningful order."""
    for doc, field in ((Doc("np22", "x", vector=bad), "vector"), (Doc("np22", chunks=[("x", bad)]), "chunks[0] vector")):
        with pytest.raises(ValueError, match=rf"document 'np22': {re.escape(field)} is a \w+, not a sequence of numbers"):
            doc.to_pb()
    with pytest.raises(ValueError, match="query_vector is a"):
        query_request("q", query_vector=bad)
