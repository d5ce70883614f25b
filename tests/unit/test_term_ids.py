"""BM25 term ids from Arrow columns (:mod:`oprag_server.index.term_ids`): the compiled ASCII pass
and the analyser path give exactly :meth:`Analyzer.tokens` of ``title\\ntext`` on varied text
(ASCII punctuation and control characters, Unicode letters, marks, CJK, default-ignorables,
full-width forms, nulls, sliced and chunked columns, blocks, table growth); the delta and the
postings built from the ids equal the ones built from the strings, and score as rank_bm25."""

from __future__ import annotations

import random
import re

import numpy as np
import pyarrow as pa
import pytest
from rank_bm25 import BM25Okapi

from oprag_server.index.analyzer import Analyzer
from oprag_server.index.bm25 import CorpusStats, PostingsIndex
from oprag_server.index.bm25.delta import Delta
from oprag_server.index.term_ids import TermTable, take_rows

_ASCII = [chr(c) for c in range(128)]
_UNI = list("éÉßİıﬁＡＢｃ１２ΩωЖж東京都ひらがなカタカナ한국어ｶﾀ\u0301\u0308\u200b\u00ad\u2060\ufeff\u0915\u093f"
            "\U0001f600\U00020000_-–—’“”\u3000\u00a0")
_WORDS = ["the", "Quick", "BROWN", "fox", "a1b2", "x" * 70, "Zebra", "9", "über", "naïve"]


def _text(rng: random.Random, uni: float) -> str:
    parts = []
    for _ in range(rng.randint(0, 40)):
        r = rng.random()
        if r < 0.5:
            parts.append(rng.choice(_WORDS))
        elif r < 0.5 + uni:
            parts.append("".join(rng.choice(_UNI) for _ in range(rng.randint(1, 4))))
        else:
            parts.append("".join(rng.choice(_ASCII) for _ in range(rng.randint(1, 6))))
    return "".join(p + rng.choice([" ", "", ".", "\n", "\t", "_", "\x1f"]) for p in parts)


def _rows(rng: random.Random, n: int, uni: float):
    titles = [rng.choice([None, "", _text(rng, uni)[:30]]) for _ in range(n)]
    texts = [_text(rng, uni) for _ in range(n)]
    return titles, texts


def _expected(titles, texts, an):
    return [an.tokens(f"{t}\n{x}" if t else x) for t, x in zip(titles, texts)]


def _decode(tt: TermTable, gids, lens):
    out, k = [], 0
    for n in lens.tolist():
        out.append([tt.term(g) for g in gids[k:k + n].tolist()])
        k += n
    return out


@pytest.mark.parametrize("uni", [0.0, 0.05, 0.4])
@pytest.mark.parametrize("stem", [False, True])
def test_tokens_equal_the_analyzer(uni, stem):
    rng = random.Random(int(uni * 100) + stem)
    tt, an = TermTable(stem=stem), Analyzer(stem=stem)
    for _ in range(6):
        titles, texts = _rows(rng, 300, uni)
        gids, lens = tt.rows(pa.table({"title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.string())}))
        assert gids.dtype == np.int64 and lens.dtype == np.int64 and lens.size == 300
        assert int(lens.sum()) == gids.size
        assert _decode(tt, gids, lens) == _expected(titles, texts, an)


def test_one_term_one_gid_whichever_path():
    tt = TermTable()
    t = pa.table({"title": ["", "x é"], "text": ["Fox fox THE", "the fox"]})
    gids, lens = tt.rows(t)
    assert lens.tolist() == [3, 4]
    fox, the = gids[0], gids[2]
    assert gids[1] == fox and gids.tolist()[3:] == [gids[3], gids[4], the, fox]
    assert tt.term(gids[4]) == "é" and len(tt) == 4 and len(set(gids.tolist())) == 4
    # new terms from the analyser path, then met by the compiled pass
    g2, _ = tt.rows(pa.table({"title": ["é"], "text": ["ünïcode word"]}))
    g3, _ = tt.rows(pa.table({"title": [None], "text": ["word Word WORD"]}))
    assert g3.tolist() == [g2[-1]] * 3


def test_sliced_chunked_blocks_and_growth():
    rng = random.Random(7)
    titles, texts = _rows(rng, 3000, 0.02)
    texts[5] = "y" * 5000 + " " + " ".join(f"w{i}" for i in range(40000))  # growth: terms, pool, table
    full = pa.table({"title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.string())})
    chunked = pa.concat_tables([full.slice(0, 1000), full.slice(1000, 1500), full.slice(2500)])
    want = _expected(titles, texts, Analyzer())
    for table, rows in ((full, want), (full.slice(17, 900), want[17:917]), (chunked, want)):
        tt = TermTable()
        tt.BLOCK = 4096  # many compiled passes, rows longer than a pass
        gids, lens = tt.rows(table)
        assert _decode(tt, gids, lens) == rows


def test_a_pass_stops_when_the_table_is_half_full_and_goes_on():
    """Many new terms in short rows: the compiled pass stops before a row that could fill the
    table past half (or its gid arrays), the table grows, the pass goes on from that row."""
    texts = [" ".join(f"t{r}x{k}" for k in range(30)) for r in range(3000)]  # 90,000 new terms
    tt = TermTable()
    sizes = []
    grow = tt._room

    def spy(*a):
        grow(*a)
        sizes.append(tt._ent.shape[0])
    tt._room = spy
    gids, lens = tt.rows(pa.table({"title": pa.array([None] * 3000, pa.string()), "text": texts}))
    assert len(tt) == 90_000 and 2 * len(tt) <= tt._ent.shape[0] and len(set(sizes)) > 2
    assert lens.tolist() == [30] * 3000 and gids.tolist() == list(range(90_000))
    assert tt.term(89_999) == "t2999x29"


def test_empty_table_and_empty_rows():
    tt = TermTable()
    g, n = tt.rows(pa.table({"title": pa.array([], pa.string()), "text": pa.array([], pa.string())}))
    assert g.size == 0 and n.size == 0
    g, n = tt.rows(pa.table({"title": [None, "", "..."], "text": ["", "!!", "\u200b"]}))
    assert g.size == 0 and n.tolist() == [0, 0, 0]


def test_take_rows():
    gids, lens = np.arange(10, dtype=np.int64), np.array([3, 0, 4, 3], np.int64)
    g, n = take_rows(gids, lens, [0, 2])
    assert g.tolist() == [0, 1, 2, 3, 4, 5, 6] and n.tolist() == [3, 4]
    g, n = take_rows(gids, lens, [1, 3])
    assert g.tolist() == [7, 8, 9] and n.tolist() == [0, 3]


def _same_delta(a: Delta, b: Delta):
    assert a.vocab == b.vocab and a.terms == b.terms and list(a.vocab) == list(b.vocab)
    assert len(a.runs) == len(b.runs)
    for (k1, t1), (k2, t2) in zip(a.runs, b.runs):
        assert np.array_equal(k1, k2) and np.array_equal(t1, t2) and t1.dtype == t2.dtype
    assert a.docs.keys() == b.docs.keys() and all(np.array_equal(a.docs[s], b.docs[s]) for s in a.docs)
    assert np.array_equal(a.df_arr[: len(a.terms)], b.df_arr[: len(b.terms)]) and a.n == b.n


def test_delta_from_ids_equals_delta_from_strings():
    rng = random.Random(3)
    tt, an = TermTable(), Analyzer()
    by_str, by_id = Delta(), Delta()
    slot = 0
    for i in range(8):
        titles, texts = _rows(rng, 120, 0.1)
        gids, lens = tt.rows(pa.table({"title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.string())}))
        slots = list(range(slot, slot + 120))
        slot += 120
        if i == 3:  # a mix: some batches by strings into the id-built delta too
            u1, c1 = by_id.add_batch(slots, _expected(titles, texts, an))
        else:
            u1, c1 = by_id.add_ids(slots, gids, lens, tt)
        u2, c2 = by_str.add_batch(slots, _expected(titles, texts, an))
        assert np.array_equal(u1, u2) and np.array_equal(c1, c2)
        for s in slots[::17]:
            by_id.remove(s)
            by_str.remove(s)
        _same_delta(by_id, by_str)


def test_postings_from_ids_score_as_rank_bm25():
    rng = random.Random(11)
    titles, texts = _rows(rng, 400, 0.2)
    an, tt = Analyzer(), TermTable()
    corpus = _expected(titles, texts, an)
    gids, lens = tt.rows(pa.table({"title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.string())}))
    ours, ref = PostingsIndex(), PostingsIndex()
    ours.add_ids(list(range(400)), gids, lens, tt)
    ref.add_batch(list(range(400)), corpus)
    assert ours.drain_delta() == ref.drain_delta()
    ours.merge()
    stats = CorpusStats(*ours.full_stats())
    bm = BM25Okapi(corpus)
    slots = np.arange(400, dtype=np.int64)
    for q in (["the", "fox"], ["quick", "über", "東京"], ["zebra", "9", "nothing"]):
        if not any(q_t in stats.df for q_t in q):
            continue
        idf = stats.query_idf(q)
        got = ours.score(slots, q, idf, stats.avgdl)
        want = bm.get_scores(q)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), q


def test_postings_add_ids_checks_slots():
    tt = TermTable()
    gids, lens = tt.rows(pa.table({"title": [None, None], "text": ["a b", "c"]}))
    p = PostingsIndex()
    with pytest.raises(ValueError):
        p.add_ids([0], gids, lens, tt)
    p.add_ids([0, 1], gids, lens, tt)
    with pytest.raises(ValueError):
        p.add_ids([1, 2], gids, lens, tt)
    assert len(p) == 2 and p.df("a") == 1 and p.df("c") == 1


def test_drained_statistics_add_up_to_the_index():
    """drain_delta after adds only (built in one step, no filtering) and after removes and re-adds
    (zero net counts dropped): never a zero count, and the drains add up to full_stats."""
    rng = random.Random(5)
    tt, p = TermTable(), PostingsIndex()
    total, live, slot = {}, [], 0
    n = length = 0
    for step in range(12):
        titles, texts = _rows(rng, 40, 0.1)
        gids, lens = tt.rows(pa.table({"title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.string())}))
        if step % 3 == 2:
            for s in rng.sample(live, 15):
                p.remove(s)
                live.remove(s)
        p.add_ids(list(range(slot, slot + 40)), gids, lens, tt)
        live += range(slot, slot + 40)
        slot += 40
        dn, dl, df = p.drain_delta()
        assert 0 not in df.values()
        n, length = n + dn, length + dl
        for t, d in df.items():
            total[t] = total.get(t, 0) + d
        assert p.drain_delta() == (0, 0, {})
    assert (n, length, {t: v for t, v in total.items() if v}) == p.full_stats()


class _Counting:
    """An analyser that records the texts it is asked for."""

    def __init__(self) -> None:
        self.inner, self.stem, self.asked = Analyzer(), False, []

    def tokens(self, text):
        self.asked.append(text)
        return self.inner.tokens(text)


def test_non_ascii_rows_go_word_by_word():
    """A row with non-ASCII bytes: only its words (runs between ASCII whitespace) that hold such a
    byte reach the analyser, once per distinct word while the cache holds it; the tokens are the
    whole row's analysis, also where NFKC composes (a combining mark after an ASCII letter), a
    default-ignorable joins two ASCII halves, a mark follows whitespace, or a non-ASCII space or
    punctuation splits a word."""
    titles = ["Café x", None, "", "ΣΑΣ title", "a"]
    texts = ["the Cafe\u0301 and naïve\tcafé\ncafe", "wiki\u200bpedia wiki pedia \u0301x y\u0301",
             "a\u00a0b c\u3000d e—f g.h ＡＢＣ abc 東京都 東京", "İstanbul ﬁsh fish x_y", "plain ascii row"]
    table = pa.table({"title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.string())})
    tt = TermTable()
    tt.analyzer = counting = _Counting()
    gids, lens = tt.rows(table)
    assert _decode(tt, gids, lens) == _expected(titles, texts, Analyzer())
    words = {w for t, x in zip(titles, texts) for w in re.split(r"[ \t\n\v\f\r]+", f"{t or ''} {x}")
             if not w.isascii()}  # (not str.split: U+00A0 and U+3000 stay inside a word)
    assert sorted(counting.asked) == sorted(words)  # word by word, each once
    assert "plain" not in " ".join(counting.asked) and "the" not in counting.asked
    counting.asked.clear()
    g2, l2 = tt.rows(table)  # the same words again: from the cache, the same gids
    assert counting.asked == [] and g2.tolist() == gids.tolist() and l2.tolist() == lens.tolist()
    assert _kept_bytes(tt) == sum(len(k) + 8 * v.size + 180 for k, v in tt._word_gids.items()) > 0  # counted
    # a batch that would fill the cache clears it: its words (new ones and cached ones) analysed
    # anew, the same gids as the whole rows' analysis
    tt.WORD_CACHE = len(words) + 1
    more = pa.table({"title": ["Ünïcode"], "text": ["naïve x café ünïcode\u0301 ｆｕｌｌ"]})
    g3, l3 = tt.rows(more)
    assert _decode(tt, g3, l3) == [Analyzer().tokens("Ünïcode\nnaïve x café ünïcode\u0301 ｆｕｌｌ")]
    assert sorted(tt._word_gids) == sorted(w.encode() for w in ["Ünïcode", "naïve", "café", "ünïcode\u0301", "ｆｕｌｌ"])
    assert tt.rows(table)[0].tolist() == gids.tolist()
    assert _kept_bytes(tt) == sum(len(k) + 8 * v.size + 180 for k, v in tt._word_gids.items())  # after a clear


def _kept_bytes(tt: TermTable) -> int:
    return tt.nbytes() - int(tt._ent.nbytes + tt._off.nbytes + tt._pool.nbytes + tt._low.nbytes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_batch_add_equals_the_numpy_path(seed):
    """Delta._add_rows (compiled: a sort per chunk, a counting sort by term id) builds exactly the
    runs, per-chunk term lists, df and return value of the numpy path (_add_np), batch after
    batch, with empty chunks, repeated tokens and gaps in the slots; slots that do not ascend take
    the numpy path."""
    rng = np.random.default_rng(seed)
    a, b = Delta(), Delta()
    slot = 0
    for _ in range(6):
        B = int(rng.integers(1, 60))
        lens = rng.integers(0, 40, B).astype(np.int64)
        T = len(a.terms) + int(rng.integers(0, 30))
        for d in (a, b):
            d.terms.extend(f"t{i}" for i in range(len(d.terms), T))
        flat = (rng.zipf(1.5, int(lens.sum())) % max(T, 1)).astype(np.int64)
        slots = slot + np.cumsum(rng.integers(1, 4, B)).astype(np.int64)
        slot = int(slots[-1])
        ua, ca = a._add_tids(slots.tolist(), flat, lens)
        ub, cb = b._add_np(slots, flat, lens)
        assert ua.tolist() == ub.tolist() and ca.tolist() == cb.tolist()
        assert len(a.runs) == len(b.runs)
        for (ka, ta), (kb, tb) in zip(a.runs, b.runs):
            assert ka.tolist() == kb.tolist() and ta.tolist() == tb.tolist() and ta.dtype == tb.dtype
        assert sorted(a.docs) == sorted(b.docs)
        assert all(a.docs[s].tolist() == b.docs[s].tolist() for s in a.docs)
        assert a.df_arr[:T].tolist() == b.df_arr[:T].tolist() and a.n == b.n and a.nbytes() == b.nbytes()
    c = Delta()
    c.terms.extend(["x", "y"])
    c._add_tids([5, 3], np.array([1, 0, 1], np.int64), np.array([2, 1], np.int64))  # not ascending
    assert c.docs[5].tolist() == [0, 1] and c.docs[3].tolist() == [1]
    assert c.runs[0][0].tolist() == [5, (1 << 32) | 3, (1 << 32) | 5]


def test_merged_runs_equal_a_stable_argsort():
    """Two runs merged in one pass: the stable argsort of their concatenation (equal keys: the
    first run's first), tf of either width."""
    from oprag_server.index.bm25.delta import _merge_runs

    rng = np.random.default_rng(5)
    for n1, n2 in ((0, 0), (0, 5), (7, 0), (50, 30), (1000, 3)):
        k1, k2 = np.sort(rng.integers(0, 40, n1)), np.sort(rng.integers(0, 40, n2))
        t1, t2 = rng.integers(0, 9, n1).astype(np.int32), rng.integers(10, 19, n2).astype(np.int64)
        k, t = _merge_runs(k1, t1, k2, t2)
        order = np.argsort(np.concatenate([k1, k2]), kind="stable")
        assert k.tolist() == np.concatenate([k1, k2])[order].tolist()
        assert t.tolist() == np.concatenate([t1, t2])[order].tolist() and t.dtype == np.int64


def test_merge_positions_equal_searchsorted():
    """segment._positions (the merge's chunk position of each delta posting): a table over a
    dense slot range, the binary search over a sparse one; both equal np.searchsorted."""
    from oprag_server.index.bm25.seg_merge import _positions

    rng = np.random.default_rng(9)
    for n, spread in ((1, 1), (500, 1), (500, 3), (300, 10_000), (2000, 2)):
        slots = np.unique(rng.integers(0, n * spread, n) + 7 * spread).astype(np.int64)
        probe = rng.choice(slots, 3 * n)
        assert _positions(slots, probe).tolist() == np.searchsorted(slots, probe).tolist()
    assert _positions(np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0
    dense, out = np.arange(10, 20, dtype=np.int64), np.array([12, 3, 25, 19], np.int64)  # outside: the search
    assert _positions(dense, out).tolist() == np.searchsorted(dense, out).tolist()
