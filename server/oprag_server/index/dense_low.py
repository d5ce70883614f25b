"""The lowest inner product of a query with a shard's vectors under an HNSW index, without a
second full ANN search: the dense minimum that min-max fusion normalises with (exact mode uses
the true minimum over every chunk, so dense-first hybrid wants the same value).

The minimum of ``q . v`` is the maximum of ``(-q) . v``. A plain HNSW search for ``-q`` descends
from the graph's entry point, which sits among typical vectors, far from the outliers that
minimise ``q . v``: at 500K vectors per shard it found the true minimum for ~72% of queries at
ef_search 512 (~2 ms). Instead, each shard keeps :class:`LowSeeds`, a small set of vectors that
are extreme in some direction: for ``PROBES`` directions (spherical k-means centroids of the
vectors, FAISS ``Kmeans``), the ``PER_PROBE`` vectors with the lowest inner product with each
(a "reverse" top-T, FAISS ``knn`` with ``-probe``). A query scores the seed set exactly (a small
matrix product), and a beam search for ``-q`` on the graph's bottom layer (width: a sixteenth
of the request's ``ef_search``, at least 16; 32 at the default 512) starts
from the ``ENTRIES`` lowest seeds (:func:`search_from`). Every value it returns is
the score of a real live chunk, so it is never below the true minimum (like the sample estimate
and the ``-q`` search); measured accuracy and cost are in bench/RESULTS.md ("dense minimum").

Upkeep: built on first use (``Searcher.warm`` builds it at start); vectors added since are
tested against the probes (a vector whose score with some probe is below that probe's
``PER_PROBE``-th lowest at build time joins the seeds); dead ids are skipped at query time; the
set is rebuilt when the graph was rebuilt (compaction) or has doubled since the build.
"""

from __future__ import annotations

import numpy as np


def _faiss():
    import faiss  # noqa: PLC0415 - a declared dependency; imported where used

    return faiss


def search_from(ann, q: np.ndarray, entries: np.ndarray, entry_scores: np.ndarray, ef: int) -> np.ndarray:
    """The best live vector of the HNSW :class:`.ann.AnnIndex` ``ann`` for float32[B, D] ``q``
    (largest inner product) found by a beam search of width ``ef`` on the graph's bottom layer
    that starts from the given ANN ids int[B, E] (FAISS ``IndexHNSW.search_level_0``, all
    entries at once), instead of descending from the graph's entry point.

    :param entry_scores: float[B, E]: ``q . v`` of each entry vector.
    :returns: int64[B] ANN ids (-1 where nothing live was found).
    """
    faiss = _faiss()
    q = np.ascontiguousarray(q, dtype=np.float32)
    b, e = entries.shape
    ent = np.ascontiguousarray(entries, dtype=np.int32)
    # FAISS's HNSW works on distances; for inner product the distance is -(q . v)
    dist = np.ascontiguousarray(-np.asarray(entry_scores, dtype=np.float32))
    out_d, out_i = np.empty((b, 1), np.float32), np.full((b, 1), -1, np.int64)
    params = ann._hnsw_params(ef)  # noqa: SLF001 - the index package's own
    ann._index.search_level_0(b, faiss.swig_ptr(q), 1, faiss.swig_ptr(ent), faiss.swig_ptr(dist),  # noqa: SLF001
                              faiss.swig_ptr(out_d), faiss.swig_ptr(out_i), e, 1, params)
    return out_i[:, 0]


class LowSeeds:
    """Seeds of the lowest-inner-product search of one HNSW index (module docstring). Not
    thread-safe (one shard's searches are serial)."""

    #: probe directions, lowest vectors kept per probe, search entries; the beam is the
    #: request's ef_search / BEAM_DIV, at least MIN_BEAM; rows per block of the build
    PROBES, PER_PROBE, ENTRIES, BEAM_DIV, MIN_BEAM, BLOCK = 256, 16, 16, 16, 16, 32768

    def __init__(self) -> None:
        self._index = None  # the FAISS index the seeds were built for
        self._built_at = 0  # vectors in the graph at the build
        self._seen = 0  # vectors in the graph already tested against the probes
        self._ids = np.zeros(0, np.int64)  # ANN ids of the seeds
        self._vecs = np.zeros((0, 0), np.float32)  # their vectors
        self._probes = np.zeros((0, 0), np.float32)
        self._thresh = np.zeros(0, np.float32)  # per probe: the PER_PROBE-th lowest score at build

    def _build(self, ann) -> None:
        faiss, st = _faiss(), ann.storage()
        a = st.shape[0]
        self._index, self._built_at, self._seen = ann._index, a, a  # noqa: SLF001
        if a == 0:
            self._ids, self._vecs = np.zeros(0, np.int64), np.zeros((0, ann.dim), np.float32)
            self._probes, self._thresh = np.zeros((0, ann.dim), np.float32), np.zeros(0, np.float32)
            return
        p = int(min(self.PROBES, max(1, a // 64)))
        train = np.ascontiguousarray(st[:: max(1, a // (64 * p))], dtype=np.float32)
        km = faiss.Kmeans(ann.dim, p, niter=10, seed=1, spherical=True, max_points_per_centroid=64)
        km.train(train)
        probes = km.centroids / np.maximum(np.linalg.norm(km.centroids, axis=1, keepdims=True), 1e-12)
        probes = np.ascontiguousarray(probes, dtype=np.float32)
        t = min(self.PER_PROBE, a)
        # per probe, the t lowest scores: blocks of rows times the probes (one BLAS product each),
        # the t lowest of each block joined with the t lowest so far
        best_s, best_i = np.full((p, t), np.inf, np.float32), np.full((p, t), -1, np.int64)
        for lo in range(0, a, self.BLOCK):
            sc = probes @ st[lo:lo + self.BLOCK].T  # float32[P, rows]
            k = min(t, sc.shape[1])
            part = np.argpartition(sc, k - 1, axis=1)[:, :k] if k < sc.shape[1] else np.tile(np.arange(k), (p, 1))
            cs = np.concatenate([best_s, np.take_along_axis(sc, part, 1)], axis=1)
            ci = np.concatenate([best_i, part + lo], axis=1)
            keep = np.argpartition(cs, t - 1, axis=1)[:, :t]
            best_s, best_i = np.take_along_axis(cs, keep, 1), np.take_along_axis(ci, keep, 1)
        self._probes, self._thresh = probes, best_s.max(axis=1)
        self._ids = np.unique(best_i[best_i >= 0]).astype(np.int64)
        self._vecs = np.ascontiguousarray(st[self._ids])

    def _update(self, ann) -> None:
        a = int(ann._index.ntotal)  # noqa: SLF001
        if ann._index is not self._index or a < self._seen or a >= 2 * max(self._built_at, 8):  # noqa: SLF001
            self._build(ann)
            return
        if a > self._seen:  # new vectors: those extreme for some probe join the seeds
            new = ann.storage()[self._seen:a]
            low = ((new @ self._probes.T) <= self._thresh).any(axis=1)
            if low.any():
                self._ids = np.concatenate([self._ids, self._seen + np.flatnonzero(low)])
                self._vecs = np.ascontiguousarray(np.concatenate([self._vecs, new[low]]))
            self._seen = a

    def candidates(self, ann, q: np.ndarray, err: np.ndarray, ef: int = 0) -> list[np.ndarray]:
        """Per query of float32[B, D] ``q``: ANN ids int64[C] of live vectors among which the
        lowest canonical score found lies: the seeds whose float32 score is within
        ``2 * err[b]`` of the lowest seed score (the k = 1 argument of ``refine_top``: the
        float32 scores err by at most ``err``), and the vector the bottom-layer search for
        ``-q`` from the lowest seeds found. Empty when the index holds no live vector.

        :param ann: the shard's :class:`.ann.AnnIndex` (HNSW). :param err: float64[B] bound of
            ``|float32 score - canonical|`` per query (``DenseIndex.score_error``).
        :param ef: the request's HNSW beam (0: the index default); this search's beam is a
            sixteenth of it, at least 16 (32 at the default 512).
        """
        self._update(ann)
        b = q.shape[0]
        live = ann.ann_slot[self._ids] >= 0
        if not b or not live.any():
            return [np.zeros(0, np.int64)] * b
        ids, s = self._ids, np.ascontiguousarray((self._vecs @ q.T).T)  # float32[B, S]
        if not live.all():
            s[:, ~live] = np.inf  # dead seeds: never an entry, never the minimum
        e = min(self.ENTRIES, int(live.sum()))
        part = np.argpartition(s, e - 1, axis=1)[:, :e]
        beam = max(self.MIN_BEAM, int(ef or ann.params.ef_search) // self.BEAM_DIV)
        found = search_from(ann, -q, ids[part], -np.take_along_axis(s, part, 1), beam)
        out = []
        for j in range(b):
            near = ids[s[j] <= np.float64(s[j].min()) + 2.0 * float(err[j])]
            f = found[j]
            out.append(near if f < 0 or ann.ann_slot[f] < 0 else np.append(near, f))
        return out

    def nbytes(self) -> int:
        """Bytes held: the seeds' ids and vectors, the probes and their thresholds."""
        return int(self._ids.nbytes + self._vecs.nbytes + self._probes.nbytes + self._thresh.nbytes)
