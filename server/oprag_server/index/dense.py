"""Dense partition of one shard: a FAISS inner-product index over L2-normalised float32 vectors.

Chunks are identified by an int64 *slot* (unique within the shard, never reused). One float32 copy of the vectors
serves everything:

* flat and IVF: a compact copy of the live vectors here (flat top-k searches run FAISS's brute-force ``faiss.knn``
  inner-product kernel over it, the same kernel and scores as an ``IndexFlatIP`` holding a second copy); an IVF
  keeps its inverted lists (8-bit codes, :mod:`.ann`) besides.
* HNSW: the vectors ``IndexHNSWFlat`` stores for its graph, by ANN id (dead ones included until compaction), read
  through a zero-copy view (:meth:`.ann.AnnIndex.storage`); the live rows are the live ANN ids in ascending order.
  Exact scoring, canonical scores and snapshots read them there: no second copy.

Two kinds of scores (README: identical content, identical score):

* *approximate*: float32 BLAS / FAISS inner products (``search``, ``score_all``, ``score_slots``). Fast, but the
  float32 accumulation order depends on the kernel (matrix-vector or matrix-matrix), the batch and the row's
  position, so the same vector can score differently in the last bits. They are within
  :meth:`DenseIndex.score_error` of the canonical score.
* *canonical*: :func:`fixed_order_dot` (``exact_rows``, ``exact_slots``): the float32 products taken exactly in
  float64 and summed in a fixed pairwise order that depends only on D, so a vector's score with a query is a pure
  function of the two. Every score a shard returns is canonical; approximate scores only choose the candidates to
  compute it for.
"""

from __future__ import annotations

import threading

import numpy as np

from ..records import as_query_matrix
from ..config import DenseConfig
from .ann import AnnIndex
from .ann_rescore import rescored
from . import ann_vectors, hugepages
from .slot_sample import sample_slots
from .graph_rows import GraphRows
from .ivf_rows import IvfRows

#: unit roundoff of float32 (2^-24)
_U32 = 2.0**-24


def fixed_order_dot(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Canonical inner products: float64[M] of float32[M, D] ``vectors`` with float32[D] ``query``.

    Each float32 x float32 product is exact in float64 (48 significant bits <= 53); the D products of a row are then
    added pairwise in a fixed order (columns ``[0, h)`` += columns ``[w-h, w)``, ``h = w // 2``, until one column is
    left), element-wise, so a row's result depends only on that row and the query: not on M, the row's position or any
    BLAS kernel. The products are laid out transposed (D x M, C order) so that each pairwise step adds two contiguous
    blocks; the additions, and so the results, are the same as column-wise.
    """
    v = np.asarray(vectors, dtype=np.float32)
    m, w = v.shape
    if w == 0:
        return np.zeros(m, np.float64)
    p = np.empty((w, m), np.float64)
    np.multiply(v.T, np.asarray(query, dtype=np.float32).astype(np.float64)[:, None], out=p)
    while w > 1:
        h = w // 2
        np.add(p[:h], p[w - h : w], out=p[:h])
        w -= h
    return p[0].copy()


def _faiss():
    try:
        import faiss  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - dependency is declared
        raise ImportError("faiss is required: pip install faiss-cpu (or faiss-gpu-cu12)") from exc
    return faiss


class DenseIndex(GraphRows, IvfRows):
    """Inner-product index with removals: exact (flat) or approximate candidate search (:mod:`.ann`: HNSW, IVF)
    over an exact float32 copy of the live vectors.

    :param dim: vector width D. :param params: index kind and knobs (default: flat).
    """

    def __init__(self, dim: int, params: DenseConfig | None = None) -> None:
        _faiss()  # fail early, with the install hint, when FAISS is missing
        self.dim, self.params = int(dim), params or DenseConfig()
        # flat: FAISS's brute-force kernel scans the copy below; hnsw / ivf: the ANN structure picks the candidates
        self._ann = AnnIndex(self.dim, self.params) if self.params.kind != "flat" else None
        self._mut = threading.Lock()  # held while the flat / IVF copy's rows change (ivf_rows)
        if self.params.kind == "ivf":
            self._ann.source = (self._locked_rows, self._locked_slots)
        self.last_knobs: dict[str, int] = {}  # ef_search / nprobe used by the last search
        self._vecs = np.zeros((0, self.dim), dtype=np.float32)  # compact rows, capacity >= n
        self._row_slot = np.zeros(0, dtype=np.int64)
        self._n = 0
        self._slot_row = np.full(0, -1, dtype=np.int64)  # slot -> row, -1 when absent
        self._sample: tuple[int, np.ndarray, np.ndarray] | None = None  # (version, rows, vectors)
        self._version = 0  # grows on every add and remove
        self._max_norm = 0.0  # an upper bound of the stored vectors' L2 norms (never shrinks)
        # HNSW: the vectors live in the graph's storage; _slot_row maps slot -> ANN id there
        self._one = self.params.kind == "hnsw"
        self._live_cache: tuple[int, np.ndarray, np.ndarray] | None = None  # (version, ann ids, slots)
        # HNSW, added with ann=False (snapshot load) until load_ann / compact_ann: (slots, vectors or None when they
        # come with the saved structure)
        self._pending: list[tuple[np.ndarray, np.ndarray | None]] | None = None

    def __len__(self) -> int:
        return self._n

    def _gather(self, rows: np.ndarray) -> np.ndarray:
        """float32[M, D] vectors of live rows (positions in :attr:`slots` order), a copy."""
        if self._one:
            return self._ann.gather(self._live()[0][rows])
        return self._vecs[: self._n][rows]

    @property
    def slots(self) -> np.ndarray:
        """int64[n]: live slots in row order."""
        if self._one:
            if self._pending is not None:
                return np.concatenate([s for s, _ in self._pending]) if self._pending else np.zeros(0, np.int64)
            return self._live()[1]
        return self._row_slot[: self._n]

    @property
    def vectors(self) -> np.ndarray:
        """float32[n, D]: live vectors in row order (flat, IVF, HNSW without dead ids: a view,
        valid until the next add or remove, do not mutate; HNSW with dead ids: a copy)."""
        if self._one:
            live = self._live()[0]
            if self._ann.pending:
                return self._ann.gather(live)
            st = self._ann.storage()
            return st if live.size == st.shape[0] else st[live]
        return self._vecs[: self._n]

    def add(self, slots: np.ndarray, vectors: np.ndarray, ann: bool = True, defer: bool = False) -> None:
        """Add vectors (``ann=False``: not to the approximate structure, which the caller then loads with
        :meth:`load_ann` or rebuilds with :meth:`compact_ann`). ``defer=True`` with HNSW: searchable at once, but
        inserted into the graph later (:meth:`insert_pending`, or here once more than ``params.ann_tail`` wait).

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
        if slots.min() < 0:
            raise ValueError(f"slot {int(slots.min())} is negative")
        if np.unique(slots).size != slots.size:
            raise ValueError("a slot appears twice in one add")
        present = self._rows_of(slots)
        if (present >= 0).any() or (self._pending and np.isin(slots, self.slots).any()):
            raise ValueError(f"slot {int(slots[np.argmax(present >= 0)])} already in the dense index")
        self._grow_map(int(slots.max()) + 1)
        if self._one:
            self._add_one(slots, vecs, ann, defer and self.params.ann_tail > 0)
            return
        need = self._n + len(slots)
        with self._mut:
            if need > self._vecs.shape[0]:
                cap = max(need, 2 * self._vecs.shape[0], 1024)
                grown = hugepages.grown(self._vecs[: self._n], cap)  # (no huge page compaction in this write)
                rs = np.zeros(cap, dtype=np.int64)
                rs[: self._n] = self._row_slot[: self._n]
                self._vecs, self._row_slot = grown, rs
            self._vecs[self._n : need] = vecs
            self._row_slot[self._n : need] = slots
            self._slot_row[slots] = np.arange(self._n, need, dtype=np.int64)
            self._n = need
        self._version += 1
        self._max_norm = max(self._max_norm, float(np.sqrt(np.einsum("ij,ij->i", vecs, vecs, dtype=np.float64).max())))
        if self._ann is not None and ann:
            self._ann.add(slots, vecs, (self.slots, self.vectors))

    def _grow_map(self, top: int) -> None:
        if top > self._slot_row.size:
            grown_map = np.full(max(top, 2 * self._slot_row.size, 1024), -1, dtype=np.int64)
            grown_map[: self._slot_row.size] = self._slot_row
            self._slot_row = grown_map

    def remove(self, slots: np.ndarray) -> int:
        """Remove slots (absent slots are ignored). :returns: number removed."""
        if self._pending is not None:
            self.compact_ann()
        arr = np.unique(np.asarray(slots, dtype=np.int64).reshape(-1))
        slots = arr[self._rows_of(arr) >= 0].tolist()
        if not slots:
            return 0
        if self._one:
            return self._remove_one(np.asarray(slots, dtype=np.int64))
        if self._ann is not None:
            self._ann.remove(np.asarray(slots, dtype=np.int64))
        with self._mut:
            for s in slots:
                row, last = int(self._slot_row[s]), self._n - 1
                self._slot_row[s] = -1
                if row != last:
                    moved = int(self._row_slot[last])
                    self._vecs[row] = self._vecs[last]
                    self._row_slot[row] = moved
                    self._slot_row[moved] = row
                self._n -= 1
        self._version += 1
        if self._ann is not None and self._ann.needs_compaction():
            self.compact_ann()
        return len(slots)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``vectors`` (the float32 copy at its capacity and the slot/row maps; a flat index holds nothing
        else) and ``ann`` (the approximate structure, :meth:`.ann.AnnIndex.nbytes`; 0 for flat)."""
        own = self._vecs.nbytes + self._row_slot.nbytes + self._slot_row.nbytes
        if self._one:  # the graph's stored vectors are the copy; the graph itself is "ann"
            cache = self._live_cache
            own += int(self._ann.ann_slot.size) * 4 * self.dim + (cache[1].nbytes + cache[2].nbytes if cache else 0)
            return {"vectors": int(own), "ann": self._ann.graph_nbytes()}
        return {"vectors": int(own), "ann": self._ann.nbytes() if self._ann is not None else 0}

    def compact_ann(self) -> None:
        """Rebuild the approximate structure from the live vectors (drops what deletes left).

        :raises RuntimeError: HNSW slots registered by :meth:`add_pending` whose saved
            structure was never loaded (their vectors are nowhere else).
        """
        if self._ann is None:
            return
        if not self._one:
            self._ann.rebuild(self.slots, self.vectors)
            return
        self._compact_one()

    @property
    def ann(self):
        """The :class:`.ann.AnnIndex` (HNSW / IVF), or None (flat); None too while an HNSW
        structure is pending (snapshot load before :meth:`load_ann`)."""
        return self._ann if self._pending is None else None

    @property
    def one_copy(self) -> bool:
        """True when the approximate structure holds the only copy of the vectors (HNSW): a
        snapshot then keeps them in the structure's file only (:meth:`write_ann`)."""
        return self._one

    def ann_state(self, with_bytes: bool = True) -> dict | None:
        """What a snapshot keeps of the approximate structure (None for flat): ``{"kind", "faiss": bytes (only
        ``with_bytes``), "ann_slot": int64[A], "trained_at", "laid_at"}``."""
        if (a := self._ann) is None:
            return None
        out = {"kind": self.params.kind, "ann_slot": a.ann_slot, "trained_at": a.trained_at, "laid_at": a.laid_at}
        if with_bytes:
            out["faiss"] = self._ann.to_bytes()
        return out

    def write_ann(self, path) -> list:
        """Write the approximate structure to ``path`` straight from FAISS (no serialised copy in memory; an empty file
        while an IVF is untrained; HNSW's vectors in parts, :mod:`.ann_vectors`). Not fsynced. :returns: its files."""
        if self._pending is not None:
            self.compact_ann()
        if self._ann is None or not self._ann.ready:
            open(path, "wb").close()
            return [path]
        self._ann.write(path)
        return ann_vectors.files(path)

    def load_ann(self, state: dict, slot_map) -> bool:
        """Adopt a saved structure instead of rebuilding it (vectors added with ``ann=False``).

        :param state: as :meth:`ann_state`, ``faiss`` bytes or the path of a :meth:`write_ann` file.
        :param slot_map: old slot int64[A] -> current slot (-1: gone).
        :returns: False (and nothing changed) when the kind differs: the caller rebuilds.
        """
        if self._ann is None or state.get("kind") != self.params.kind:
            return False
        ann_slot = slot_map(np.asarray(state["ann_slot"], dtype=np.int64))
        if not self._one:
            self._ann.load(state["faiss"], ann_slot, int(state.get("trained_at", 0)))
            return True
        return self._load_one(state, ann_slot)

    def _rows_of(self, slots: np.ndarray) -> np.ndarray:
        """int64[M]: row of each slot (HNSW: its ANN id), -1 where absent."""
        out = np.full(slots.shape, -1, dtype=np.int64)
        inside = (slots >= 0) & (slots < self._slot_row.size)
        out[inside] = self._slot_row[slots[inside]]
        return out

    def rows(self, slots) -> np.ndarray:
        """int64[M]: rows (positions in :attr:`slots` order) of the given live slots.

        :raises KeyError: a slot is absent.
        """
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if self._pending is not None:
            self.compact_ann()
        r = self._rows_of(s)
        if s.size and (r < 0).any():
            raise KeyError(int(s[np.argmax(r < 0)]))
        if self._one:  # ANN ids -> positions among the live ids
            live = self._live()[0]
            return np.searchsorted(live, r) if live.size != self._ann.ann_slot.size else r
        return r

    def vectors_of(self, slots: np.ndarray) -> np.ndarray:
        """float32[M, D] vectors of the given live slots (KeyError for an absent slot)."""
        if self._one:
            s = np.asarray(slots, dtype=np.int64).reshape(-1)
            self.rows(s)  # raises KeyError for an absent slot
            return self._ann.gather(self._slot_row[s])
        return self._vecs[self.rows(slots)]

    def sample(self, max_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """A fixed sample of min(``max_rows``, n) rows, by slot order (:mod:`.slot_sample`): ``(rows int64[S],
        vectors float32[S, D])``, cached until the next add or remove."""
        if self._sample is None or self._sample[0] != self._version:
            rows = self.rows(sample_slots(self, max_rows))
            self._sample = (self._version, rows, np.ascontiguousarray(self._gather(rows)))
        return self._sample[1], self._sample[2]

    def search(self, queries, k: int, ef_search: int = 0, nprobe: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-k by inner product: exact (flat, or an IVF not trained yet) or approximate (HNSW with beam
        ``ef_search``, IVF visiting ``nprobe`` lists; 0 = the index's default). The values used are left in
        :attr:`last_knobs`.

        :param queries: float32[B, D] (other float dtypes, strided views and Arrow lists are accepted and converted,
            see :func:`as_query_matrix`).
        :param k: requested hits per query (>= 1); fewer come back when the shard holds fewer.
        :returns: per query, ``slots`` int64[k'] and ``scores`` float32[k'], descending, k' = min(k, len(self)),
            or more with HNSW when a vector found has live copies (:mod:`.ann_copies`); no FAISS -1 placeholders.
        """
        q = as_query_matrix(queries, self.dim)
        if self._pending is not None:
            self.compact_ann()
        kk = min(int(k), self._n)
        if kk <= 0:
            return [np.zeros(0, dtype=np.int64)] * q.shape[0], [np.zeros(0, dtype=np.float32)] * q.shape[0]
        self.last_knobs = {}
        if self._ann is not None and self._ann.ready:
            ivf = self.params.kind == "ivf"  # its 8-bit codes pick candidates, the float32 copy ranks them (ann.py)
            ids, scores, knob = self._ann.search(q, min(self._n, kk + max(32, kk // 2)) if ivf else kk, ef_search,
                                                 nprobe)
            ids, scores = rescored(self._vecs, self._rows_of, q, ids, kk) if ivf else (ids, scores)
            self.last_knobs = {"nprobe" if ivf else "ef_search": knob}
        elif self._ann is not None:  # IVF before training: an exact scan of the copy
            allv = self.score_all(q)
            ids = np.empty((q.shape[0], kk), np.int64)
            scores = np.empty((q.shape[0], kk), np.float32)
            for i in range(q.shape[0]):
                top = np.argpartition(-allv[i], kk - 1)[:kk]
                top = top[np.argsort(-allv[i][top], kind="stable")]
                ids[i], scores[i] = self.slots[top], allv[i][top]
        else:  # flat: the brute-force kernel of IndexFlatIP over the live rows, rows -> slots
            scores, rows = _faiss().knn(q, self._vecs[: self._n], kk, metric=_faiss().METRIC_INNER_PRODUCT)
            ids = np.where(rows >= 0, self._row_slot[np.maximum(rows, 0)], -1)
        out_ids, out_scores = [], []
        for i in range(q.shape[0]):
            keep = ids[i] >= 0
            out_ids.append(ids[i][keep].astype(np.int64))
            out_scores.append(scores[i][keep].astype(np.float32))
        return out_ids, out_scores

    def score_all(self, queries) -> np.ndarray:
        """Inner product of every live vector with every query. :returns: float32[B, n] in row order (:attr:`slots`)."""
        q = as_query_matrix(queries, self.dim)
        if not self._n:
            return np.zeros((q.shape[0], 0), np.float32)
        if self._one:  # every stored vector (dead ones too: cheaper than gathering), live columns
            live_ids = self._live()[0]
            out = np.stack([self._ann.matvec(q[i]) for i in range(q.shape[0])])
            return out if live_ids.size == out.shape[1] else out[:, live_ids]
        live = self._vecs[: self._n]
        # one matrix-vector product per query: measured several times faster here than one
        # small-batch matrix product with this OpenBLAS build
        return np.stack([live @ q[i] for i in range(q.shape[0])])

    def score_slots(self, query: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """float32[M]: approximate inner product of one query float32[D] with the given live slots."""
        return self.vectors_of(slots) @ np.asarray(query, dtype=np.float32).reshape(-1)

    def exact_rows(self, query: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float64[M]: canonical inner products (:func:`fixed_order_dot`) of one query float32[D]
        with the live vectors at the given rows (positions in :attr:`slots` order)."""
        return fixed_order_dot(self._gather(np.asarray(rows, dtype=np.int64)), query)

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
