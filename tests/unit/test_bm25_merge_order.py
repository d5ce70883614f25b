"""segment.merge's linear orderings (a delta with strictly ascending keys: the postings regrouped
by new term id, the forward index by a stable sort on chunk position) give exactly the segment of
the general lexsort path (the same delta in shuffled order), and the postings a dict reference holds."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.index.bm25.delta import Delta
from oprag_server.index.bm25.seg_merge import merge
from oprag_server.index.bm25.segment import _ARRAYS, Segment


def _delta(rng, slots, vocab_size):
    d = Delta()
    toks = [[f"t{int(x)}" for x in rng.zipf(1.3, rng.integers(0, 40)) % vocab_size] for _ in slots]
    for i in range(0, len(slots), 500):
        d.add_batch(slots[i:i + 500], toks[i:i + 500])
    key, tf = d.consolidated()
    return d, key, tf, np.asarray(sorted(d.docs), np.int64), dict(zip(slots, toks))


def _equal(a: Segment, b: Segment) -> bool:
    return a.terms == b.terms and all(
        np.array_equal(getattr(a, n), getattr(b, n)) and getattr(a, n).dtype == getattr(b, n).dtype for n in _ARRAYS)


@pytest.mark.parametrize("n_docs", [300, 70000])  # 70000: chunk positions past 16 bits
def test_fast_orderings_equal_the_lexsort_path(n_docs):
    rng = np.random.default_rng(n_docs)
    d0, k0, tf0, ds0, toks0 = _delta(rng, list(range(0, 2 * n_docs, 2)), 5000)
    live = np.ones(4 * n_docs + 8, bool)
    seg = merge(Segment.empty(), live, d0.terms, k0, tf0, ds0)
    perm = rng.permutation(k0.size)
    assert _equal(seg, merge(Segment.empty(), live, d0.terms, k0[perm], tf0[perm], ds0))
    # second delta: slots between and above the segment's, some segment chunks dead, new terms
    live[rng.choice(np.arange(0, 2 * n_docs, 2), n_docs // 10, replace=False)] = False
    d1, k1, tf1, ds1, toks1 = _delta(rng, list(range(1, n_docs, 2)) + list(range(2 * n_docs, 2 * n_docs + 50)), 9000)
    fast = merge(seg, live, d1.terms, k1, tf1, ds1)
    perm = rng.permutation(k1.size)
    assert _equal(fast, merge(seg, live, d1.terms, k1[perm], tf1[perm], ds1))
    # against a dict reference: every live chunk's term frequencies and its forward index
    ref = {s: t for s, t in toks0.items() if live[s]} | toks1
    assert fast.doc_slots.tolist() == sorted(ref)
    step = max(1, len(ref) // 3000)  # (every chunk at 300; a spread of 3,000 at 70,000: the lexsort check covers all)
    for i, s in list(enumerate(fast.doc_slots.tolist()))[::step]:
        tids = fast.doc_terms[fast.doc_off[i]:fast.doc_off[i + 1]]
        assert sorted(fast.terms[t] for t in tids) == sorted(set(ref[s]))
    for tid, term in enumerate(fast.terms[: 40 if step == 1 else 6]):
        ps, ptf = fast.postings(tid)
        want = sorted((s, t.count(term)) for s, t in ref.items() if term in t)
        assert list(zip(ps.tolist(), ptf.tolist())) == want
