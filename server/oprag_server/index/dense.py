"""Dense partition of one shard: a FAISS inner-product index over L2-normalised float32 vectors.

Chunks are identified by an int64 *slot* (unique within the shard, never reused). FAISS
(``IndexIDMap2(IndexFlatIP)``) answers top-k searches; a compact float32 copy of the live
vectors serves exact scoring of every chunk (``score_all``) and snapshots.

Two kinds of scores (README: identical content, identical score):

* *approximate*: float32 BLAS / FAISS inner products (``search``, ``score_all``,
  ``score_slots``). Fast, but the float32 accumulation order depends on the kernel (matrix-vector
  or matrix-matrix), the batch and the row's position, so the same vector can score differently
  in the last bits. They are within :meth:`DenseIndex.score_error` of the canonical score.
* *canonical*: :func:`fixed_order_dot` (``exact_rows``, ``exact_slots``): the float32 products
  taken exactly in float64 and summed in a fixed pairwise order that depends only on D, so a
  vector's score with a query is a pure function of the two. Every score a shard returns is
  canonical; approximate scores only choose the candidates to compute it for.
"""

from __future__ import annotations

import numpy as np

from ..records import as_query_matrix

#: unit roundoff of float32 (2^-24)
_U32 = 2.0**-24


def fixed_order_dot(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Canonical inner products: float64[M] of float32[M, D] ``vectors`` with float32[D] ``query``.

    Each float32 x float32 product is exact in float64 (48 significant bits <= 53); the D
    products of a row are then added pairwise in a fixed order (columns ``[0, h)`` += columns
    ``[w-h, w)``, ``h = w // 2``, until one column is left), element-wise, so a row's result
    depends only on that row and the query: not on M, the row's position or any BLAS kernel.
    """
    p = np.asarray(vectors, dtype=np.float32).astype(np.float64) * np.asarray(query, dtype=np.float32).astype(np.float64)
    w = p.shape[1]
    if w == 0:
        return np.zeros(p.shape[0], np.float64)
    while w > 1:
        h = w // 2
        np.add(p[:, :h], p[:, w - h : w], out=p[:, :h])
        w -= h
    return p[:, 0].copy()


def _faiss():
    try:
        import faiss  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - dependency is declared
        raise ImportError("faiss is required: pip install faiss-cpu (or faiss-gpu-cu12)") from exc
    return faiss


class DenseIndex:
    """Exact inner-product index with removals.

    :param dim: vector width D.
    """

    def __init__(self, dim: int) -> None:
        faiss = _faiss()
        self.dim = int(dim)
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        self._vecs = np.zeros((0, self.dim), dtype=np.float32)  # compact rows, capacity >= n
        self._row_slot = np.zeros(0, dtype=np.int64)
        self._n = 0
        self._slot_row: dict[int, int] = {}
        self._max_norm = 0.0  # an upper bound of the stored vectors' L2 norms (never shrinks)

    def __len__(self) -> int:
        return self._n

    @property
    def slots(self) -> np.ndarray:
        """int64[n]: live slots in row order."""
        return self._row_slot[: self._n]

    @property
    def vectors(self) -> np.ndarray:
        """float32[n, D]: live vectors in row order (a view; do not mutate)."""
        return self._vecs[: self._n]

    def add(self, slots: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors.

        :param slots: int64[M], not already present.
        :param vectors: float32[M, D], L2-normalised.
        :raises ValueError: shape mismatch or a slot already present.
        """
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        vecs = as_query_matrix(vectors, self.dim)
        if vecs.shape[0] != slots.shape[0]:
            raise ValueError(f"{slots.shape[0]} slots for {vecs.shape[0]} vectors")
        if len(slots) == 0:
            return
        for s in slots.tolist():
            if s in self._slot_row:
                raise ValueError(f"slot {s} already in the dense index")
        need = self._n + len(slots)
        if need > self._vecs.shape[0]:
            cap = max(need, 2 * self._vecs.shape[0], 1024)
            grown = np.zeros((cap, self.dim), dtype=np.float32)
            grown[: self._n] = self._vecs[: self._n]
            self._vecs = grown
            rs = np.zeros(cap, dtype=np.int64)
            rs[: self._n] = self._row_slot[: self._n]
            self._row_slot = rs
        self._vecs[self._n : need] = vecs
        self._row_slot[self._n : need] = slots
        for i, s in enumerate(slots.tolist()):
            self._slot_row[s] = self._n + i
        self._n = need
        self._max_norm = max(self._max_norm, float(np.sqrt(np.einsum("ij,ij->i", vecs, vecs, dtype=np.float64).max())))
        self._index.add_with_ids(vecs, slots)

    def remove(self, slots: np.ndarray) -> int:
        """Remove slots (absent slots are ignored). :returns: number removed."""
        slots = [int(s) for s in np.asarray(slots, dtype=np.int64).reshape(-1) if int(s) in self._slot_row]
        if not slots:
            return 0
        faiss = _faiss()
        self._index.remove_ids(faiss.IDSelectorBatch(np.asarray(slots, dtype=np.int64)))
        for s in slots:
            row = self._slot_row.pop(s)
            last = self._n - 1
            if row != last:
                moved = int(self._row_slot[last])
                self._vecs[row] = self._vecs[last]
                self._row_slot[row] = moved
                self._slot_row[moved] = row
            self._n -= 1
        return len(slots)

    def vectors_of(self, slots: np.ndarray) -> np.ndarray:
        """float32[M, D] vectors of the given live slots (KeyError for an absent slot)."""
        rows = [self._slot_row[int(s)] for s in np.asarray(slots, dtype=np.int64).reshape(-1)]
        return self._vecs[rows] if rows else np.zeros((0, self.dim), dtype=np.float32)

    def search(self, queries, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-k by inner product.

        :param queries: float32[B, D] (other float dtypes, strided views and Arrow lists are
            accepted and converted, see :func:`as_query_matrix`).
        :param k: requested hits per query (>= 1); fewer come back when the shard holds fewer.
        :returns: per query, ``slots`` int64[k'] and ``scores`` float32[k'], descending, with
            k' = min(k, len(self)); FAISS's -1 placeholders never appear.
        """
        q = as_query_matrix(queries, self.dim)
        kk = min(int(k), self._n)
        if kk <= 0:
            empty_s = np.zeros(0, dtype=np.int64)
            empty_f = np.zeros(0, dtype=np.float32)
            return [empty_s] * q.shape[0], [empty_f] * q.shape[0]
        scores, ids = self._index.search(q, kk)
        out_ids, out_scores = [], []
        for i in range(q.shape[0]):
            keep = ids[i] >= 0
            out_ids.append(ids[i][keep].astype(np.int64))
            out_scores.append(scores[i][keep].astype(np.float32))
        return out_ids, out_scores

    def score_all(self, queries) -> np.ndarray:
        """Inner product of every live vector with every query.

        :returns: float32[B, n] in row order (see :attr:`slots`).
        """
        q = as_query_matrix(queries, self.dim)
        if not self._n:
            return np.zeros((q.shape[0], 0), np.float32)
        live = self._vecs[: self._n]
        # one matrix-vector product per query: measured several times faster here than one
        # small-batch matrix product with this OpenBLAS build
        return np.stack([live @ q[i] for i in range(q.shape[0])])

    def score_slots(self, query: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """float32[M]: approximate inner product of one query float32[D] with the given live slots."""
        v = self.vectors_of(slots)
        return v @ np.asarray(query, dtype=np.float32).reshape(-1)

    def exact_rows(self, query: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float64[M]: canonical inner products (:func:`fixed_order_dot`) of one query float32[D]
        with the live vectors at the given rows (positions in :attr:`slots` order)."""
        return fixed_order_dot(self._vecs[: self._n][np.asarray(rows, dtype=np.int64)], query)

    def exact_slots(self, query: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """float64[M]: canonical inner products of one query float32[D] with the given live slots
        (KeyError for an absent slot)."""
        return fixed_order_dot(self.vectors_of(slots), query)

    def score_error(self, query: np.ndarray) -> float:
        """An upper bound of ``|approximate - canonical|`` for any stored vector and ``query``.

        Any float32 summation order of D products errs by at most
        ``gamma_D * sum|v_i q_i| <= gamma_D * |v| |q|``, ``gamma_D = D u / (1 - D u)``,
        ``u = 2^-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1);
        the canonical sum errs far less (float64). Doubled for safety.
        """
        d = self.dim * _U32
        qn = float(np.linalg.norm(np.asarray(query, dtype=np.float64)))
        return 2.0 * d / (1.0 - d) * qn * max(self._max_norm, 1.0) + 1e-12
