"""Huge pages under FAISS's HNSW buffers (:mod:`oprag_server.index.hugepages`,
:func:`oprag_server.index.dense_low.huge_pages`): the 2 MB-aligned span, that the kernel's
pages under the buffer really become huge ones (read back from ``/proc/self/smaps``), and that
the index answers the same afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from oprag_server.config import DenseConfig
from oprag_server.index import hugepages
from oprag_server.index.ann import AnnIndex
from oprag_server.index.dense_low import LowSeeds, _level0, huge_pages

MB2 = 1 << 21


def test_span_is_the_whole_huge_pages_inside():
    assert hugepages.span(0, 3 * MB2) == (0, 3 * MB2)
    assert hugepages.span(1, 3 * MB2) == (MB2, 2 * MB2)  # [1, 3 MB2 + 1) holds pages 1 and 2 whole
    assert hugepages.span(MB2 - 1, MB2 + 1) == (MB2, MB2)
    assert hugepages.span(5, MB2) == (MB2, 0)
    assert hugepages.span(7 * MB2 + 3, 4 * MB2) == (8 * MB2, 3 * MB2)


def _thp_mode() -> str:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not p.exists():
        return "none"
    return p.read_text().split("[")[1].split("]")[0]


def _smaps(a: np.ndarray) -> tuple[int, bool]:
    """``(AnonHugePages kB, every one marked MADV_HUGEPAGE)`` of the mappings overlapping the
    whole 2 MB pages of ``a``'s buffer."""
    lo, n = hugepages.span(int(a.ctypes.data), a.nbytes)
    tot, on, flagged = 0, False, True
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            s, e = (int(v, 16) for v in head.split("-"))
            on = s < lo + n and e > lo
        elif on and line.startswith("AnonHugePages:"):
            tot += int(line.split()[1])
        elif on and line.startswith("VmFlags:"):
            flagged &= " hg" in line
    return tot, flagged


def _huge_kb(a: np.ndarray) -> int:
    return _smaps(a)[0]


def _all_huge(a: np.ndarray) -> bool:
    """Every whole 2 MB page of ``a`` is huge, asking the kernel to collapse again up to three times: a
    collapse that reported success has once left 2 of 12 MB split when smaps was read (a CI run at
    load ~8), and the kernel may split pages again under pressure. A skip, not a pass, where it still
    cannot. Some pages must be huge already (what the caller's own collapse did)."""
    whole = hugepages.span(int(a.ctypes.data), a.nbytes)[1] // 1024
    assert _huge_kb(a) > 0, "no page was collapsed before asking again"
    for _ in range(3):
        if _huge_kb(a) >= whole > 0:
            return True
        if not hugepages.advise(a, collapse=True):
            pytest.skip("the kernel could collapse only part of the pages now")
    if _huge_kb(a) >= whole > 0:
        return True
    pytest.skip("the kernel split part of the pages again after MADV_COLLAPSE reported success")


needs_thp = pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")


def _ann(n: int, dim: int = 96, m: int = 16) -> tuple[AnnIndex, np.ndarray]:
    rng = np.random.default_rng(3)
    vecs = rng.standard_normal((n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ann = AnnIndex(dim, DenseConfig(kind="hnsw", hnsw_m=m, ef_construction=40))
    slots = np.arange(n, dtype=np.int64)
    ann.add(slots, vecs, (slots, vecs))
    return ann, vecs


@needs_thp
def test_seeds_build_collapses_the_graph_it_walks():
    # first in this file: glibc may hand a later test a buffer in memory an earlier one advised
    ann, vecs = _ann(36_000)  # level-0 lists >= 4 MB, so they hold a whole 2 MB page wherever they lie
    low = LowSeeds()
    low.prepare(ann)  # the build, as Searcher.warm
    st = ann.storage()
    assert _smaps(st)[1] and _smaps(_level0(ann._index)[0])[1]  # noqa: SLF001
    if not _huge_kb(st):
        pytest.skip("the kernel could not collapse the pages now")
    assert _all_huge(st)  # the build collapsed some pages; the rest may need another try (ENOMEM: a skip)


@needs_thp
def test_collapse_puts_huge_pages_under_the_hnsw_buffers():
    ann, vecs = _ann(36_000)  # storage 13.8 MB, level-0 lists 4.6 MB (>= 4 MB: a whole 2 MB page wherever malloc puts it)
    st, nbr = ann.storage(), _level0(ann._index)[0]  # noqa: SLF001
    q = vecs[:20] + np.float32(0.01)
    before = ann.search(q, 10, 64)
    took = huge_pages(ann, collapse=True)
    assert _smaps(st)[1] and _smaps(nbr)[1]  # MADV_HUGEPAGE on both
    if not took:  # MADV_COLLAPSE needs free huge pages now (EAGAIN retried; ENOMEM under pressure)
        pytest.skip("the kernel could not collapse the pages now")
    # every whole 2 MB page of the storage is huge now (a malloc'd C++ buffer gets none unasked)
    assert _all_huge(st) and _all_huge(nbr)
    after = ann.search(q, 10, 64)
    for x, y in zip(before, after):
        assert np.array_equal(x, y)
    np.testing.assert_array_equal(ann.storage(), vecs)


def test_small_buffers_and_empty_index_are_left_alone():
    assert not hugepages.advise(np.zeros(1000, np.float32))  # no whole 2 MB page in it
    assert not hugepages.advise(np.zeros((64, 64), np.float32)[:, ::2])  # not contiguous
    ann = AnnIndex(8, DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40))
    assert not huge_pages(ann, collapse=True)


@pytest.mark.parametrize("rows", [3, 40_000])
def test_grown_copies_the_rows_and_zeroes_the_rest(monkeypatch, rows):
    """hugepages.grown (a shard's float32 copy growing): the rows at the start, zeros after, dtype kept; from
    GROW_QUIET bytes on the numpy switch is back on afterwards and the pages are folded into huge ones by a thread."""
    import threading

    monkeypatch.setattr(hugepages, "GROW_QUIET", 8 << 20)
    src = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    out = hugepages.grown(src, 2 * rows + 5)
    for t in [t for t in threading.enumerate() if t.name == "oprag-hugepages"]:
        t.join()
    assert out.shape == (2 * rows + 5, 96) and out.dtype == np.float32 and out.flags.c_contiguous
    assert np.array_equal(out[:rows], src) and not out[rows:].any()
    assert hugepages._numpy_asks(True)  # (left as it was: on)
    if src.nbytes >= 8 << 20 and _thp_mode() in ("always", "madvise"):
        kb, flagged = _smaps(out)
        assert flagged  # asked for: MADV_HUGEPAGE on the mapping
        if not kb:
            pytest.skip("the kernel could not collapse the pages now")
