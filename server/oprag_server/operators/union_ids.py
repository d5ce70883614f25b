"""The chunk ids of the dense-first union (:func:`.hybrid.merge_union`) without building them:
read one at a time for the top-k and the tied scores, in bulk only when an array index asks; and
the ranks of the top-k hits in the union's lists with their ids (:func:`_hit_ranks`)."""

from __future__ import annotations

import bisect
import itertools

import numpy as np


def _objects(ids) -> np.ndarray:
    """object[M] array of a sequence of chunk ids (a list, or the packed ids of a reply)."""
    return np.asarray(ids if isinstance(ids, list) else list(ids), dtype=object) if len(ids) else np.zeros(0, object)


class _UnionIds:
    """The chunk ids of a union of lists without building them: segment j holds rows
    ``[starts[j], starts[j + 1])``, row r of it the id ``ids[r]`` or ``ids[rows[r]]`` of its
    ``(ids, rows)`` (rows None: all of ``ids``). The merge reads the ids of its top-k and of
    tied scores only; an array index (the NaN fallback) builds the object array."""

    __slots__ = ("segs", "starts", "_all")

    def __init__(self, segs: list[tuple]) -> None:
        self.segs = segs
        self.starts = list(itertools.accumulate((len(i) if r is None else len(r) for i, r in segs), initial=0))
        self._all = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            i = int(i) if i >= 0 else int(i) + self.starts[-1]
            if not 0 <= i < self.starts[-1]:
                raise IndexError(i)
            j = bisect.bisect_right(self.starts, i) - 1
            ids, rows = self.segs[j]
            r = i - self.starts[j]
            return ids[r if rows is None else int(rows[r])]
        if self._all is None:
            self._all = np.concatenate([_objects(ids) if rows is None else _objects(ids)[rows]
                                        for ids, rows in self.segs]) if self.segs else np.zeros(0, object)
        return self._all[i]


def _hit_ranks(vals: np.ndarray, ids: np.ndarray, rows: list[int], n: int, lexical: bool) -> np.ndarray:
    """int64[len(rows)]: the 1-based rank of each of ``rows`` in the top-n of float64[M] ``vals``
    ordered by (score desc, chunk id asc, position asc), 0 outside it; with ``lexical`` over the
    listed scores only (:func:`~oprag_server.index.fusion.lexical_listed`; 0 for a row not
    listed). The position of row r in :func:`_rank_lists`'s order is the number of elements
    ahead of it in that total order: the larger scores (listed ones for ``lexical``), plus the
    equal scores with a smaller id (or the same id earlier). Needs no NaN in ``vals``."""
    r = np.asarray(rows, dtype=np.int64)
    if not r.size:
        return np.zeros(0, np.int64)
    v = vals[r]
    gt = vals[None, :] > v[:, None]
    if lexical:
        gt &= (vals != 0.0)[None, :]
    ahead = gt.sum(axis=1)
    eq = vals[None, :] == v[:, None]
    tied = eq.sum(axis=1) > 1
    tied &= ahead < n
    if lexical:
        tied &= v != 0.0  # not listed: rank 0 whatever its ties
    for q in np.flatnonzero(tied).tolist():  # ties: by id, then position
        me, p, t = ids[r[q]], int(r[q]), np.flatnonzero(eq[q])
        if t.size <= 32:  # (a few: one id at a time; a _UnionIds builds every id for an array take)
            ahead[q] += sum(1 for x in t.tolist() if ids[x] < me or (x < p and ids[x] == me))
            continue
        tid = np.asarray(ids[t], dtype=object)  # (thousands, identical chunks: in one take)
        ahead[q] += int(((tid < me) | ((t < p) & (tid == me))).sum())
    out = np.where(ahead < n, ahead + 1, 0)
    if lexical:
        out[v == 0.0] = 0
    return out.astype(np.int64)
