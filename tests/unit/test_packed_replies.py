"""The compact pickled form of ``Candidates`` and ``FetchReply`` (``shards/packed.py``) and the
compiled merge core (``index/kernels_merge.py``): the values that come back are the values sent
(dtypes, writability, strings with NULs, empty lists), and the merge over packed replies equals
the merge over the plain ones and the numpy fusion / ordering it replaces, ties included."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from oprag_server.domain import RetrieveSpec
from oprag_server.index import kernels_merge
from oprag_server.index.fusion import fuse_minmax, top_k_order
from oprag_server.operators.hybrid import _hit_ranks, merge_union
from oprag_server.shards import packed
from oprag_server.shards.protocol import Candidates, FetchReply, SearchReply


def _rt(obj):
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _cands(m: int, ids=None) -> Candidates:
    rng = np.random.default_rng(m)
    return Candidates(rng.integers(0, 1 << 40, m), ids if ids is not None else [f"doc{i}#é{i % 3}" for i in range(m)],
                      rng.standard_normal(m), rng.standard_normal(m))


@pytest.mark.parametrize("m", [0, 1, 5, 300])
def test_candidates_come_back_with_the_same_values_dtypes_and_writable_arrays(m):
    c = _cands(m)
    assert c.__reduce__()[0] is packed.candidates  # the compact form is used
    back = _rt(c)
    assert isinstance(back.chunk_ids, packed.PackedStrs) and len(back.chunk_ids) == m
    assert back.chunk_ids == c.chunk_ids and list(back.chunk_ids) == c.chunk_ids
    assert [back.chunk_ids[i] for i in range(m)] == c.chunk_ids and back.chunk_ids[-1:] == c.chunk_ids[-1:]
    again = _rt(back)  # packed ids pickle as they are
    assert again.chunk_ids == c.chunk_ids and again.slots.tobytes() == c.slots.tobytes()
    for name in ("slots", "dense", "lexical"):
        a, b = getattr(c, name), getattr(back, name)
        assert b.dtype == a.dtype and b.shape == a.shape and a.tobytes() == b.tobytes(), name
        b[:1] = 7  # writable (a view of the unpickled buffer)


def test_empty_and_nul_holding_ids_and_other_dtypes_fall_back_to_the_plain_form():
    one_empty = _rt(_cands(1, ids=[""]))
    assert list(one_empty.chunk_ids) == [""]
    two_empty = _rt(_cands(2, ids=["", ""]))
    assert list(two_empty.chunk_ids) == ["", ""]
    nul = _cands(3, ids=["a", "b\x00c", "d"])
    assert nul.__reduce__()[0] is Candidates and _rt(nul).chunk_ids == ["a", "b\x00c", "d"]
    f32 = Candidates(np.arange(3), ["a", "b", "c"], np.ones(3, np.float32), np.ones(3))
    back = _rt(f32)
    assert f32.__reduce__()[0] is Candidates and back.dense.dtype == np.float32
    listed = Candidates([1, 2], ["a", "b"], [0.5, 0.25], [1.0, 2.0])
    assert _rt(listed).slots == [1, 2]


def test_fetch_replies_pack_their_strings_and_fall_back_on_a_surrogate():
    f = FetchReply([True, False, True], ["d1", "", "d3"], ["T", "", "Tïtle"], ["x" * 900, "", "line\nnext"],
                   ['{"a": 1}', "", "{}"], [4, 5, 6])
    assert f.__reduce__()[0] is packed.fetch_reply
    back = _rt(f)
    assert back.found == f.found and back.slots == f.slots
    for name in ("doc_ids", "titles", "texts", "metadata"):
        col = getattr(back, name)
        assert isinstance(col, packed.FieldColumn) and list(col) == getattr(f, name) and col == getattr(f, name)
        assert [col[i] for i in (2, 0, -1, 1)] == [getattr(f, name)[i] for i in (2, 0, -1, 1)]
        assert col[1:] == getattr(f, name)[1:] and len(col) == 3
        with pytest.raises(IndexError):
            col[3]
    assert back.texts[2] == "line\nnext" and back.texts[0] == "x" * 900 and back.titles[2] == "Tïtle"
    again = _rt(back)
    assert again.texts == f.texts and again.metadata == f.metadata and again.found == f.found
    empty = _rt(FetchReply([], [], [], [], []))
    assert len(empty.texts) == 0 and list(empty.doc_ids) == []
    blank = _rt(FetchReply([False, False], ["", ""], ["", ""], ["", ""], ["", ""], [1, 2]))
    assert list(blank.texts) == ["", ""] and list(blank.metadata) == ["", ""]
    nul = FetchReply([True], ["d\x00"], ["t"], ["a\x00b"], ["{}"])  # (lengths, no separator: NULs are fine)
    assert nul.__reduce__()[0] is packed.fetch_reply and _rt(nul).texts == ["a\x00b"] and _rt(nul).doc_ids == ["d\x00"]
    lone = FetchReply([True], ["d"], ["t"], ["a\ud800b"], ["{}"])  # not UTF-8 encodable: as before
    assert lone.__reduce__()[0] is FetchReply and _rt(lone).texts == ["a\ud800b"]
    short = FetchReply([True, True], ["d", "e"], ["t"], ["x", "y"], ["{}", "{}"])  # a column too short
    assert short.__reduce__()[0] is FetchReply and _rt(short).titles == ["t"]


def test_fused_scores_and_top_k_equal_numpy_bit_for_bit():
    rng = np.random.default_rng(3)
    for trial in range(300):
        m = int(rng.integers(1, 700))
        d = rng.standard_normal(m) * 10 ** rng.uniform(-3, 3)
        lx = np.where(rng.random(m) < 0.5, 0.0, rng.gamma(2.0, 3.0, m))
        if trial % 7 == 0:
            d[:] = d[0]  # a constant list: normalised to 0
        if trial % 5 == 0:
            lx = np.round(lx)  # ties
        dr = (min(float(d.min()), float(rng.uniform(-1, 0))), float(d.max()))
        lr = (min(float(lx.min()), 0.0), float(lx.max()))
        dw, lw = float(rng.uniform(0, 1)), float(rng.uniform(0, 1))
        k = int(rng.integers(1, 20))
        want = fuse_minmax(d, lx, dense_range=dr, lexical_range=lr, dense_weight=dw, lexical_weight=lw)
        got, top, strict = kernels_merge.fuse_top(d, lx, *dr, *lr, dw, lw, k)
        assert got.tobytes() == want.tobytes()
        ref = top_k_order(want, [f"{i:05d}" for i in range(m)], k)
        if strict:
            assert top.tolist() == ref
        else:  # ties at or above the k-th score
            kth = np.sort(want)[::-1][min(k, m) - 1]
            sel = want[want >= kth]
            assert sel.size > min(k, m) or np.unique(sel).size < sel.size


def test_hit_ranks_equal_the_id_ordered_ranks_or_say_they_need_ids():
    rng = np.random.default_rng(5)
    seen = {True: 0, False: 0}
    for _ in range(300):
        m = int(rng.integers(1, 400))
        vals = np.round(rng.standard_normal(m) * 4) / 4 if rng.random() < 0.5 else rng.standard_normal(m)
        lexical = bool(rng.random() < 0.5)
        if lexical:
            vals[rng.random(m) < 0.4] = 0.0
        ids = np.asarray([f"c{i:04d}" for i in rng.permutation(m)], dtype=object)
        rows = rng.choice(m, min(m, 10), replace=False)
        n = int(rng.integers(1, m + 5))
        got, ok = kernels_merge.hit_ranks(vals, rows.astype(np.int64), n, lexical)
        seen[bool(ok)] += 1
        if ok:
            assert got.tolist() == _hit_ranks(vals, ids, rows.tolist(), n, lexical).tolist()
    assert seen[True] > 50 and seen[False] > 50  # both paths exercised


def _replies(rng, shards=2, n=40, m=12, ties=False):
    out = {}
    for s in range(shards):
        slots = rng.choice(1000, n + m, replace=False)
        q = (lambda x: np.round(x * 4) / 4) if ties else (lambda x: x)
        d = Candidates(slots[:n].astype(np.int64), [f"s{s}d{x}" for x in slots[:n]],
                       np.sort(q(rng.standard_normal(n)))[::-1].copy(), q(np.abs(rng.standard_normal(n))))
        ls = np.concatenate([slots[n:], slots[: m // 3]]).astype(np.int64)  # some also in the dense list
        lx = Candidates(ls, [f"s{s}d{x}" for x in ls], q(rng.standard_normal(ls.size)),
                        np.sort(q(np.abs(rng.standard_normal(ls.size)) + 0.1))[::-1].copy())
        out[s] = SearchReply([d], [500], [float(d.dense.min()) - 0.5], lexical=[lx], listed=[60])
    return out


@pytest.mark.parametrize("ties", [False, True])
def test_merge_over_packed_replies_equals_the_merge_over_plain_ones(ties):
    rng = np.random.default_rng(11 + ties)
    for _ in range(60):
        plain = _replies(rng, ties=ties)
        spec = RetrieveSpec(mode="hybrid", top_k=int(rng.integers(1, 15)), candidates=int(rng.integers(5, 60)))
        a, b = merge_union(plain, 0, spec), merge_union({s: _rt(r) for s, r in plain.items()}, 0, spec)
        assert a[1:] == b[1:] and [vars(x) for x in a[0]] == [vars(x) for x in b[0]]


@pytest.mark.parametrize("n", [0, 1, 2, 16, 17, 18, 40, 257])
def test_packed_strings_read_in_any_order_equal_the_list(n):
    ids = [f"{i * 7919}#{'é' if i % 4 == 0 else ''}{i % 5}" for i in range(n)]
    blob = packed.SEP.join(ids)
    rng = np.random.default_rng(n)
    for order in (range(n), list(reversed(range(n))), rng.permutation(n).tolist(), [n // 2, 0, n - 1] if n else []):
        p = packed.PackedStrs(blob, n)
        assert [p[int(i)] for i in order] == [ids[int(i)] for i in order]
        assert list(p) == ids and p == ids and len(p) == n
    p = packed.PackedStrs(blob, n)
    if n:
        assert p[-1] == ids[-1] and p[1:3] == ids[1:3] and p[np.int64(n - 1)] == ids[n - 1]
    with pytest.raises(IndexError):
        p[n]


def test_row_fields_equal_the_columns_of_compact_and_plain_replies():
    import pickle

    from oprag_server.shards.packed import row_fields
    from oprag_server.shards.protocol import FetchReply

    cols = (["d1", "d\u00e92", ""], ["T", "", "t\u4e2d"], ["x" * 900, "y\u00e9" * 300, ""], ['{"a": 1}', "{}", ""])
    plain = FetchReply([True, True, False], *[list(c) for c in cols], [4, 9, 2])
    packed = pickle.loads(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(packed.doc_ids) is not list  # the compact form
    for f in (plain, packed):
        for k in range(3):
            assert row_fields(f, k) == tuple(c[k] for c in cols)
    for k in (2, 0, 1):  # any order, before and after a column read
        assert row_fields(packed, k) == tuple(c[k] for c in cols)


def test_strided_columns_pack_as_their_contiguous_copies():
    """The compact form joins the columns' buffers: a strided view (every other row of a larger
    array) packs the same values as its contiguous copy."""
    rng = np.random.default_rng(7)
    big = rng.standard_normal((2, 40))
    slots = np.arange(80, dtype=np.int64)[::2]
    c = Candidates(slots, [f"d{i}" for i in range(40)], big[0], big[:, 0].repeat(20))
    c.dense = big.T[:, 1].copy()[::-1]  # a negative stride
    back = _rt(c)
    for name in ("slots", "dense", "lexical"):
        assert getattr(back, name).tobytes() == np.ascontiguousarray(getattr(c, name)).tobytes(), name
