"""Installing a finished background BM25 merge (issue 13, inst16): the shard's request loop only
swaps references and does O(changes made during the merge) work; the per-segment parts
(per-term counts, the top-m's term bounds and wide rows) are built by the merge's thread, and
what the install replaces is freed by a thread of its own. Results stay those of a fresh index
of the same live chunks, bit for bit, across adds, removes and replaces during the merge."""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np
import pytest

from oprag_server.index import kernels_topm, kernels_wide
from oprag_server.index.bm25 import listed_top as lt
from oprag_server.index.bm25 import merging
from oprag_server.index.bm25.postings import PostingsIndex
from oprag_server.index.bm25.segment import Segment
from test_bm25_background_merge import gate  # noqa: F401 - the fixture: the merge thread waits for it
from test_topm_pruned import _full
from test_topm_wide import _stop_words

QUERIES = [["t0", "t1", "t2", "t77"], ["t3", "t0", "t500"], ["t1", "t9", "t9", "t1400"], ["t2", "nope", "t40"]]


@pytest.fixture(autouse=True)
def _pruned_paths(monkeypatch):
    monkeypatch.setattr(lt, "_FULL_BELOW", 0)  # small corpora: the pruned paths all the same


def _idf(ix, terms):
    df = np.array([max(ix.df(t), 1) for t in terms], np.float64)
    idf = np.log((len(ix) - df + 0.5) / (df + 0.5))
    return np.where(idf < 0, 0.4, idf)


def _queries(ix, wide=True):
    """listed_top of QUERIES (the wide-row path, or MaxScore's with its term bounds), checked
    against the kernel that reads every list."""
    old = lt._WIDE
    lt._WIDE = wide
    try:
        for terms in QUERIES:
            idf, avgdl = _idf(ix, terms), ix.total_len / len(ix)
            s, v, listed = lt.listed_top(ix, terms, idf, avgdl, 1.2, 0.75, 20)
            fs, fv, flisted = _full(ix, terms, idf, avgdl, 1.2, 0.75, 20)
            ref = dict(zip(fs.tolist(), fv.tolist()))
            assert all(ref[x] == y for x, y in zip(s.tolist(), v.tolist())) and listed == flisted
    finally:
        lt._WIDE = old


def _merge_with_writes(ix, docs, rng, gate):
    """A background merge of a delta, with adds, removes and replaces of segment and frozen
    chunks while it runs. :returns: {slot: tokens} of the live chunks."""
    live = {s: docs[s] for s in range(ix._live.size) if ix.has_slot(s)}
    ix.add_batch(list(range(1000, 1100)), docs[1000:1100])
    live.update({s: docs[s] for s in range(1000, 1100)})
    ix.merge(background=True)
    assert ix.merging and ix._pending[0].is_alive()
    for s in rng.choice(1000, 30, replace=False).tolist() + rng.choice(range(1000, 1100), 10, replace=False).tolist():
        if ix.has_slot(s):
            ix.remove(s)
            del live[s]
            if s % 2:  # replaced: the same slot again, in the new delta
                live[s] = docs[1100 + s % 100]
                ix.add_batch([s], [live[s]])
    ix.add_batch(list(range(1200, 1230)), docs[1100:1130])
    live.update({s: docs[s - 100] for s in range(1200, 1230)})
    _queries(ix)
    gate.set()
    ix._pending[0].join()
    return live


def _fresh(live):
    ix = PostingsIndex()
    slots = sorted(live)
    ix.add_batch(slots, [live[s] for s in slots])
    ix.merge()
    return ix


def test_install_builds_no_per_segment_part_on_the_loop(gate, monkeypatch):
    rng = np.random.default_rng(3)
    docs = _stop_words(rng, 1300)
    ix = PostingsIndex()
    ix.add_batch(list(range(1000)), docs[:1000])
    ix.merge()
    _queries(ix, wide=True)
    _queries(ix, wide=False)  # (MaxScore: the term bounds)
    sc = ix.__dict__["_topm_scratch"]
    bounded = [ix._seg.terms[t] for t in np.flatnonzero(~np.isnan(sc.bounds[0]))]
    rows = [ix._seg.terms[t] for t in np.flatnonzero(sc.wide.row_of >= 0) if sc.wide.state[sc.wide.row_of[t]] == 1]
    assert bounded and rows
    on_loop = []

    def watch(name, real):
        def w(*a, **k):
            if threading.current_thread() is threading.main_thread():
                on_loop.append(name)
            return real(*a, **k)
        return w

    monkeypatch.setattr(Segment, "df", watch("Segment.df", Segment.df))
    monkeypatch.setattr(kernels_wide, "fill_row", watch("fill_row", kernels_wide.fill_row))
    monkeypatch.setattr(kernels_topm, "_term_bounds", watch("_term_bounds", kernels_topm._term_bounds))
    live = _merge_with_writes(ix, docs, rng, gate)
    on_loop.clear()
    assert ix.poll_merge()
    assert on_loop == []  # nothing per segment at the install
    sc = ix.__dict__["_topm_scratch"]
    assert sc.seg is ix._seg and sc.wide.seg is ix._seg  # the new segment's, built by the merge thread
    vocab = ix._seg.vocab
    assert all(not np.isnan(sc.bounds[0][vocab[t]]) for t in bounded if t in vocab)
    assert all(sc.wide.state[sc.wide.row_of[vocab[t]]] == 1 for t in rows if sc.wide.row_of[vocab[t]] >= 0)
    _queries(ix, wide=True)
    assert "fill_row" not in on_loop  # the first queries after the install rebuilt no row
    ref = _fresh(live)
    for terms in QUERIES:
        idf, avgdl = _idf(ix, terms), ix.total_len / len(ix)
        a, b = ix.score_all(terms, idf, avgdl), ref.score_all(terms, idf, avgdl)
        assert a[0].tolist() == b[0].tolist() and a[1].tobytes() == b[1].tobytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_writes_during_the_merge_are_exact_after_the_install(gate, seed):
    rng = np.random.default_rng(seed)
    docs = _stop_words(rng, 1300)
    ix = PostingsIndex()
    ix.add_batch(list(range(1000)), docs[:1000])
    ix.merge()
    for s in rng.choice(1000, 20, replace=False).tolist():  # dead before the merge starts
        ix.remove(s)
    _queries(ix)
    live = _merge_with_writes(ix, docs, rng, gate)
    assert ix.poll_merge() and not ix.merging
    ref = _fresh(live)
    seg, where = ix._seg, ix._where
    # the per-term live counts and the dead postings, counted over the whole segment
    in_seg = np.isin(seg.doc_slots, np.flatnonzero(where == merging._SEG))
    alive = np.repeat(in_seg, np.diff(seg.doc_off))
    assert ix._seg_df.tolist() == np.bincount(seg.doc_terms[alive], minlength=len(seg.terms)).tolist()
    assert ix._seg_dead == int((~alive).sum()) > 0
    assert sorted(np.flatnonzero(ix._live).tolist()) == sorted(live)
    assert ix.full_stats() == ref.full_stats()
    for terms in QUERIES + [["t0"], ["t5", "t6", "t7"]]:
        idf, avgdl = _idf(ix, terms), ix.total_len / len(ix)
        a, b = ix.score_all(terms, idf, avgdl), ref.score_all(terms, idf, avgdl)
        assert a[0].tolist() == b[0].tolist() and a[1].tobytes() == b[1].tobytes()
        at = np.array(sorted(live), np.int64)
        assert ix.score(at, terms, idf, avgdl).tobytes() == ref.score(at, terms, idf, avgdl).tobytes()
    _queries(ix)
    ix.merge()  # the next merge drops what died during this one
    assert ix._seg_dead == 0 and ix._seg.doc_slots.tolist() == sorted(live)
    assert ix._seg.n_postings == ref._seg.n_postings


def test_replaced_parts_are_freed_off_the_loop(gate):
    rng = np.random.default_rng(7)
    docs = _stop_words(rng, 1300)
    ix = PostingsIndex()
    ix.add_batch(list(range(1000)), docs[:1000])
    ix.merge()
    _queries(ix)  # the scratch holds the segment, its bounds and rows
    freed = []
    weakref.finalize(ix._seg, lambda: freed.append(threading.current_thread().name))
    _merge_with_writes(ix, docs, rng, gate)
    assert ix.poll_merge()
    t = time.monotonic()
    while not freed and time.monotonic() - t < 5:
        time.sleep(0.01)
    assert freed == ["bm25-drop"]
