"""Identical vectors in an HNSW index (trial26), on real FAISS graphs: copies of one vector fill
each other's neighbour lists, and a search that enters the group cannot leave it whatever its
beam. Copies added now stay out of the graph's links (index/ann_copies.py); a graph built
before, with its copies linked, is searched again from outside the group (index/ann_escape.py).
Recall is counted by score (the exact k-th score) where copies tie."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import ann_escape
from oprag_server.index.ann import AnnIndex


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _corpus(layout: str, copies: int, groups: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """150 clustered vectors and ``groups`` distinct vectors repeated ``copies`` times each,
    in the given insertion order; 40 queries near the clustered vectors."""
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((10, 384)))
    real = _unit(centers[rng.integers(0, 10, 150)] + 0.15 * rng.standard_normal((150, 384)))
    dup = np.repeat(_unit(rng.standard_normal((groups, 384))), copies, axis=0)
    vecs = np.concatenate([real, dup]) if layout == "copies_last" else np.concatenate([dup, real])
    return vecs, _unit(real[:40] + 0.25 * rng.standard_normal((40, 384)))


def _recall_by_score(ann: AnnIndex, vecs: np.ndarray, q: np.ndarray, fetch: int, k: int = 10) -> float:
    exact = q @ vecs.T
    kth = np.sort(exact, axis=1)[:, -k]
    slots, _, _ = ann.search(q, fetch, 512)
    got = []
    for j, row in enumerate(slots):
        row = row[row >= 0]
        best = np.sort(exact[j][row])[::-1][:k]  # the shard ranks what the ANN found by score
        got.append(float((best >= kth[j] - 1e-6).sum()) / k)
    return float(np.mean(got))


def _ann(vecs: np.ndarray, linked: bool = False) -> AnnIndex:
    """An HNSW AnnIndex over ``vecs`` (slots = rows); ``linked``: every copy linked, as a graph
    built before ann_copies (FAISS's own ``add``, then loaded)."""
    ann = AnnIndex(384, DenseConfig(kind="hnsw"))
    slots = np.arange(len(vecs), dtype=np.int64)
    if linked:
        index = ann._new_hnsw()  # noqa: SLF001
        index.add(vecs)
        ann.load(index, slots, 0)
        assert not ann._copies.of  # noqa: SLF001 - nothing unlinked in such a graph
    else:
        ann.add(slots, vecs, (slots, vecs))
    return ann


@pytest.mark.parametrize("layout,copies,groups", [("copies_last", 300, 1), ("copies_first", 300, 1),
                                                  ("copies_first", 100, 20), ("copies_last", 1500, 1)])
def test_copies_stay_out_of_the_links(layout: str, copies: int, groups: int) -> None:
    """Every top-10 found (by score) with copies unlinked; with them linked (the graph FAISS builds)
    these found 0.71, 0.87, 0.16 and 0.05-0.13 of it."""
    for seed in range(2):
        vecs, q = _corpus(layout, copies, groups, seed)
        ann = _ann(vecs)
        assert _recall_by_score(ann, vecs, q, fetch=320) == 1.0
        assert sum(len(c) for c in ann._copies.of.values()) == copies * groups - groups  # noqa: SLF001


def test_every_live_copy_is_returned_and_no_dead_one() -> None:
    """A vector with copies comes back with all of them (a shard breaks the tie by chunk id), also
    once the linked one is deleted (it still leads the search to them), never a deleted one."""
    vecs, _ = _corpus("copies_first", 300, 1, 0)
    ann = _ann(vecs)
    q = vecs[:1].copy()  # the copied vector itself: the copies are the top
    slots, scores, _ = ann.search(q, 10, 64)
    assert set(range(300)) <= set(slots[0].tolist()) and (scores[0][:300] == scores[0][0]).all()
    dead = np.r_[0, np.arange(1, 300, 3)]  # the linked one and a third of its copies
    ann.remove(dead)
    slots, _, _ = ann.search(q, 10, 64)
    got = set(slots[0].tolist())
    assert set(range(300)) - set(dead.tolist()) <= got and not got & set(dead.tolist())


def test_copies_survive_save_load_and_compaction() -> None:
    vecs, q = _corpus("copies_last", 300, 1, 1)
    ann = _ann(vecs)
    want = ann.search(q, 320, 512)[0]
    back = AnnIndex(384, DenseConfig(kind="hnsw"))
    back.load(ann.to_bytes(), ann.ann_slot, 0)
    assert back._copies.of == ann._copies.of  # noqa: SLF001
    np.testing.assert_array_equal(back.search(q, 320, 512)[0], want)
    live = np.arange(len(vecs), dtype=np.int64)
    back.rebuild(live, vecs)  # compaction re-adds the live vectors: the copies unlinked again
    assert back._copies.of == ann._copies.of  # noqa: SLF001
    assert _recall_by_score(back, vecs, q, fetch=320) == 1.0


@pytest.mark.parametrize("layout,copies,groups", [("copies_last", 300, 1), ("copies_first", 300, 1)])
def test_a_graph_with_linked_copies_is_searched_again(layout: str, copies: int, groups: int) -> None:
    """Without the second search these lose 13-29% of the top-10 (measured: 0.71, 0.87; both 1.0 with
    it). Not covered: copies that outnumber the other vectors ~10:1, in one group or many, also
    damage the graph's links between the other vectors at build time (100 x 20 copies: 0.90-0.94
    with it, 0.16 without; 1,500 x 1 added last: 0.55-0.61), which no search repairs
    (index/ann_escape.py)."""
    recs = []
    for seed in range(3):
        vecs, q = _corpus(layout, copies, groups, seed)
        recs.append(_recall_by_score(_ann(vecs, linked=True), vecs, q, fetch=320))
    assert np.mean(recs) >= 0.95, recs


def test_no_copies_no_second_search(monkeypatch) -> None:
    """A corpus without copies never triggers the second search (and its results are FAISS's)."""
    calls = []
    orig = ann_escape.tied_rows
    monkeypatch.setattr(ann_escape, "tied_rows", lambda s, i: calls.append(r := orig(s, i)) or r)
    rng = np.random.default_rng(5)
    vecs = _unit(rng.standard_normal((600, 384)))
    ann = _ann(vecs)
    q = _unit(rng.standard_normal((20, 384)))
    slots, scores, _ = ann.search(q, 50, 512)
    assert calls and all(r.size == 0 for r in calls)
    raw_s, raw_i = ann._index.search(q, 50, params=ann._hnsw_params(512))  # noqa: SLF001
    np.testing.assert_array_equal(slots, raw_i)
    np.testing.assert_array_equal(scores, raw_s)


def test_deleted_copies_stay_out() -> None:
    """The second search keeps excluding dead ids (the first search's selector)."""
    vecs, q = _corpus("copies_first", 300, 1, 0)
    ann = _ann(vecs, linked=True)
    dead = np.arange(300, 450, 2, dtype=np.int64)  # half of the clustered vectors
    ann.remove(dead)
    slots, _, _ = ann.search(q, 320, 512)
    assert not np.isin(slots, dead).any()
    live = np.setdiff1d(np.arange(len(vecs)), dead)
    exact = q @ vecs[live].T
    kth = np.sort(exact, axis=1)[:, -10]
    full = q @ vecs.T
    rec = [float((np.sort(full[j][r[r >= 0]])[::-1][:10] >= kth[j] - 1e-6).sum()) / 10 for j, r in enumerate(slots)]
    assert np.mean(rec) >= 0.95, rec


def test_tied_rows() -> None:
    s = np.linspace(1.0, 0.0, 40, dtype=np.float32)[None].repeat(3, 0)
    i = np.arange(40)[None].repeat(3, 0)
    s[1, 5:5 + ann_escape.TIES] = s[1, 5]  # one score TIES times
    s[2, 5:5 + ann_escape.TIES - 1] = s[2, 5]  # one fewer: not a group
    np.testing.assert_array_equal(ann_escape.tied_rows(s, i), [1])
    i[1, 6:] = -1  # padding does not count
    assert ann_escape.tied_rows(s, i).size == 0


def test_copies_of_vectors_read_back_are_unlinked() -> None:
    """A graph read back without copies hashes its nodes at the first add: a copy of a vector it
    held is then unlinked and returned with it."""
    vecs, q = _corpus("copies_last", 0, 1, 2)
    ann = _ann(vecs)
    back = AnnIndex(384, DenseConfig(kind="hnsw"))
    back.load(ann.to_bytes(), ann.ann_slot, 0)
    assert not back._copies.of  # noqa: SLF001
    slots = np.arange(len(vecs), len(vecs) + 100, dtype=np.int64)
    back.add(slots, np.repeat(vecs[7:8], 100, axis=0), (slots, vecs))
    assert back._copies.of == {7: list(range(len(vecs), len(vecs) + 100))}  # noqa: SLF001
    got = back.search(vecs[7:8], 5, 64)[0][0]
    assert {7, *slots.tolist()} <= set(got.tolist())


def test_a_copy_added_after_its_vector_was_deleted_is_found() -> None:
    """The deleted vector stays in the graph and leads searches to a copy added later (the dead-id
    selector is rebuilt when ids are added, not only when more die)."""
    vecs, _ = _corpus("copies_last", 0, 1, 3)
    ann = _ann(vecs)
    q = vecs[4:5].copy()
    assert ann.search(q, 3, 64)[0][0][0] == 4
    ann.remove(np.array([4]))
    assert 4 not in ann.search(q, 3, 64)[0][0]  # (the selector is built here, with 4 dead)
    new = np.array([len(vecs)], np.int64)
    ann.add(new, vecs[4:5], (new, vecs[4:5]))
    assert ann._copies.of == {4: [len(vecs)]}  # noqa: SLF001
    got = ann.search(q, 3, 64)[0][0]
    assert got[0] == len(vecs) and 4 not in got


def test_a_graph_of_one_vector_and_its_copies_reads_back() -> None:
    """Its only linked vector has no neighbour (nothing else is linked): it is still the node the
    copies belong to after a save and load (it used to be taken for an unlinked copy)."""
    v = _unit(np.random.default_rng(4).standard_normal((1, 384)))
    ann = _ann(np.repeat(v, 20, axis=0))
    back = AnnIndex(384, DenseConfig(kind="hnsw"))
    back.load(ann.to_bytes(), ann.ann_slot, 0)
    assert back._copies.of == {0: list(range(1, 20))}  # noqa: SLF001
    assert sorted(back.search(v, 5, 64)[0][0].tolist()) == list(range(20))


def test_row_keys_tell_rows_apart_and_match_copies() -> None:
    """Equal rows get equal keys; rows one bit apart (a sign, a last mantissa bit, any word) do not;
    the key of a row does not depend on the rows around it (blocks)."""
    from oprag_server.index import ann_copies

    x = _unit(np.random.default_rng(5).standard_normal((64, 384)))
    k = ann_copies.row_keys(x)
    assert k.dtype == np.uint64 and np.unique(k).size == 64
    np.testing.assert_array_equal(ann_copies.row_keys(np.repeat(x[3:4], 5, axis=0)), np.full(5, k[3]))
    w = np.repeat(x[:1], 384 * 3, axis=0).view(np.uint32)
    for i in range(384):  # each word: its sign bit, its lowest bit, both
        w[3 * i, i] ^= 1 << 31
        w[3 * i + 1, i] ^= 1
        w[3 * i + 2, i] ^= (1 << 31) | 1
    kw = ann_copies.row_keys(w.view(np.float32))
    assert np.unique(np.r_[kw, k[0]]).size == 384 * 3 + 1
    big = np.repeat(x, 300, axis=0)  # 19,200 rows: ten blocks
    np.testing.assert_array_equal(ann_copies.row_keys(big), np.repeat(k, 300))


def test_copies_across_many_adds_and_folds(monkeypatch) -> None:
    """Copies of vectors linked many adds before (folded into the sorted keys) and in the same add
    are unlinked; the bookkeeping read back equals the one built."""
    from oprag_server.index import ann_copies

    monkeypatch.setattr(ann_copies.Copies, "FOLD_MIN", 16)  # fold every few adds
    rng = np.random.default_rng(6)
    base = _unit(rng.standard_normal((200, 384)))
    order = rng.integers(0, 200, 900)  # 200 distinct vectors, each seen ~4.5 times, in random order
    order[:200] = np.arange(200)  # (each appears first in the first 200: their linked node is that row)
    rng.shuffle(order[200:])
    vecs = base[order]
    ann = AnnIndex(384, DenseConfig(kind="hnsw"))
    for a in range(0, 900, 37):  # 25 adds
        s = np.arange(a, min(a + 37, 900), dtype=np.int64)
        ann.add(s, vecs[s], (s, vecs[s]))
    want: dict[int, list[int]] = {}
    for j in range(200, 900):
        want.setdefault(int(order[j]), []).append(j)
    assert ann._copies.of == want  # noqa: SLF001
    back = AnnIndex(384, DenseConfig(kind="hnsw"))
    back.load(ann.to_bytes(), ann.ann_slot, 0)
    assert back._copies.of == want  # noqa: SLF001
    more = np.arange(900, 910, dtype=np.int64)
    back.add(more, base[:10], (more, base[:10]))  # copies of nodes registered at load
    assert all(back._copies.of[i][-1] == 900 + i for i in range(10))  # noqa: SLF001
    got = back.search(base[5:6], 8, 64)[0][0]
    assert {5, 905} <= set(got.tolist())


def test_colliding_keys_are_told_apart_by_bytes(monkeypatch) -> None:
    """With every key equal (a forced collision), a row that only shares the key is linked as a
    node of its own and copies are still found by their bytes."""
    from oprag_server.index import ann_copies

    monkeypatch.setattr(ann_copies, "row_keys", lambda x: np.zeros(x.shape[0], np.uint64))
    v = _unit(np.random.default_rng(7).standard_normal((3, 384)))
    vecs = np.concatenate([v[:1], v[1:2], v[:1], v[2:3], v[:1]])
    ann = _ann(vecs)
    assert ann._copies.of == {0: [2, 4]}  # noqa: SLF001
    assert ann.search(v[1:2], 1, 64)[0][0][0] == 1 and ann.search(v[2:3], 1, 64)[0][0][0] == 3
