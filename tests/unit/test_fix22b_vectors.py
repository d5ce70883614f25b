"""New-user trial 22 (branch fix22b), the Python client's vectors: a boolean anywhere in a vector
list is refused, naming it (fix21e looked at the first and last element only); numbers are sent as
before. ``bench/vector_check.py`` times ``Doc.to_pb`` against the base commit's check."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest

from oprag_client.client import Doc, query_request
from oprag_client.vectors import floats

DIM = 384


@pytest.mark.parametrize("at", [1, DIM // 2, DIM - 2])
@pytest.mark.parametrize("value", [True, False, np.True_])
def test_a_boolean_inside_a_vector_is_refused_naming_it(at, value):
    v = [0.1] * DIM
    v[at] = value
    shown = re.escape(f"{value!r} (bool)")
    for make in (list, tuple, collections.deque, iter):
        with pytest.raises(ValueError, match=rf"^document 'd1': vector\[{at}\] is {shown}.*not a number"):
            Doc("d1", "t", vector=make(v)).to_pb()
    with pytest.raises(ValueError, match=rf"^v\[{at}\] is {shown}"):  # (Doc refuses an object array by its dtype)
        floats(np.array(v, dtype=object), "v")
    with pytest.raises(ValueError, match=rf"^document 'd1': chunks\[1\] vector\[{at}\] is "):
        Doc("d1", chunks=[("a", [0.2] * DIM), ("b", v)]).to_pb()
    with pytest.raises(ValueError, match=rf"^query_vector\[{at}\] is "):
        query_request("q", query_vector=v)


def test_vectors_of_numbers_are_sent_as_before():
    mixed = [0.5, 1, np.float32(0.25), np.float64(2.0), np.int64(3)] * 2
    assert floats(mixed) == mixed and list(Doc("d", "t", vector=mixed).to_pb().vector) == [float(x) for x in mixed]
    assert floats(tuple(mixed)) == mixed and floats(collections.deque(mixed)) == [float(x) for x in mixed]
    v = np.random.default_rng(0).standard_normal(DIM).astype(np.float32)
    assert Doc("d", "t", vector=v.tolist()).to_pb().vector == Doc("d", "t", vector=[float(x) for x in v]).to_pb().vector
    for bad, words in (([0.1, "0.2"], r"\[1\] is '0.2' \(str\)"), ([0.1, None], r"\[1\] is None"),
                       ([0.1, 10**400], r"\[1\] is 1000")):
        with pytest.raises(ValueError, match=words):
            floats(bad)
