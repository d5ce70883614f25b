"""``operators.hybrid.merge_union`` (ranks of the k hits only, per-shard dedupe) against the
implementation it replaced (kept below verbatim: one union by ``np.unique``, both whole rank
lists sorted), on replies generated two ways: random scores quantised to a few levels (many
ties, BM25 zeros, negative and -0.0 BM25 scores, repeated chunk ids across shards, empty and
ineligible shards), and real shards in process (``test_threshold_bound``'s corpora)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from oprag_server.domain import RetrieveSpec
from oprag_server.index.fusion import fuse_minmax, top_k_order
from oprag_server.operators import hybrid
from oprag_server.operators.hybrid import _Cols, _rank_lists, _ranks, merge_union
from oprag_server.shards.protocol import Candidates, SearchReply


def merge_union_reference(replies, j, spec):
    parts = [p for s, rep in replies.items() for p in ((s, rep.candidates[j]), (s, rep.lexical[j]))]
    allc = _Cols.of(parts)
    _, first = np.unique(allc.shard * (1 << 32) + allc.slot, return_index=True)  # dedupe (shard, slot)
    u = allc.take(np.sort(first))
    bounds, unlisted = [], False
    for rep in replies.values():
        eligible, d, lx, listed = rep.eligible[j], rep.candidates[j], rep.lexical[j], rep.listed[j]
        if eligible <= 0:
            continue
        unlisted |= listed < eligible
        if len(d.slots) >= eligible:
            continue
        if not len(d.slots):
            bounds.append((np.inf, np.inf))
            continue
        lb = 0.0 if len(lx.slots) >= listed else max(float(np.min(lx.lexical)), 0.0)
        bounds.append((float(np.min(d.dense)), lb))
    if not len(u.ids):
        return [], not bounds
    dmins = [rep.dense_min[j] for rep in replies.values() if rep.eligible[j] > 0]
    dr = (min(float(u.dense.min()), *dmins), float(u.dense.max()))
    lr = (min(float(u.lexical.min()), 0.0 if unlisted else np.inf), max(float(u.lexical.max()), 0.0 if unlisted else -np.inf))
    w = {"dense_range": dr, "lexical_range": lr, "dense_weight": spec.dense_weight,
         "lexical_weight": spec.lexical_weight}
    scores = fuse_minmax(u.dense, u.lexical, **w)
    top = top_k_order(scores, u.ids, spec.top_k)
    certified = True
    if bounds:
        b = np.asarray(bounds, dtype=np.float64)
        finite = np.isfinite(b).all()
        ub = float(fuse_minmax(b[:, 0], b[:, 1], **w).max()) if finite else np.inf
        certified = finite and len(top) >= spec.top_k and float(scores[top[-1]]) > ub
    d_order, l_order = _rank_lists(u, spec.candidates)
    drank, lrank = _ranks(len(u.ids), d_order), _ranks(len(u.ids), l_order)
    return [u.cand(i, float(scores[i]), int(drank[i]), int(lrank[i])) for i in top], certified


def _key(res):
    cands, cert = res[:2]  # (merge_union also says which lists an uncertified query widens)
    return [(c.shard, c.slot, c.chunk_id, np.float64(c.dense).tobytes(), np.float64(c.lexical).tobytes(),
             np.float64(c.score).tobytes(), c.dense_rank, c.lexical_rank) for c in cands], cert


def _random_replies(rng, n_shards, levels):
    replies = {}
    for s in rng.permutation(n_shards).tolist():  # replies in any shard order
        size = int(rng.integers(0, 60))
        eligible = 0 if rng.random() < 0.1 else size + int(rng.integers(0, 30))
        n = min(size, int(rng.integers(0, 40))) if eligible else 0  # no eligible chunk: empty lists
        slots = rng.permutation(max(size, 1))[:n].astype(np.int64)
        ids = [f"c{int(rng.integers(0, 25 if rng.random() < 0.2 else 10**6)):07d}" for _ in range(n)]
        dense = np.sort(np.round(rng.normal(size=n), levels))[::-1].astype(np.float64)
        lex = np.round(rng.gamma(1.0, 2.0, size=n), levels) * (rng.random(n) < 0.6)
        lex[rng.random(n) < 0.05] *= -1.0
        lex[rng.random(n) < 0.05] = -0.0
        m = min(size, int(rng.integers(0, 20))) if eligible else 0
        pick = rng.choice(max(size, 1), size=m, replace=False).astype(np.int64) if m else np.zeros(0, np.int64)
        # half the BM25 list overlaps the dense list (same slot, same scores)
        lslots, lids, ldense, llex = [], [], [], []
        for q, p in enumerate(pick.tolist()):
            if n and rng.random() < 0.5:
                i = int(rng.integers(0, n))
                if slots[i] in lslots:
                    continue
                lslots.append(int(slots[i]))
                lids.append(ids[i])
                ldense.append(dense[i])
                llex.append(lex[i])
            elif p not in slots and p not in lslots:
                lslots.append(p)
                lids.append(f"c{int(rng.integers(0, 10**6)):07d}")
                ldense.append(float(np.round(rng.normal(), levels)))
                llex.append(float(np.round(rng.gamma(1.0, 2.0), levels)))
        order = np.argsort(-np.asarray(llex, dtype=np.float64), kind="stable")
        lc = Candidates(np.asarray(lslots, np.int64)[order], [lids[i] for i in order],
                        np.asarray(ldense, np.float64)[order], np.asarray(llex, np.float64)[order])
        listed = len(lslots) + (int(rng.integers(0, 3)) if lslots else 0)  # a truncated list is not empty
        dmin = float(dense.min()) - float(rng.random()) if n else float(rng.normal())
        replies[s] = SearchReply([Candidates(slots, ids, dense, lex)], [eligible], [dmin], lexical=[lc],
                                 listed=[listed])
    return replies


@pytest.mark.parametrize("seed", range(40))
def test_equals_the_reference_on_random_replies_with_ties(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        replies = _random_replies(rng, int(rng.integers(1, 4)), int(rng.integers(0, 3)))
        for k, cand, wd, wl in ((10, 256, 1.0, 1.0), (3, 5, 0.3, 0.7), (25, 12, 1.0, 0.0), (1, 1, 0.0, 1.0)):
            spec = RetrieveSpec(mode="hybrid", top_k=k, candidates=cand, dense_weight=wd, lexical_weight=wl)
            assert _key(merge_union(replies, 0, spec)) == _key(merge_union_reference(replies, 0, spec))


def test_nan_scores_fall_back_to_sorting():
    rng = np.random.default_rng(7)
    replies = _random_replies(rng, 2, 1)
    for rep in replies.values():
        if len(rep.candidates[0].dense):
            rep.candidates[0].dense[0] = np.nan
    spec = RetrieveSpec(mode="hybrid", top_k=10, candidates=8)
    assert _key(merge_union(replies, 0, spec)) == _key(merge_union_reference(replies, 0, spec))


def test_a_wrong_tie_break_fails():
    """The comparison can fail: ranks by id descending differ from the reference."""
    rng = np.random.default_rng(3)
    orig = hybrid._hit_ranks

    def flipped(vals, ids, rows, n, lexical):
        neg = np.asarray([chr(0x10FFFF) + "".join(chr(0x10FFFF - ord(c)) for c in i) for i in ids], dtype=object)
        return orig(vals, neg, rows, n, lexical)

    hybrid._hit_ranks = flipped
    try:
        differ = 0
        for _ in range(60):
            replies = _random_replies(rng, 2, 0)
            spec = RetrieveSpec(mode="hybrid", top_k=10, candidates=256)
            differ += _key(merge_union(replies, 0, spec)) != _key(merge_union_reference(replies, 0, spec))
        assert differ > 0
    finally:
        hybrid._hit_ranks = orig


def test_only_the_tied_side_is_ranked_by_id():
    """BM25 ties with distinct dense scores (at 1M: chunks with the same terms and length): the
    dense ranks are the kernel's, only the BM25 side goes through the id tie-break, and both
    equal the reference's; with dense ties too, both sides do."""
    rng = np.random.default_rng(11)
    orig, sides = hybrid._hit_ranks, []

    def spy(vals, ids, rows, n, lexical):
        sides.append(lexical)
        return orig(vals, ids, rows, n, lexical)

    hybrid._hit_ranks = spy
    try:
        seen = {(True,): 0, (False, True): 0}
        for _ in range(200):
            replies = _random_replies(rng, 2, 1)
            for rep in replies.values():  # distinct dense scores: no dense tie anywhere
                for c in (rep.candidates[0], rep.lexical[0]):
                    c.dense[:] = c.dense + rng.random(len(c.dense)) * 1e-6
            spec = RetrieveSpec(mode="hybrid", top_k=10, candidates=256)
            sides.clear()
            assert _key(merge_union(replies, 0, spec)) == _key(merge_union_reference(replies, 0, spec))
            assert sides in ([], [True])
            seen[(True,)] += sides == [True]
        for _ in range(100):
            replies = _random_replies(rng, 2, 0)
            spec = RetrieveSpec(mode="hybrid", top_k=10, candidates=256)
            sides.clear()
            assert _key(merge_union(replies, 0, spec)) == _key(merge_union_reference(replies, 0, spec))
            seen[(False, True)] += sides == [False, True]
        assert seen[(True,)] >= 10 and seen[(False, True)] >= 5, seen
    finally:
        hybrid._hit_ranks = orig


@pytest.mark.parametrize("family", ["clustered", "adversarial"])
def test_equals_the_reference_on_real_shards(family):
    from tests.unit import test_threshold_bound as tb

    from oprag_server.shards.inprocess import in_process_pool
    from oprag_server.shards.protocol import Op, QueryBatch, SearchRequest

    rng = np.random.default_rng(11)
    docs = tb.clustered(rng) if family == "clustered" else tb.adversarial(rng)[0]
    shards, stats = tb._build(docs, 3)
    pool = in_process_pool(shards, copy=True)

    async def run():
        checked = 0
        for qi in range(12):
            q = tb._unit(rng.normal(size=tb.DIM))[None]
            terms = [tb.WORDS[int(i)] for i in rng.integers(0, 60, 3)] + ["w390"]
            batch = QueryBatch(q, [terms], [stats.query_idf(terms, 0.25)], stats.avgdl, 1.5, 0.75, None)
            for n, m in ((4, 3), (16, 8), (64, 64)):
                replies, _ = await pool.gather_partial(Op.SEARCH, SearchRequest(batch, "hybrid", n, 0, 0, 10, m))
                for k in (1, 5, 10):
                    spec = RetrieveSpec(mode="hybrid", top_k=k, candidates=n)
                    assert _key(merge_union(replies, 0, spec)) == _key(merge_union_reference(replies, 0, spec))
                    checked += 1
        return checked

    assert asyncio.run(run()) == 108


@pytest.mark.parametrize("order", [(1.0, 0.0, -0.0), (1.0, -0.0, 0.0)])
def test_a_union_with_both_signs_of_zero_takes_numpys_ranges(order):
    """The compiled ranges (``union_cols``) are a scalar loop; numpy's min / max may pick the other
    zero when a column holds 0.0 and -0.0, and the fused score of a (-0.0, -0.0) hit then has the
    other sign (on the wire: -0.0 is sent, 0.0 is not). Such a union takes numpy's ranges."""
    d = np.asarray(order, np.float64)
    ids = ["c0", "c1", "c2"]
    slots = np.arange(3, dtype=np.int64)
    lc = Candidates(np.zeros(0, np.int64), [], np.zeros(0), np.zeros(0))
    rep = SearchReply([Candidates(slots, ids, d, d.copy())], [3], [0.5], lexical=[lc], listed=[3])
    spec = RetrieveSpec(mode="hybrid", top_k=3, candidates=3, dense_weight=1.0, lexical_weight=1.0)
    assert _key(merge_union({0: rep}, 0, spec)) == _key(merge_union_reference({0: rep}, 0, spec))  # (fails with
    # the scalar loop's ranges in both orders)
