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

Bookkeeping: ``key -> node`` over the linked nodes (``key``: a 64-bit hash of the row's bytes,
:func:`row_keys`; a match is confirmed on the bytes), held as two sorted numpy arrays (16 bytes a
node; a ``dict`` held ~130 bytes a node, ~65 MB at 500K) plus a small ``dict`` of the nodes
linked since they were last folded in; and ``node -> copies``. Rebuilt from the graph at load (an
unlinked node is one whose bottom-layer list is empty, but for the graph's entry point). A
graph saved before this kept its linked copies; they are linked as before (the second search of
:mod:`.ann_escape` covers them) until the next rebuild (compaction) folds them.
"""

from __future__ import annotations

import numpy as np

from .slot_sample import splitmix64


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def preset_levels(index, start: int, n: int) -> None:
    """Give the ``n`` vectors about to be added to HNSW ``index`` (ANN ids ``start...``) their graph levels, a function
    of each id alone, so that FAISS's ``add`` (which takes levels already set: ``hnsw.levels`` holding ``ntotal``
    entries) builds the same graph from the same vectors in the same order whatever happened before: FAISS draws
    them from the index's random generator, which a saved index does not keep, so after a restart a log replay or
    a later ingest linked the same vectors differently (a restored shard answered other dense minima; session 46).
    The distribution is FAISS's (``HNSW::random_level`` over ``assign_probas``), with the uniform variate of id ``i``
    from the SplitMix64 finaliser of ``i`` (:func:`.slot_sample.splitmix64`)."""
    h = index.hnsw
    probas = _faiss().vector_to_array(h.assign_probas)
    x = splitmix64(np.arange(start, start + n, dtype=np.uint64))
    u = (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # [0, 1)
    level = np.minimum(np.searchsorted(np.cumsum(probas), u, side="right"), max(probas.size - 1, 0))
    old = int(h.levels.size())
    h.levels.resize(old + n)
    if n:  # (a view of the vector's buffer after the resize; FAISS keeps a node's level + 1)
        _faiss().rev_swig_ptr(h.levels.data(), old + n)[old:] = level + 1


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


#: rows hashed per block by :func:`row_keys` (an int64 temporary of 2,048 x D)
_KEY_BLOCK = 2048
_COEF: dict[int, np.ndarray] = {}


def row_keys(x: np.ndarray) -> np.ndarray:
    """uint64[M]: a hash of each row's bytes of float32[M, D] ``x``: ``sum_i w_i * c_i mod 2^64``
    over the row's D 32-bit words ``w_i`` with fixed random odd 64-bit ``c_i`` (a linear hash:
    two rows that differ in one word never collide, in several with chance ~2^-32 or less; a
    match is confirmed on the bytes anyway). ~0.4 us a row at D 384 (numpy integer matmul in
    blocks); Python's ``hash`` of each row's bytes took ~1.4 us plus the loop."""
    m, d = x.shape
    c = _COEF.get(d)
    if c is None:
        c = _COEF[d] = np.random.default_rng(0x0DE1).integers(1, 2**62, d, dtype=np.int64) | 1
    w = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = np.empty(m, np.int64)
    for a in range(0, m, _KEY_BLOCK):
        out[a:a + _KEY_BLOCK] = w[a:a + _KEY_BLOCK].astype(np.int64) @ c  # (integer matmul wraps mod 2^64)
    return out.view(np.uint64)


class Copies:
    """The copies of one ``IndexHNSWFlat`` (module docstring). Not thread-safe."""

    #: the recent nodes' ``dict`` is folded into the sorted arrays past this many (or a quarter of them)
    FOLD_MIN = 65536

    def __init__(self) -> None:
        self._keys = np.zeros(0, np.uint64)  # sorted keys of linked nodes (one node per key) ...
        self._kid = np.zeros(0, np.int64)  # ... and their ANN ids
        self._recent: dict[int, int] = {}  # key -> ANN id of the nodes linked since the last fold
        self.of: dict[int, list[int]] = {}  # linked node -> its copies' ANN ids, in id order
        self._has = np.zeros(0, bool)  # by ANN id: a linked node with copies
        self._unhashed = False  # a graph read back without copies: its linked nodes not hashed yet

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        """int64[M]: the linked node registered under each of ``keys`` (-1: none)."""
        out = np.full(keys.size, -1, np.int64)
        if self._keys.size:
            pos = np.minimum(np.searchsorted(self._keys, keys), self._keys.size - 1)
            hit = self._keys[pos] == keys
            out[hit] = self._kid[pos[hit]]
        if self._recent:
            for j in np.flatnonzero(out < 0).tolist():
                out[j] = self._recent.get(int(keys[j]), -1)
        return out

    def _fold(self, force: bool = False) -> None:
        """Move the recent nodes into the sorted arrays (when there are enough of them)."""
        n = len(self._recent)
        if not n or (not force and n < max(self.FOLD_MIN, self._keys.size // 4)):
            return
        keys = np.concatenate([self._keys, np.fromiter(self._recent.keys(), np.uint64, n)])
        kid = np.concatenate([self._kid, np.fromiter(self._recent.values(), np.int64, n)])
        order = np.argsort(keys, kind="stable")
        self._keys, self._kid, self._recent = keys[order], kid[order], {}

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
        keys = row_keys(x)
        rep = self._lookup(keys)
        for j in range(m):
            node = int(rep[j])
            if node < 0:
                node = self._recent.get(int(keys[j]), -1)  # (a row earlier in ``x``)
            if node >= 0:
                row = st[node] if node < first else x[node - first]
                if np.array_equal(row.view(np.uint32), x[j].view(np.uint32)):
                    rep[j] = node
                    continue
                rep[j] = -1  # the same key, other bytes: linked, not registered (~never)
                continue
            self._recent[int(keys[j])] = first + j
        runs = np.flatnonzero(np.diff(np.r_[-2, (rep >= 0).astype(np.int64), -2]) != 0)
        for a, b in zip(runs[:-1], runs[1:]):
            if rep[a] < 0:
                preset_levels(index, first + int(a), int(b - a))
                index.add(x[a:b])
            else:
                self._unlinked(index, x[a:b])
        for j in np.flatnonzero(rep >= 0):
            self.of.setdefault(int(rep[j]), []).append(first + int(j))
        self._fold()
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
        if self._has.size != n:
            grown = np.zeros(n, bool)
            grown[:min(n, self._has.size)] = self._has[:n]
            self._has = grown
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
            keys = row_keys(st[unlinked])
            nodes = out._lookup(keys)
            for j, key, node in zip(unlinked.tolist(), keys.tolist(), nodes.tolist()):
                if node < 0 or not np.array_equal(st[node].view(np.uint32), st[j].view(np.uint32)):
                    if node < 0:
                        out._recent[key] = j  # no linked node holds it: a node FAISS left alone, kept as one
                    continue
                out.of.setdefault(node, []).append(j)
            out._fold(force=True)
        out._unhashed = not unlinked.size
        out._mark(n)
        return out

    def _hash_linked(self, index, unlinked: np.ndarray) -> None:
        """Register the graph's linked nodes (all but int64 ``unlinked``); of linked nodes with
        one key (copies linked by a graph saved before this module), the lowest id."""
        keys = row_keys(hnsw_storage(index))  # (in blocks of the view: no copy of the storage)
        ids = np.arange(keys.size, dtype=np.int64)
        if unlinked.size:
            linked = np.ones(keys.size, bool)
            linked[unlinked] = False
            ids, keys = ids[linked], keys[linked]
        self._keys, first = np.unique(keys, return_index=True)
        self._kid, self._recent = ids[first], {}

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

    def relabel(self, perm: np.ndarray, inv: np.ndarray) -> None:
        """The graph's nodes renumbered (:mod:`.graph_layout`): new id ``i`` is old id ``perm[i]`` (int64[A]),
        ``inv`` its inverse; the keys stay, every id is mapped (a node's copies kept in id order)."""
        self._kid = inv[self._kid]
        self._recent = {k: int(inv[v]) for k, v in self._recent.items()}
        self.of = {int(inv[node]): sorted(int(inv[c]) for c in cs) for node, cs in self.of.items()}
        if self._has.size == perm.size:
            self._has = self._has[perm]
        else:
            self._has = np.zeros(0, bool)
            self._mark(perm.size)
