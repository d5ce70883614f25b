"""Identical vectors kept out of the HNSW graph's links (trial26; :mod:`.ann_escape` has why
copies trap a search): the first vector of each distinct value is a graph node as before; a
later vector with the same bytes (a *copy*: the same chunk text always gets the same vector) is
appended to FAISS's storage and to the graph's tables with no links (bottom layer only, every
neighbour slot -1), so it keeps its ANN id and storage row (every exact read, by id, is
unchanged) but no search walks through it. A search expands each vector it returns into the
live copies of that vector, with the same score, right after it (so a shard's refine step sees
every tied copy and breaks the tie by chunk id, as over a flat index). A node that is dead but
has live copies still leads a search to them: it is left out of the search's dead-id selector
and dropped from the expanded result.

Bookkeeping: ``key -> node`` over the linked nodes (``key``: Python's hash of the row's bytes;
a match is confirmed on the bytes) and ``node -> copies``; rebuilt from the graph at load (an
unlinked node is one whose bottom-layer list is empty, but for the graph's entry point). A
graph saved before this kept its linked copies; they are linked as before (the second search of
:mod:`.ann_escape` covers them) until the next rebuild (compaction) folds them.
"""

from __future__ import annotations

import numpy as np


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def hnsw_storage(index) -> np.ndarray:
    """float32[A, D]: an ``IndexHNSWFlat``'s stored vectors by id, a zero-copy view of FAISS's
    memory (valid until the index changes)."""
    n = int(index.ntotal)
    if n == 0:
        return np.zeros((0, index.d), np.float32)
    flat = _faiss().downcast_index(index.storage)
    return _faiss().rev_swig_ptr(flat.get_xb(), n * index.d).reshape(n, index.d)


def level0(index) -> tuple[np.ndarray, np.ndarray, int]:
    """``(neighbours int32[*], offsets int64[A + 1], width)``: zero-copy views of FAISS's HNSW
    neighbour lists (valid until the graph changes) and the level-0 list width (2 M)."""
    faiss, h = _faiss(), index.hnsw
    nbr = faiss.rev_swig_ptr(h.neighbors.data(), h.neighbors.size())
    off = faiss.rev_swig_ptr(h.offsets.data(), h.offsets.size()).view(np.int64)
    return nbr, off, int(h.cum_nneighbor_per_level.at(1) - h.cum_nneighbor_per_level.at(0))


class Copies:
    """The copies of one ``IndexHNSWFlat`` (module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._node: dict[int, int] = {}  # hash of a linked node's bytes -> its ANN id
        self.of: dict[int, list[int]] = {}  # linked node -> its copies' ANN ids, in id order
        self._has = np.zeros(0, bool)  # by ANN id: a linked node with copies
        self._unhashed = False  # a graph read back without copies: its linked nodes not hashed yet

    def add(self, index, x: np.ndarray) -> None:
        """Append float32[M, D] ``x`` to ``index`` (the next ANN ids, in order): linked as FAISS's
        ``add`` does, except the copies of a vector already linked (or earlier in ``x``), which
        are appended unlinked."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._unhashed:
            self._hash_linked(index, np.zeros(0, np.int64))
            self._unhashed = False
        first, m = int(index.ntotal), x.shape[0]
        st = hnsw_storage(index)
        rep = np.full(m, -1, np.int64)
        for j in range(m):
            key = hash(x[j].tobytes())
            node = self._node.get(key)
            if node is not None:
                row = st[node] if node < first else x[node - first]
                if np.array_equal(row.view(np.uint32), x[j].view(np.uint32)):
                    rep[j] = node
                    continue
            if node is None:
                self._node[key] = first + j
        runs = np.flatnonzero(np.diff(np.r_[-2, (rep >= 0).astype(np.int64), -2]) != 0)
        for a, b in zip(runs[:-1], runs[1:]):
            if rep[a] < 0:
                index.add(x[a:b])
            else:
                self._unlinked(index, x[a:b])
        for j in np.flatnonzero(rep >= 0):
            self.of.setdefault(int(rep[j]), []).append(first + int(j))
        self._mark(int(index.ntotal))

    @staticmethod
    def _unlinked(index, x: np.ndarray) -> None:
        """Append ``x`` to the storage and the graph's tables, bottom layer only, no links."""
        h, n = index.hnsw, x.shape[0]
        for _ in range(n):
            h.levels.push_back(1)
        h.prepare_level_tab(n, True)  # offsets, and neighbour slots filled with -1
        _faiss().downcast_index(index.storage).add(x)
        index.ntotal = int(index.ntotal) + n

    def _mark(self, n: int) -> None:
        self._has = np.zeros(n, bool)
        if self.of:
            self._has[np.fromiter(self.of, np.int64, len(self.of))] = True

    @classmethod
    def of_index(cls, index) -> Copies:
        """The bookkeeping of a graph read back (module docstring): its unlinked nodes are those
        whose first bottom-layer slot is -1 (FAISS fills a list from its start, and a linked node
        of a graph of two or more has a neighbour), but for the entry point (alone: no neighbour).
        Without one, the hashes of the linked nodes are taken at the first :meth:`add` instead (a
        restart does not hash every vector). A node without links whose vector no linked node
        holds stays a node of its own (never seen)."""
        out, n = cls(), int(index.ntotal)
        unlinked = np.zeros(0, np.int64)
        if n > 1:
            nb, off, _ = level0(index)
            unlinked = np.flatnonzero(nb[off[:n]] < 0)
            unlinked = unlinked[unlinked != int(index.hnsw.entry_point)]  # (a graph of one linked vector: no neighbours)
        if unlinked.size:
            out._hash_linked(index, unlinked)
            st = hnsw_storage(index)
            for j in unlinked.tolist():
                key = hash(st[j].tobytes())
                node = out._node.get(key)
                if node is None or not np.array_equal(st[node].view(np.uint32), st[j].view(np.uint32)):
                    out._node.setdefault(key, j)  # no linked node holds it: a node FAISS left alone, kept as one
                    continue
                out.of.setdefault(node, []).append(j)
        out._unhashed = not unlinked.size
        out._mark(n)
        return out

    def _hash_linked(self, index, unlinked: np.ndarray) -> None:
        """``key -> node`` of the graph's linked nodes (those not in int64 ``unlinked``)."""
        st, skip = hnsw_storage(index), set(unlinked.tolist())
        for j in range(st.shape[0]):
            if j not in skip:
                self._node.setdefault(hash(st[j].tobytes()), j)

    def navigable(self, dead_ids: np.ndarray, ann_slot: np.ndarray) -> np.ndarray:
        """``dead_ids`` (int64) without the linked nodes that have a live copy (a search must still
        reach them: :meth:`expand` drops them from its result)."""
        if not self.of or not dead_ids.size:
            return dead_ids
        inside = dead_ids[dead_ids < self._has.size]
        lead = [d for d in inside[self._has[inside]].tolist() if (ann_slot[self.of[d]] >= 0).any()]
        return np.setdiff1d(dead_ids, np.asarray(lead, np.int64)) if lead else dead_ids

    def expand(self, scores: np.ndarray, ids: np.ndarray, ann_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """FAISS's ``(scores float32[B, k], ids int64[B, k])`` with each node that has copies
        followed by its live copies (its score), and dead nodes dropped; rows padded (-inf, -1)
        to the longest. Unchanged (the same arrays) when no returned node has copies."""
        if not self.of:
            return scores, ids
        ok = (ids >= 0) & (ids < self._has.size)
        if not self._has[np.where(ok, ids, 0)][ok].any():
            return scores, ids
        rows_s, rows_i = [], []
        for s_row, i_row in zip(scores, ids):
            out_s, out_i = [], []
            for s, i in zip(s_row.tolist(), i_row.tolist()):
                if i < 0:
                    continue
                if ann_slot[i] >= 0:
                    out_s.append(s)
                    out_i.append(i)
                if i < self._has.size and self._has[i]:
                    live = [c for c in self.of[i] if ann_slot[c] >= 0]
                    out_s += [s] * len(live)
                    out_i += live
            rows_s.append(out_s)
            rows_i.append(out_i)
        w = max(1, max(len(r) for r in rows_i))
        s_out = np.full((len(rows_i), w), -np.inf, np.float32)
        i_out = np.full((len(rows_i), w), -1, np.int64)
        for r, (a, b) in enumerate(zip(rows_s, rows_i)):
            s_out[r, :len(a)], i_out[r, :len(b)] = a, b
        return s_out, i_out
