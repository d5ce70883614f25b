"""A snapshot gives the BM25 segment's files as hard links to the files the segment serves from
a map (index/bm25/files.py, ``Segment.save``): a spilled merge's files or the previous
snapshot's, when each path still names the file that was mapped; otherwise it writes them.
A destination is never truncated in place (it may be another directory's link). Real shards,
real files; scores against rank_bm25 0.2.2 (``check`` of test_bm25_segments)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from oprag_server.index import bm25 as B
from oprag_server.index.bm25 import files
from oprag_server.index.bm25.segment import _ARRAYS, Segment
from oprag_server.shards.state import ShardState

from test_bm25_idle_merge import _upsert
from test_bm25_segments import check
from test_merge_spill import _eventually, _spills

D = 8
NAMES = [f"{n}.npy" for n in _ARRAYS] + ["terms.json"]


def _ids(d: Path) -> dict[str, int]:
    return {n: os.stat(d / n).st_ino for n in NAMES}


def _postings_dir(root: Path) -> Path:
    [snap] = [p for p in root.rglob("snap-*") if p.is_dir()]
    return snap / "postings"


def _arrays(seg: Segment) -> list[np.ndarray]:
    return [np.array(getattr(seg, n)) for n in _ARRAYS]


def _segment(tmp_path: Path, n: int = 40) -> Segment:
    ix = B.PostingsIndex()
    ix.add_batch(list(range(n)), [[f"w{s}", "common", f"t{s % 3}"] for s in range(n)])
    ix.merge()
    return ix.segment


@pytest.fixture
def spill_all(monkeypatch):
    monkeypatch.setattr(B.PostingsIndex, "MERGE_MIN", 4)
    monkeypatch.setattr(B.PostingsIndex, "SPILL_MIN_BYTES", 0)
    monkeypatch.setattr(ShardState, "IDLE_QUIET_S", 0.0)


def test_a_snapshot_links_the_spilled_segment_and_a_restart_reads_it(tmp_path, spill_all):
    st = ShardState(0, D, tmp_path)
    toks = _upsert(st, 0, 80, 1)
    st.store.postings.merge()
    toks.update(_upsert(st, 80, 100, 2))
    p = st.store.postings
    if not p.merging:
        assert st.idle_wait() == 0.0
        st.idle_step()
    p.wait_merge()
    assert p.spills >= 1 and p.segment.unmapped_nbytes() == 0
    assert _eventually(lambda: len(_spills(tmp_path)) == 1)
    [spill] = (tmp_path / ".bm25-spill").iterdir()
    spilled = _ids(spill)
    st.snapshot()
    got = _postings_dir(tmp_path)
    assert _ids(got) == spilled  # the same files, not a second copy
    assert _eventually(lambda: _spills(tmp_path) == [])  # the spill's names go; the files stay
    assert os.stat(got / "slots.npy").st_nlink == 1
    restarted = ShardState(0, D, tmp_path)
    restarted.load()
    check([restarted.store.postings], {s: (t, 0) for s, t in toks.items()}, ["topic1", "chunk3", "the"])


def test_a_loaded_unchanged_segment_is_linked_by_the_next_snapshot(tmp_path):
    st = ShardState(0, D, tmp_path)
    toks = _upsert(st, 0, 50, 1)
    st.snapshot()
    first = _ids(_postings_dir(tmp_path))
    st2 = ShardState(0, D, tmp_path)
    st2.load()
    st2.store.postings.merge()  # (nothing to fold: the loaded segment stays)
    st2.snapshot()  # the old snapshot is swept after this one is live
    d = _postings_dir(tmp_path)
    assert _ids(d) == first
    st3 = ShardState(0, D, tmp_path)
    st3.load()
    check([st3.store.postings], {s: (t, 0) for s, t in toks.items()}, ["topic2", "chunk7", "the"])
    # a write adds chunks beside the segment: its files stay linked, the new chunks' postings go to delta.npz
    toks.update(_upsert(st3, 50, 60, 2))
    st3.snapshot()
    d = _postings_dir(tmp_path)
    assert (d / "delta.npz").exists() and all(_ids(d)[n] == first[n] for n in first)
    st4 = ShardState(0, D, tmp_path)
    st4.load()
    check([st4.store.postings], {s: (t, 0) for s, t in toks.items()}, ["topic2", "chunk57", "the"])
    # a delete changes the segment at the next snapshot's merge: its files are written anew
    st4.store.delete(["d3"], 3)
    del toks[3]
    st4.snapshot()
    d = _postings_dir(tmp_path)
    assert not (d / "delta.npz").exists() and set(_ids(d).values()).isdisjoint(first.values())
    st5 = ShardState(0, D, tmp_path)
    st5.load()
    live = {i: (t, 0) for i, t in enumerate(toks[s] for s in sorted(toks))}  # (a load numbers the chunks anew)
    check([st5.store.postings], live, ["topic2", "chunk57", "the", "chunk3"])


def test_a_replaced_source_file_is_written_not_linked(tmp_path):
    seg = _segment(tmp_path)
    seg.save(tmp_path / "a")
    m = Segment.load(tmp_path / "a")
    want = _arrays(m)
    # another file now at one source path (same bytes, another inode): not the mapped file
    (tmp_path / "a" / "tf.npy").rename(tmp_path / "tf.old")
    np.save(tmp_path / "a" / "tf.npy", np.zeros(3, np.uint16))
    m.save(tmp_path / "b")
    ids_a, ids_b = _ids(tmp_path / "a"), _ids(tmp_path / "b")
    assert ids_b["tf.npy"] != ids_a["tf.npy"] and ids_b["slots.npy"] == ids_a["slots.npy"]
    for x, y in zip(want, _arrays(Segment.load(tmp_path / "b"))):
        np.testing.assert_array_equal(x, y)


def test_no_links_means_copies_and_a_destination_is_never_truncated(tmp_path, monkeypatch):
    seg = _segment(tmp_path)
    seg.save(tmp_path / "a")
    m = Segment.load(tmp_path / "a")
    before = {n: (tmp_path / "a" / n).read_bytes() for n in NAMES}
    m.save(tmp_path / "b")  # links
    assert _ids(tmp_path / "b") == _ids(tmp_path / "a")
    # another segment saved over "b" (a directory holding links to "a"): "a" keeps its bytes
    other = _segment(tmp_path, 7)
    other.save(tmp_path / "b")
    assert {n: (tmp_path / "a" / n).read_bytes() for n in NAMES} == before
    for x, y in zip(_arrays(other), _arrays(Segment.load(tmp_path / "b"))):
        np.testing.assert_array_equal(x, y)
    # a file system without hard links: every file written, the same values
    monkeypatch.setattr(files.os, "link", lambda *a: (_ for _ in ()).throw(OSError(1, "no links")))
    m.save(tmp_path / "c")
    assert set(_ids(tmp_path / "c").values()).isdisjoint(_ids(tmp_path / "a").values())
    for x, y in zip(_arrays(m), _arrays(Segment.load(tmp_path / "c"))):
        np.testing.assert_array_equal(x, y)


def test_only_a_mapped_segment_links(tmp_path):
    seg = _segment(tmp_path)
    assert "_source" not in seg.__dict__
    seg.save(tmp_path / "x")
    copy = Segment.load(tmp_path / "x", mmap=False)  # read into memory: nothing to link to
    assert "_source" not in copy.__dict__
    copy.save(tmp_path / "y")
    assert set(_ids(tmp_path / "y").values()).isdisjoint(_ids(tmp_path / "x").values())
    assert Segment.load(tmp_path / "x").__dict__["_source"][0] == tmp_path / "x"


def test_an_exit_right_after_a_snapshot_waits_for_the_memory_drop(tmp_path):
    """The previous mapping is freed on a thread of its own (snapjob ``_drop``); a daemon thread
    inside Arrow's destructor at the interpreter's exit aborted the process (exit 134, seen right
    after a snapshot that linked its files). The exit now waits for it: its last step runs."""
    import subprocess
    import sys
    import textwrap

    marker = tmp_path / "dropped"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = {[str(Path(__file__).parent)]!r}
        from oprag_server.shards import snapjob
        from oprag_server.shards.state import ShardState
        from test_bm25_idle_merge import _upsert
        real = snapjob._drop
        def slow(parts):
            time.sleep(0.5)
            real(parts)
            open({str(marker)!r}, "w").close()
        snapjob._drop = slow
        from pathlib import Path
        st = ShardState(0, 8, Path({str(tmp_path / "data")!r}))
        _upsert(st, 0, 30, 1)
        st.snapshot()
        _upsert(st, 30, 40, 2)
        st.snapshot()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert marker.exists()


def test_a_renumbered_segment_is_linked_by_the_next_snapshot_while_unchanged(tmp_path):
    """trial53 #5: after a delete the live chunks' slots have gaps, so a snapshot writes the segment renumbered (a
    copy, not the arrays served). Every later snapshot renumbered and wrote it again, also one only session turns
    caused; now the renumbered files of the last complete snapshot are linked while the segment is the same."""
    from oprag_server.shards.protocol import PromoteRequest

    st = ShardState(0, D, tmp_path)
    st.load(set())
    toks = _upsert(st, 0, 60, 1)
    st.store.delete([f"d{i}" for i in range(0, 60, 3)], 2)  # (the snapshot's merge folds them: slots with gaps)
    st.snapshot()
    first = _ids(_postings_dir(tmp_path))
    lens = os.stat(_postings_dir(tmp_path) / "doc_len.npy").st_ino
    for sid in ("a", "b"):  # snapshots that only session turns cause
        st.memory.promote(PromoteRequest(session_id=sid, question="q", summary="s", chunk_ids=[], titles=[],
                                         vector=np.ones(D, np.float32) / np.sqrt(D), max_turns=4))
        st.snapshot()
        assert _ids(_postings_dir(tmp_path)) == first
        assert os.stat(_postings_dir(tmp_path) / "doc_len.npy").st_ino == lens  # (trial53b #1: written each time)
    st.txns.wal.close()
    live = {s: t for s, t in toks.items() if s % 3}
    again = ShardState(0, D, tmp_path)
    again.load()  # (a load numbers the live chunks 0..n-1 in slot order)
    check([again.store.postings], {i: (live[s], 0) for i, s in enumerate(sorted(live))}, ["topic1", "chunk4", "the"])
    assert len(again.memory) == 2
    again.snapshot()  # the loaded segment is mapped from those files: linked as it is
    assert _ids(_postings_dir(tmp_path)) == first
    again.store.delete(["d1"], 3)  # a write: a new segment, new files
    again.snapshot()
    assert set(_ids(_postings_dir(tmp_path)).values()).isdisjoint(first.values())
