"""A snapshot's BM25 postings as the segment plus the delta, instead of one merged segment.

Before this, every snapshot merged the delta into a new segment first (``PostingsIndex.save``
needed one segment holding exactly the live chunks). At 1M chunks that merge rewrote a shard's
~0.74 GB segment to fold in the few thousand chunks written since the last snapshot: 0.7-3.0 s a
shard, during which the shard held every write (bench/RESULTS.md, sessions 54-55). Now, when
the delta holds only chunks added after every segment chunk and none was removed, the
snapshot keeps the segment's files (linked, :mod:`.files`) and writes the delta beside them in
``delta.npz``; a load rebuilds the delta from it, and the merge happens later, when its own rules
(:meth:`.merging.MergeMixin.maybe_merge`, :meth:`~.merging.MergeMixin.idle_merge_due`) say so,
without holding writes.

``delta.npz`` (``numpy.savez``, no pickles):

* ``slots`` int64 ``[m]`` ascending: the delta's chunks, numbered as the shard numbered them when
  it wrote the snapshot. A load numbers the chunks ``0..n-1`` in slot order, so these become
  ``s..s+m-1`` after the segment's ``s`` chunks (:func:`restore`);
* ``lens`` int64 ``[m]``: their lengths in tokens;
* ``terms_utf8`` uint8 / ``terms_end`` int64 ``[T]``: the delta's term strings (its term id ``t`` is
  ``terms_utf8[terms_end[t-1]:terms_end[t]]``);
* ``key<i>`` int64 / ``tf<i>`` int32 per run ``i`` of :class:`.delta.Delta` (``tid << 32 | slot``,
  ascending), kept as the runs are (no merge of runs at the snapshot);
* ``crc32`` int64 ``[1]``: zlib's CRC-32 of the arrays above (names, dtypes, shapes, bytes), checked
  by a load, so that a damaged byte is refused rather than served (as the chunk files', session 54).

Scores after a load are the ones before it: the same postings, tf and lengths per chunk, and the
same layers (segment, then delta) summed in query-term order (:mod:`oprag_server.index.bm25`).
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from .delta import Delta
from .merging import _DELTA, _SEG

#: the file, beside the segment's under the snapshot's ``postings`` directory
NAME = "delta.npz"
_LOW = np.int64(0xFFFFFFFF)


def keeps(ix) -> bool:
    """True when a snapshot of ``ix`` (a :class:`.postings.PostingsIndex`) may write its delta
    beside the segment instead of merging first: no merge under way, no removed chunk whose
    postings are still in the segment or the delta, every delta chunk added after (at a higher
    slot than) every segment chunk, a non-empty segment and a delta the write-time rule has not
    merged yet (at most ``MERGE_MIN`` postings or 1/``MERGE_DIV`` of the segment's: larger only while
    the merge gate holds a write-time merge back; a load then rebuilds at most that many postings).
    O(capacity) (one count over the per-slot layer codes)."""
    seg, delta = ix._seg, ix._delta  # noqa: SLF001 - the index's own state, read
    if ix._pending is not None or ix._frozen is not None or ix._seg_dead or delta.dead:  # noqa: SLF001
        return False
    if seg.n_postings == 0 or delta.n > max(ix.MERGE_MIN, seg.n_postings // ix.MERGE_DIV):
        return False
    if int(np.count_nonzero(ix._where == _SEG)) != seg.doc_slots.size:  # noqa: SLF001 - (a removed empty chunk)
        return False
    return not delta.docs or not seg.doc_slots.size or min(delta.docs) > int(seg.doc_slots[-1])


def write(ix, d: Path) -> list[Path]:
    """Write ``ix``'s delta under ``d`` (its snapshot's ``postings`` directory) when it holds a
    chunk. :returns: the file written, or nothing. :raises ValueError: :func:`keeps` is false
    (the caller merges first). :raises OSError: from the write."""
    out = Path(d) / NAME
    out.unlink(missing_ok=True)  # (never written in place)
    delta = ix._delta  # noqa: SLF001
    if not delta.docs:
        return []
    if not keeps(ix):
        raise ValueError("the BM25 delta cannot be saved beside the segment: merge it first")
    slots = np.fromiter(sorted(delta.docs), np.int64, count=len(delta.docs))
    enc = [t.encode("utf-8") for t in delta.terms]
    arrays = {"slots": slots, "lens": ix._doc_len[slots].astype(np.int64),  # noqa: SLF001
              "terms_utf8": np.frombuffer(b"".join(enc), np.uint8),
              "terms_end": np.cumsum(np.fromiter(map(len, enc), np.int64, count=len(enc)))}
    for i, (k, t) in enumerate(delta.runs):
        arrays[f"key{i}"], arrays[f"tf{i}"] = k, t
    arrays["crc32"] = np.array([_crc(arrays)], np.int64)
    with open(out, "wb") as f:
        np.savez(f, **arrays)
    return [out]


def restore(ix, d: Path) -> None:
    """Rebuild the delta a snapshot wrote under ``d`` into ``ix``, just loaded from the segment
    there (chunks ``0..s-1``): its chunks become slots ``s..s+m-1``. Nothing when the file is absent.

    :raises ValueError: the file's arrays do not fit together (a slot not in ``slots``, a term id
        past the terms, unsorted keys, lengths or tf out of range): the caller then re-analyses
        the stored texts. :raises OSError: it cannot be read."""
    p = Path(d) / NAME
    if not p.exists():
        return
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {n: z[n] for n in z.files}
        old, lens, blob, ends = (np.asarray(arrays[k]) for k in ("slots", "lens", "terms_utf8", "terms_end"))
        runs = [(np.asarray(arrays[f"key{i}"], np.int64), np.asarray(arrays[f"tf{i}"], np.int32))
                for i in range(sum(n.startswith("key") for n in arrays))]
        crc = int(arrays.pop("crc32")[0])
    except (zipfile.BadZipFile, KeyError, EOFError, IndexError) as exc:  # (a cut or damaged file)
        raise ValueError(f"{p}: cannot be read as the delta's arrays: {exc}") from exc
    if crc != _crc(arrays):
        raise ValueError(f"{p}: the delta's arrays do not match their CRC-32 (the file is damaged)")
    m, s = int(old.size), len(ix)
    T = int(ends.size)
    if (lens.shape != (m,) or (m and (np.any(old[1:] <= old[:-1]) or np.any(lens < 0)))
            or (T and (np.any(ends[1:] < ends[:-1]) or ends[0] < 0 or int(ends[-1]) != blob.size))):
        raise ValueError(f"{p}: the delta's chunks or terms do not fit together")
    b = blob.tobytes()
    starts = np.concatenate([[0], ends[:-1]]).tolist()
    terms = [b[a:e].decode("utf-8") for a, e in zip(starts, ends.tolist())]
    delta, df = Delta(), np.zeros(T, np.int64)
    dense = bool(m) and int(old[-1]) - int(old[0]) + 1 == m  # (the usual case: the slots have no holes)
    for k, tf in runs:
        if k.shape != tf.shape or (k.size and (np.any(k[1:] <= k[:-1]) or int(k[-1] >> 32) >= T or tf.min() < 1)):
            raise ValueError(f"{p}: a run of the delta's keys is out of order, or a term id or tf out of range")
        sl = k & _LOW
        if dense and (not k.size or (int(sl.min()) >= int(old[0]) and int(sl.max()) <= int(old[-1]))):
            new = k + (s - int(old[0]))  # (the slot bits only: every slot + s - old[0] stays below 2**31)
        else:
            at = np.searchsorted(old, sl)
            if np.any(at >= m) or np.any(old[np.minimum(at, max(m - 1, 0))] != sl):
                raise ValueError(f"{p}: a posting of the delta names a chunk the file does not list")
            new = (k & ~_LOW) | (at + s)
        del sl
        delta.runs.append((new, tf))
        df += np.bincount(k >> 32, minlength=T)
    delta.vocab, delta.terms = {t: i for i, t in enumerate(terms)}, terms
    if len(delta.vocab) != T:
        raise ValueError(f"{p}: the delta's terms repeat")
    keys = np.concatenate([k for k, _ in delta.runs]) if delta.runs else np.zeros(0, np.int64)
    lo = (keys & _LOW).astype(np.int32)
    by = np.argsort(lo, kind="stable")  # per chunk (all in one run), its term ids ascending
    cut = np.searchsorted(lo[by], np.arange(s, s + m + 1))
    kt = (keys >> 32)[by]
    del lo, by, keys
    slots = np.arange(s, s + m, dtype=np.int64)
    delta.docs = {int(sl): kt[a:e] for sl, a, e in zip(slots.tolist(), cut[:-1].tolist(), cut[1:].tolist())}
    u = np.flatnonzero(df)
    delta._counted(u, df[u], int(kt.size), m)  # noqa: SLF001 - the df, posting count and bytes an add keeps
    if m:
        ix._grow(s + m - 1)  # noqa: SLF001
    ix._delta = delta  # noqa: SLF001
    ix._live[slots], ix._where[slots], ix._doc_len[slots] = True, _DELTA, lens  # noqa: SLF001
    ix._n_live += m  # noqa: SLF001
    ix._total_len += int(lens.sum())  # noqa: SLF001


def _crc(arrays: dict) -> int:
    """CRC-32 (zlib) of the arrays' names, dtypes and bytes, in the order written."""
    c = 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        c = zlib.crc32(a.data, zlib.crc32(f"{name}:{a.dtype.str}:{a.shape}".encode(), c))
    return c
