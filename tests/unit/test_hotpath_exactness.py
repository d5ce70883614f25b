"""Exactness of the issue 13 hot-path shortcuts: ``rank_order`` / ``top_k_order`` sort only the runs
of equal scores by chunk id (the same order as one sort on (score desc, id asc)); the shard keeps
its dense-minimum estimate per query vector until the next write."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index.fusion import rank_order, top_k_order


def _reference(scores, ids) -> list[int]:
    s = np.asarray(scores, dtype=np.float64).tolist()
    return sorted(range(len(s)), key=lambda i: (-s[i], ids[i]))


@pytest.mark.parametrize("seed", range(40))
def test_rank_and_top_k_equal_one_sort_on_score_then_id(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 60))
    pool = [0.0, -0.0, 0.5, 1.0, 2.5, -1.0, np.inf, -np.inf] if seed % 2 else [0.25 * i for i in range(4)]
    scores = rng.choice(pool, n)
    ids = [f"c{x}" for x in rng.permutation(500)[:n].tolist()] if seed % 3 else \
        [str(rng.choice(["a", "b", "ab", "é", "\x00", "B"])) for _ in range(n)]  # repeated ids: stable
    assert rank_order(scores, ids) == _reference(scores, ids)
    for k in (0, 1, 3, n // 2, n, n + 1):
        assert top_k_order(scores, ids, k) == _reference(scores, ids)[:k]
    rows = np.arange(n)[::-1].copy()  # ids through a row map, as the frontend passes them
    assert rank_order(scores, np.asarray(ids, dtype=object)[::-1], rows) == _reference(scores, ids)
    assert top_k_order(scores, ids[::-1], 5, rows) == _reference(scores, ids)[:5]


@pytest.mark.parametrize("seed", range(12))
def test_long_tied_runs_equal_one_sort(seed):
    """Runs of thousands of equal scores (identical chunks) crossing the k-th position, ids as a
    list, an object array or through row maps (read in one take), repeated ids kept stable."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(200, 3000))
    scores = rng.choice([0.1, 0.5, 0.7], n, p=[0.2, 0.7, 0.1])
    ids = [f"c{x:05d}" for x in rng.permutation(n).tolist()] if seed % 2 else \
        [f"d{x}" for x in rng.integers(0, n // 3, n).tolist()]  # repeated ids: stable by position
    want = _reference(scores, ids)
    for k in (1, 10, 65, 300, n // 2, n):
        assert top_k_order(scores, ids, k) == want[:k]
        assert top_k_order(scores, np.asarray(ids, dtype=object), k) == want[:k]
        rows = rng.permutation(n)
        back = np.empty(n, object)
        back[rows] = ids
        assert top_k_order(scores, back, k, rows) == want[:k]
    assert rank_order(scores, ids) == want


def test_hit_ranks_with_long_ties_equal_the_sorted_lists():
    """``hybrid._hit_ranks`` (ranks of the top-k among the union, ties by id then position) equals
    the positions in the sorted lists, with thousands of tied scores."""
    from oprag_server.operators.hybrid import _Cols, _hit_ranks, _rank_lists, _ranks, _UnionIds

    rng = np.random.default_rng(7)
    n = 2500
    dense = rng.choice([0.2, 0.4, 0.4000001], n)
    lexical = rng.choice([0.0, 1.5, 3.0], n)
    ids = [f"c{x:05d}" for x in rng.integers(0, n // 2, n).tolist()]  # (repeats: then by position)
    u = _Cols(np.zeros(n, np.int64), np.arange(n), _UnionIds([(ids[:1000], None), (ids[1000:], None)]), dense, lexical)
    top = rng.choice(n, 30, replace=False).tolist()
    for cap in (10, 256, n):
        d_order, l_order = _rank_lists(u, cap)
        np.testing.assert_array_equal(_hit_ranks(dense, u.ids, top, cap, False), _ranks(n, d_order)[top])
        np.testing.assert_array_equal(_hit_ranks(lexical, u.ids, top, cap, True), _ranks(n, l_order)[top])


def test_no_ties_never_reads_an_id():
    class Boom(list):
        def __getitem__(self, i):
            raise AssertionError("an id was read although no two scores tie")

    assert rank_order(np.array([0.1, 0.3, 0.2]), Boom(["x", "y", "z"])) == [1, 2, 0]


def test_dense_minimum_estimate_is_kept_per_query_until_a_write():
    from test_retrieval_ops import Corpus, _vec

    from oprag_server.index.dense import fixed_order_dot

    rng = np.random.default_rng(3)
    c = Corpus(1)
    c.put("a", ["alpha beta", "gamma"], _vec(rng, 2))
    search = c.shards[0].search
    q = _vec(rng, 2)

    def lowest(qv):  # canonical minimum over every stored vector (the shard is under the sample size)
        return min(fixed_order_dot(v[None], qv)[0] for _, _, v, _ in c.rows())

    first = search._dense_min_estimate(q)
    assert first.tolist() == [lowest(q[0]), lowest(q[1])]
    assert search._dense_min_estimate(q[::-1].copy()).tolist() == first[::-1].tolist()  # from the memo
    c.put("b", ["delta"], -q[:1])  # a write: the memo is dropped, the new vector is the minimum
    assert search._dense_min_estimate(q[:1]).tolist() == [lowest(q[0])] == [fixed_order_dot(-q[:1], q[0])[0]]
