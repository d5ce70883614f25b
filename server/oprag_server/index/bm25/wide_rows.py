"""A segment's wide-term rows (:class:`WideRows`, :mod:`..kernels_wide`) and what the BM25 top-m
pass (:func:`..kernels_wide_keep.wide_pass`) takes with them: the rows' block bounds
(:func:`bounds`) and a starting threshold (:func:`start`). Kept per shard by
:class:`.listed_top._Scratch`; built ahead by :mod:`.wide_warm`."""

from __future__ import annotations

import numpy as np

#: the wide pass skips the blocks whose upper bound is below its threshold; False: it scores every block
SKIP = True


class WideRows:
    """One segment's dense tf rows of its wide terms (:mod:`..kernels_wide`): ``row_of[t]`` is
    term t's row (-1: not wide), ``state[r]`` 0 unbuilt / 1 built / 2 unusable (a tf > 255);
    per row and block of :data:`..kernels_wide.SUB` slots its largest tf (``bmax`` uint8[R, G])
    and tf / dl (``bratio`` float32[R, G]), the pass's block bounds."""

    def __init__(self, seg, doc_len) -> None:
        from .. import kernels_wide  # noqa: PLC0415

        self.seg = seg
        self.span = int(seg.doc_slots[-1]) + 1 if seg.doc_slots.size else 0
        lens = np.diff(np.asarray(seg.offsets, np.int64))
        ids = np.flatnonzero(lens >= max(self.span // kernels_wide.WIDE_DIV, 1))
        self.row_of = np.full(lens.size, -1, np.int64)
        self.row_of[ids] = np.arange(ids.size)
        self.rows = np.zeros((ids.size, self.span), np.uint8)  # calloc'd: untouched rows cost nothing
        self.state = np.zeros(ids.size, np.int8)
        g = -(-self.span // kernels_wide.SUB)  # each row's largest tf and tf / dl per block (fill_row)
        self.bmax, self.bratio = np.zeros((ids.size, g), np.uint8), np.zeros((ids.size, g), np.float32)
        # the segment chunks' lengths (fixed while they are in it): uint16 when every one is an
        # integer below 65,536 (a quarter of the bytes the pass streams), else float32
        dl = np.asarray(doc_len[: self.span])
        small = bool(dl.size == 0 or (dl.max() < 65536 and np.array_equal(dl, np.floor(dl))))
        self.seg_len = dl.astype(np.uint16) if small else dl.astype(np.float32)

    def lookup(self, tids: np.ndarray) -> np.ndarray:
        """int64[P]: the row of each query position's segment term (-1: not wide, or no term)."""
        r = np.full(tids.size, -1, np.int64)
        on = (tids >= 0) & (tids < self.row_of.size)
        r[on] = self.row_of[tids[on]]
        return r

    def positions(self, tids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """``(is_wide bool[P], row int64[P], wide postings)`` of a query, building rows first used."""
        from .. import kernels_wide  # noqa: PLC0415

        row = self.lookup(tids)
        for i in np.flatnonzero(row >= 0).tolist():
            r = int(row[i])
            if self.state[r] == 0:
                ok = kernels_wide.fill_row(self.rows, self.bmax, self.bratio, r, int(tids[i]), self.seg.offsets,
                                           self.seg.slots, self.seg.tf, self.seg_len)
                self.state[r] = 1 if ok else 2
        is_wide = row >= 0
        is_wide[is_wide] = self.state[row[is_wide]] == 1
        t = tids[is_wide]
        return is_wide, row, int((self.seg.offsets[t + 1] - self.seg.offsets[t]).sum())

    def nbytes(self) -> int:
        """Bytes held by the built rows (resident), the segment lengths and the block bounds."""
        return int((self.state == 1).sum()) * self.span + self.seg_len.nbytes + self.bmax.nbytes + self.bratio.nbytes


def bounds(w: WideRows) -> tuple[np.ndarray, np.ndarray]:
    """``(bmax, bratio)`` of :func:`..kernels_wide_keep.wide_pass` for ``w``'s rows (none: ``SKIP`` False)."""
    if SKIP:
        return w.bmax, w.bratio
    from ..kernels_wide import _NO_BOUNDS  # noqa: PLC0415 - numba only in processes that score

    return _NO_BOUNDS


def start(at_scores: np.ndarray | None, m: int) -> float:
    """The wide pass's starting threshold: the m-th largest of ``at_scores`` (float64[C], the exact
    BM25 scores of C distinct live chunks: the dense candidates'), less the pass's slack
    (:data:`..kernels_wide._APPROX`), a lower bound of the m-th largest approximate score of the
    shard (m distinct chunks score at least it); 0.0 (none) with fewer than m."""
    from ..kernels_wide import _APPROX  # noqa: PLC0415 - numba only in processes that score

    if at_scores is None or at_scores.size < m:
        return 0.0
    return max(float(np.partition(at_scores, at_scores.size - m)[at_scores.size - m]), 0.0) * (1.0 - _APPROX)
