"""The compact pickled form of a query request's ``QueryBatch`` (``shards/packed.py``, issue 13,
front12): the shard gets the same values, dtypes, shapes and writable C-contiguous arrays;
anything else pickles as before."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from oprag_server.shards import packed
from oprag_server.shards.protocol import QueryBatch, SearchRequest


def _same(a: QueryBatch, b: QueryBatch) -> None:
    assert type(a.q) is type(b.q) and a.q.dtype == b.q.dtype and a.q.shape == b.q.shape
    assert np.array_equal(a.q, b.q) and a.q.tobytes() == b.q.tobytes()
    assert len(a.idf) == len(b.idf)
    for x, y in zip(a.idf, b.idf):
        assert type(x) is type(y)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        else:
            assert x == y
    assert (a.terms, a.avgdl, a.k1, a.b, a.filters) == (b.terms, b.avgdl, b.k1, b.b, b.filters)


@pytest.mark.parametrize("n,dim,lens", [(1, 384, [4]), (3, 5, [0, 2, 7]), (2, 3, [1, 1]), (1, 1, [0]), (0, 4, [])])
def test_compact_batch_round_trip(n, dim, lens):
    rng = np.random.default_rng(n * 31 + dim)
    q = rng.standard_normal((n, dim)).astype(np.float32)
    q.flat[:1] = -0.0 if q.size else q.flat[:1]
    idf = [rng.standard_normal(t) for t in lens]
    terms = [[f"t{i}" for i in range(t)] for t in lens]
    b = QueryBatch(q, terms, idf, 80.5, 1.5, 0.75, [[("k", ("v", 1))]] * n if n else None)
    data = pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)
    assert b.__reduce__()[0] is packed.query_batch
    got = pickle.loads(data)
    _same(got, b)
    assert got.q.flags.c_contiguous and got.q.flags.writeable and got.q.flags.aligned
    assert all(x.flags.writeable and x.flags.aligned for x in got.idf)
    req = SearchRequest(b, "hybrid", 256, 0, 0, 10, 64, [(0.5, 0.5)] * n)
    _same(pickle.loads(pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)).batch, b)


@pytest.mark.parametrize("kind", ["float64 q", "strided q", "1-d q", "idf list", "idf float32", "idf 2-d", "idf tuple"])
def test_other_batches_pickle_as_before(kind):
    q = np.arange(12, dtype=np.float32).reshape(3, 4)
    idf = [np.ones(2), np.ones(1), np.zeros(0)]
    if kind == "float64 q":
        q = q.astype(np.float64)
    elif kind == "strided q":
        q = q[:, ::2]
    elif kind == "1-d q":
        q = q.reshape(-1)
    elif kind == "idf list":
        idf = [[1.0, 2.0], [1.0], []]
    elif kind == "idf float32":
        idf = [x.astype(np.float32) for x in idf]
    elif kind == "idf 2-d":
        idf = [np.ones((1, 2)), np.ones(1), np.zeros(0)]
    elif kind == "idf tuple":
        idf = tuple(idf)
    b = QueryBatch(q, [["a", "b"], ["c"], []], idf, 1.0, 1.2, 0.75, None)
    assert b.__reduce__()[0] is QueryBatch
    _same(pickle.loads(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)), b)
