"""The HNSW dense-minimum seeds (:class:`.dense_low.LowSeeds`) kept in a snapshot
(``dense_seeds.npz``) and restored at load, so that a restart searches from the seeds the shard
had, not from seeds built anew over the whole graph (trial45: after 15K writes, a restart changed
66-82 of 1,610 ``HYBRID`` replies through the dense minimum, an estimate whose value depends on
the seeds).

A running shard's seeds depend on its history: built where first needed, rebuilt as the graph
doubles, extended by the vectors added since (each tested against the probes). Their state is
``(probes float32[P, D], thresholds float32[P], ids int64[S], built_at, seen)`` for one FAISS
index: :func:`mark` keeps it on the :class:`.ann.AnnIndex` as one tuple, replaced whole at every
change, so a snapshot's writer thread reads it whole while the shard answers queries (a snapshot
holds every write and graph insert until it is done, so the graph it writes is the one the tuple
was made for, or the tuple is older and the restored seeds extend it as the shard would have).
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import numpy as np

NAME = "dense_seeds.npz"
#: what ``np.load`` of a damaged ``.npz`` / ``.npy`` raises (a cut or flipped zip: BadZipFile, zlib.error, EOFError)
NPZ_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)


def mark(seeds, ann) -> None:
    """Keep ``seeds``' state for a snapshot (:func:`encode`) on ``ann``, whose graph they serve."""
    ann.low_seeds_state = (seeds._index, seeds._probes, seeds._thresh, seeds._ids, seeds._built_at,  # noqa: SLF001
                           seeds._seen)  # noqa: SLF001


def encode(ann) -> bytes | None:
    """``dense_seeds.npz``'s bytes for the graph of ``ann`` (None: no HNSW graph, or no seeds built for it)."""
    index = getattr(ann, "_index", None)
    got = getattr(ann, "low_seeds_state", None)
    if index is None or got is None or got[0] is not index or got[5] > int(index.ntotal):
        return None
    _, probes, thresh, ids, built_at, seen = got
    buf = io.BytesIO()
    np.savez(buf, probes=probes, thresh=thresh, ids=ids, built_at=np.int64(built_at), seen=np.int64(seen))
    return buf.getvalue()


def decode(path: Path) -> tuple | None:
    """``(probes, thresholds, ids, built_at, seen)`` from a :func:`encode` file; None when absent or unreadable."""
    if not path.exists():
        return None
    try:
        with np.load(path) as z:
            return (np.ascontiguousarray(z["probes"], np.float32), np.ascontiguousarray(z["thresh"], np.float32),
                    np.ascontiguousarray(z["ids"], np.int64), int(z["built_at"]), int(z["seen"]))
    except NPZ_ERRORS:  # (rebuilt by the next warm-up: never a refusal)
        return None


def stash(ann, path: Path) -> bool:
    """(A snapshot's load, right after ``ann``'s graph was) keep the seeds of ``path`` for the graph just loaded:
    :meth:`.dense_low.LowSeeds.prepare` takes them while it is still that graph (not one a compaction made since).
    :returns: whether ``path`` was read (False: absent or unreadable)."""
    saved = decode(path)
    ann.saved_seeds = None if saved is None else (ann._index, saved)  # noqa: SLF001
    return saved is not None


def take(ann) -> tuple | None:
    """The seeds :func:`stash` kept for ``ann``'s current graph, once (None: none, another graph, or unfit)."""
    got, ann.saved_seeds = getattr(ann, "saved_seeds", None), None
    if got is None or got[0] is not ann._index or not valid(got[1], ann):  # noqa: SLF001
        return None
    return got[1]


def valid(saved: tuple, ann) -> bool:
    """Whether a :func:`decode` state fits ``ann``'s graph: its dimension, seeds among the ``seen``
    first vectors, ``built_at <= seen <= ntotal``."""
    probes, thresh, ids, built_at, seen = saved
    a = int(ann._index.ntotal)  # noqa: SLF001
    return (probes.ndim == 2 and probes.shape[1] == ann.dim and thresh.shape == (probes.shape[0],) and ids.ndim == 1
            and 0 <= built_at <= seen <= a and (ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < seen)))


def due(seeds, ann) -> bool:
    """Whether the next query would start a thread making new seeds for ``ann``'s graph (it grew 2x since the
    seeds were built, from ``LowSeeds.REFRESH_MIN`` vectors; none under way): :func:`start_due` starts it between
    requests instead (trial46 #1: until a query came, ``seeds_pending`` read 0 on a graph that had doubled)."""
    index = getattr(ann, "_index", None)  # (None: no ANN, or an IVF not trained yet)
    if index is None or getattr(seeds, "_next", None) is not None or index is not seeds._index:  # noqa: SLF001
        return False
    a = int(ann._index.ntotal)  # noqa: SLF001
    return a >= seeds.REFRESH_MIN and hasattr(ann, "_mut") and a >= 2 * max(seeds._built_at, 8)  # noqa: SLF001


def pending(seeds, ann=None) -> int:
    """Vectors of the graph a thread is making new seeds for (:func:`.dense_low.refresh_seeds`, the graph grew 2x),
    or, with ``ann``, would start making them for (:func:`due`), until the shard takes them (:func:`adopt_done`, or
    the next query); 0 when none. While it is not 0, a HYBRID request's fused scores may still move a little once
    they are taken (``Stats``' ``seeds_pending``)."""
    job = getattr(seeds, "_next", None)
    if job is not None:
        return int(job.a)
    return int(ann._index.ntotal) if due(seeds, ann) else 0  # noqa: SLF001


def done(seeds) -> bool:
    """Whether a :func:`pending` job has finished, so that :func:`adopt_done` would take its seeds."""
    job = getattr(seeds, "_next", None)
    return job is not None and job.thread is not None and not job.thread.is_alive()


def start_due(seeds, ann) -> bool:
    """(Between requests) what the next query's update would do first (``LowSeeds._update``): the new vectors
    tested against the probes and, the graph having doubled, the thread started. :returns: whether it was due."""
    if not due(seeds, ann):
        return False
    seeds._update(ann)  # noqa: SLF001
    return True


def take_built(seeds, ann):
    """(Between requests) the seeds a background compaction's thread built for its new graph (``ann.seeds``), in place
    of ``seeds`` and kept for the snapshot (:func:`mark`), or ``seeds`` when there are none. Taken by the next query
    before this, a snapshot taken with no query between kept no seeds for the new graph, and a restart built others
    over the final graph (trial47c: HYBRID scores moved after a restart)."""
    built = getattr(ann, "seeds", None)
    if built is None:
        return seeds
    ann.seeds = None
    if getattr(ann, "_index", None) is built._index:  # noqa: SLF001
        mark(built, ann)
        return built
    return seeds


def adopt_done(seeds, ann) -> bool:
    """(Between requests) take the seeds of a finished :func:`pending` job for ``ann``'s graph, as the next query's
    update would (``LowSeeds._adopt``), so that the shard settles without a query; a job for a graph since replaced
    is dropped (the next query that needs seeds makes them, as before). :returns: whether a job was taken or dropped."""
    if not done(seeds):
        return False
    if getattr(ann, "_index", None) is not None and ann._index is seeds._index:  # noqa: SLF001
        seeds._adopt(seeds._next)  # noqa: SLF001
        mark(seeds, ann)
    else:
        seeds._next = None  # noqa: SLF001
    return True
