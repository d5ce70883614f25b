"""A BM25 merge reads the old segment's posting arrays and writes the new ones in blocks
(``seg_merge.BLOCK``), giving back the pages of an old array mapped from a file once read
(``seg_merge._release``; session 49: a 73M-posting merge made its whole old segment resident,
+0.69 GiB). The merged segment is checked against a reference built here from the live chunks'
tokens (every posting and the forward index) and its scores against rank_bm25 0.2.2 (``check``),
with blocks of a few values, so that every block edge case runs: chunks removed (their postings
left out block by block), terms left without postings, delta chunks below old ones, empty chunks."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from oprag_server.index import bm25 as B
from oprag_server.index.bm25 import seg_merge

from test_bm25_segments import check


def _index(rng, below: bool):
    """An index with a merged segment and a delta: removed chunks, a term only removed chunks held,
    empty chunks, and (``below``) delta chunks in slots below old ones (freed by removals)."""
    live: dict[int, tuple[list[str], int]] = {}
    ix = B.PostingsIndex()
    for s in range(0, 900):
        if s % 50 == 7:
            toks = []  # an empty chunk
        else:
            toks = [f"t{i}" for i in np.minimum(rng.zipf(1.4, int(rng.integers(1, 30))), 400) - 1]
        if s % 97 == 5:
            toks = toks + ["only-removed"]
        live[s] = (toks, 0)
    ix.add_batch(list(live), [t for t, _ in live.values()])
    ix.merge()
    for s in list(live):
        if s % 97 == 5 or s % 13 == 0:
            ix.remove(s)
            del live[s]
    fresh = [s for s in range(0, 900) if s % 13 == 0][:20] if below else list(range(900, 960))
    for s in fresh:
        toks = [f"t{i}" for i in np.minimum(rng.zipf(1.4, int(rng.integers(0, 25))), 450) - 1]
        ix.add(s, toks)
        live[s] = (toks, 0)
    return ix, live


def _reference(seg, live):
    """The segment's postings {term: [(slot, tf)]} and forward index {slot: sorted term ids' terms}, as the live
    chunks' tokens say they must be."""
    post, fwd = collections.defaultdict(list), {}
    for s in sorted(live):
        c = collections.Counter(live[s][0])
        for t, n in c.items():
            post[t].append((s, n))
        fwd[s] = sorted(c)
    return dict(post), fwd


def _contents(seg):
    post = {}
    for tid, t in enumerate(seg.terms):
        sl, tf = seg.postings(tid)
        post[t] = list(zip(sl.tolist(), tf.tolist()))
    fwd = {int(s): sorted(seg.terms[i] for i in seg.doc_term_ids(int(s)).tolist()) for s in seg.doc_slots}
    return post, fwd


@pytest.mark.parametrize("block", [3, 64, 1 << 22])
@pytest.mark.parametrize("below", [False, True])
@pytest.mark.parametrize("spill", [False, True])
def test_a_merge_in_blocks_holds_every_live_posting(tmp_path, monkeypatch, block, below, spill):
    monkeypatch.setattr(seg_merge, "BLOCK", block)
    ix, live = _index(np.random.default_rng(11 + below), below)
    where = ix._where  # noqa: SLF001 - what PostingsIndex._start_merge hands merge, without freezing
    key, tf = ix._delta.consolidated()  # noqa: SLF001
    frz = where == B.merging._DELTA  # noqa: SLF001
    m = frz[key & 0xFFFFFFFF]
    new = seg_merge.merge(ix.segment, where == B.merging._SEG, list(ix._delta.terms), key[m], tf[m],  # noqa: SLF001
                          np.flatnonzero(frz), out_dir=tmp_path / "out" if spill else None)
    want_post, want_fwd = _reference(new, live)
    got_post, got_fwd = _contents(new)
    assert got_post == want_post and "only-removed" not in new.terms
    assert got_fwd == want_fwd and new.doc_slots.tolist() == sorted(live)
    assert np.array_equal(new.offsets, np.concatenate([[0], np.cumsum([len(want_post[t]) for t in new.terms])]))
    ix.merge()  # (the index's own merge, blocks of the same size) against rank_bm25
    check([ix], live, ["t0", "t1", "t3", "t77", "only-removed"])


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


def test_release_gives_back_a_file_maps_pages_and_keeps_its_values(tmp_path):
    a = np.arange(8 << 20, dtype=np.int32)  # 32 MiB
    np.save(tmp_path / "a.npy", a)
    m = np.load(tmp_path / "a.npy", mmap_mode="r").view(np.ndarray)
    assert int(m.sum(dtype=np.int64)) == int(a.sum(dtype=np.int64))  # every page read: resident
    before = _rss_file()
    seg_merge._release(m, 0, m.size)  # noqa: SLF001
    after = _rss_file()
    assert before - after >= 24 << 20, (before, after)
    assert np.array_equal(m, a)  # read again from the page cache
    mem = a.copy()
    mem.flags.writeable = False
    seg_merge._release(mem, 0, mem.size)  # noqa: SLF001 - anonymous memory: left alone (DONTNEED would zero it)
    assert np.array_equal(mem, a)
    cow = np.load(tmp_path / "a.npy", mmap_mode="c")  # a copy-on-write map, changed, then read-only (review49)
    cow[:4] = -1
    ro = cow.view(np.ndarray)
    ro.flags.writeable = False
    seg_merge._release(ro, 0, ro.size)  # noqa: SLF001 - left alone: DONTNEED would undo the change
    assert ro[:4].tolist() == [-1, -1, -1, -1] and np.array_equal(ro[4:], a[4:])


def test_a_merge_over_a_mapped_segment_gives_its_pages_back_and_leaves_it_whole(tmp_path):
    """The old segment loaded from its snapshot files (read-only maps): after a merge that read all of it, its
    arrays hold their values and the shard holds few of their pages."""
    ix, live = _index(np.random.default_rng(5), False)
    ix.merge()
    ix.save(tmp_path / "snap")
    back = B.PostingsIndex.load(tmp_path / "snap", mmap=True)
    live = {i: live[s] for i, s in enumerate(sorted(live))}  # (a load numbers the chunks 0..n-1 in slot order)
    seg = back.segment
    copies = {n: np.array(getattr(seg, n)) for n in ("slots", "tf", "doc_terms")}
    touched = []
    real = seg_merge._release  # noqa: SLF001

    def spy(a, lo, hi):
        touched.append((a.size, lo, hi))
        return real(a, lo, hi)

    seg_merge._release = spy  # noqa: SLF001
    try:
        for s in list(live)[::7]:
            back.remove(s)
            del live[s]
        back.merge()
    finally:
        seg_merge._release = real  # noqa: SLF001
    for n, c in copies.items():
        assert np.array_equal(getattr(seg, n), c), n  # the old maps: values unchanged
    # every old posting array given back whole, block by block
    for n in ("slots", "tf", "doc_terms"):
        size = copies[n].size
        spans = sorted((lo, hi) for sz, lo, hi in touched if sz == size)
        assert spans and spans[0][0] == 0 and spans[-1][1] == size, n
    check([back], live, ["t0", "t1", "t3"])
