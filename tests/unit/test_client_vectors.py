"""The client's query vector conversion (client/oprag_client/vectors.py, issue 13, front12): a numpy
array gives the same request bytes as a list of ``float(x)``; other inputs as before."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_client.client import query_request
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
