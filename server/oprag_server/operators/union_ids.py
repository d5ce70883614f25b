"""The chunk ids of the dense-first union (:func:`.hybrid.merge_union`) without building them:
read one at a time for the top-k and the tied scores, in bulk only when an array index asks."""

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
