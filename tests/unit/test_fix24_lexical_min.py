"""Dense-first hybrid equals exact mode when every eligible chunk holds a query term (trial24):
exact mode (``full_hybrid``) normalises BM25 from the lowest score of the eligible chunks, which
is not 0 when each of them holds a query term ("the" in a filtered set of paragraphs); dense-first
hybrid used 0 or the lowest score it had seen, and still said ``certified``. Each shard now
reports that minimum (``SearchReply.lexical_min``, :meth:`ExactMixin._lexical_min`).

Checked over real ``ShardState`` objects driven in-process (two shards), on corpora built two
ways: random words from a small vocabulary with one common word put in every chunk of a filtered
set, and random words where a frequent word lands in every chunk by chance (unfiltered)."""

from __future__ import annotations

import numpy as np
import pytest
from test_retrieval import VOCAB
from test_retrieval_ops import Corpus, _vec


def _common_in_filtered(rng, n):
    """Every chunk of set "a" holds "the"; set "b" never does."""
    c = Corpus()
    for i in range(n):
        words = rng.choice(VOCAB, size=int(rng.integers(3, 12))).tolist()
        in_a = i % 3 != 0
        if in_a:
            words.insert(int(rng.integers(0, len(words) + 1)), "the")
        c.put(f"d{i:03d}", [" ".join(words)], _vec(rng, 1), {"set": "a" if in_a else "b"})
    return c, (("set", ("a",)),)


def _common_by_chance(rng, n):
    """Words drawn with a skewed distribution over a 6-word vocabulary: "alpha" (weight 0.6 per
    draw, >= 8 draws) is in every chunk, unfiltered."""
    c = Corpus()
    p = np.array([0.6, 0.15, 0.1, 0.08, 0.05, 0.02])
    for i in range(n):
        words = rng.choice(VOCAB[:6], size=int(rng.integers(8, 14)), p=p).tolist()
        if "alpha" not in words:
            words[0] = "alpha"
        c.put(f"d{i:03d}", [" ".join(words)], _vec(rng, 1))
    return c, ()


@pytest.mark.parametrize("make", [_common_in_filtered, _common_by_chance])
@pytest.mark.parametrize("seed", range(4))
def test_hybrid_equals_exact_when_every_eligible_chunk_holds_a_query_term(make, seed):
    rng = np.random.default_rng(seed)
    c, flt = make(rng, int(rng.integers(220, 360)))  # > 64 eligible per shard: longer than the BM25 list
    word = "the" if make is _common_in_filtered else "alpha"
    eligible = [t for _, t, _, m in c.rows() if not flt or m.get("set") == "a"]
    assert eligible and all(word in t.split() for t in eligible)  # the case this is about
    certified = 0
    for q in range(12):
        qv = _vec(rng, 1)[0]
        others = rng.choice([w for w in VOCAB if w != word], size=int(rng.integers(1, 4))).tolist()
        text = " ".join([word, *others])
        top_k, cand = int(rng.integers(3, 9)), int(rng.choice([4, 8, 16]))
        wd, wl = (float(x) for x in rng.uniform(0.2, 1.5, size=2))
        spec = dict(top_k=top_k, candidates=cand, dense_weight=wd, lexical_weight=wl, filters=flt)
        got, info = c.retrieve(text, qv, mode="hybrid", **spec)
        want, _ = c.retrieve(text, qv, mode="full_hybrid", **spec)
        assert [h.chunk_id for h in got] == [h.chunk_id for h in want], (q, text, info.certified)
        np.testing.assert_allclose([h.score for h in got], [h.score for h in want], rtol=1e-12, atol=0)
        certified += bool(info.certified)
    assert certified >= 6  # (the equality above is not only from widening rounds run to the end)
