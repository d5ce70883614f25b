"""Merges of a shard's BM25 postings (:class:`~.postings.PostingsIndex`): fold the delta into
a new immutable segment, either in the caller's thread or in a background thread that builds
from an immutable view (the segment, copies of the live masks, the frozen delta) while the
index keeps serving queries and taking writes into a fresh delta; the owner installs the
result between operations (:meth:`MergeMixin.poll_merge`), marking dead whatever was removed
meanwhile.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from . import listed_cache
from .delta import Delta
from .files import file_ids
from .seg_merge import merge

_POSTING_BYTES = 10  # a segment's bytes per posting (int32 slot, uint16 tf, int32 forward term id)

#: where a slot's live postings are (``PostingsIndex._where``, int8 per slot)
_NONE, _SEG, _FROZEN, _DELTA = 0, 1, 2, 3


def _drop(parts: list) -> None:
    """Free ``parts``, what an install replaced (a previous segment: a 1M shard's is ~700 MB,
    possibly a file map; a frozen delta: a dict entry per chunk; the top-m's rows), on a thread of
    its own (:func:`_dropper`, started with the merge: the install only queues them)."""
    _drop_thread()
    _DROPS.put(parts)


def _drop_thread() -> None:
    """Start the thread of :func:`_drop` unless it runs (a forked process has none)."""
    global _DROPPER
    with _DROP_LOCK:
        if _DROPPER is None or not _DROPPER.is_alive():
            _DROPPER = threading.Thread(target=_dropper, name="bm25-drop", daemon=True)
            _DROPPER.start()


def _dropper() -> None:
    while True:
        parts = _DROPS.get()
        while parts:
            p = parts.pop()
            if isinstance(p, Delta):  # entry by entry: the request loop gets the GIL back in between
                while p.docs:
                    p.docs.popitem()
            del p
        del parts


_DROPS: queue.SimpleQueue = queue.SimpleQueue()
_DROP_LOCK = threading.Lock()
_DROPPER: threading.Thread | None = None


class MergeMixin:
    """Layers (segment, frozen delta, delta) and the merge life cycle of
    :class:`~.postings.PostingsIndex` (uses its private state)."""

    #: a shard whose writes went quiet merges a delta of 1/IDLE_DIV of the segment's postings
    #: (:meth:`idle_merge_due`). Issue 13, settle11 (bench.delta_cost, 1M): a 3-6% delta costs a
    #: shard's BM25 part of a query 1.4-2.4 ms more (+40-70%), 12-25% ~4.2 ms; a merge at 1M is
    #: ~2-3 s of one core, the work the next periodic snapshot would do in the foreground anyway
    IDLE_DIV = 64
    #: :class:`.merge_gate.MergeGate` held for each merge's build (set by the shard that owns the
    #: index; None: no coordination): a background merge the gate refuses is not started, and
    #: none is tried again before ``gate_retry_at`` (``time.monotonic()``), GATE_RETRY_S later
    gate = None
    gate_retry_at = 0.0
    GATE_RETRY_S = 0.5
    #: merged segments moved out of memory (:attr:`SPILL_MIN_BYTES`)
    spills = 0
    #: a background merge under a gate moves a new segment of at least this many array bytes
    #: out of anonymous memory before it gives the gate back (:meth:`.segment.Segment.spill`
    #: into :meth:`.merge_gate.MergeGate.spill_dir`), so that the next shard's merge does not
    #: run beside it (issue 13: a 1M-chunk shard's is ~700 MB; 10K chunks' ~5 MB stay). A
    #: foreground merge (a snapshot's) does not: the snapshot writes and maps the segment next.
    SPILL_MIN_BYTES = 64 << 20

    def _layers(self) -> list[Delta]:
        return [self._delta] if self._frozen is None else [self._frozen, self._delta]

    def _delta_layers(self) -> list[tuple[Delta, int]]:
        d = [(self._delta, _DELTA)]
        return d if self._frozen is None else [(self._frozen, _FROZEN), *d]

    def _term_arrays(self, term: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Live postings of ``term``: ``(slots int64 ascending, tf uint16/uint32/float64)``."""
        parts = []
        tid = self._seg.vocab.get(term)
        if tid is not None and self._seg_df[tid]:
            ps, ptf = self._seg.postings(tid)
            if self._seg_dead:
                m = self._where[ps] == _SEG
                ps, ptf = ps[m], ptf[m]
            parts.append((ps.astype(np.int64), ptf))  # (int32 fancy indexes convert on every use)
        for layer, code in self._delta_layers():
            a = layer.arrays(term, self._where, code)
            if a is not None:
                parts.append(a)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        s = np.concatenate([p[0] for p in parts])
        tf = np.concatenate([p[1] for p in parts])
        if np.any(s[1:] < s[:-1]):  # a delta slot below a segment slot
            order = np.argsort(s, kind="stable")
            s, tf = s[order], tf[order]
        return s, tf

    def merge(self, background: bool = False) -> None:
        """Fold the delta into a new segment without the dead postings, then swap it in,
        waiting for it (a background merge under way finishes first); with ``background`` only
        start it in a thread (see :meth:`maybe_merge`). Scores are unchanged (same postings,
        same summation order)."""
        self.wait_merge()
        if (self._frozen is None and not self._delta.docs and not self._seg_dead
                and int(np.count_nonzero(self._where == _SEG)) == self._seg.doc_slots.size):
            # nothing to fold (an idle merge ran since the last write): the segment holds exactly
            # the live chunks and postings (a removed empty chunk has no dead postings, hence the
            # count), and rebuilding it would cost a 1M shard ~5 s (a snapshot merges)
            if self._delta.runs:  # only removed chunks' postings left: drop them
                self._delta = Delta()
            return
        self._start_merge(background=background)

    def maybe_merge(self, background: bool = False) -> bool:
        """Install a finished background merge, then merge when the delta or the dead
        postings pass their thresholds (see the class docstring). With ``background`` the new
        segment is built in a thread from an immutable view (the segment, a copy of the live
        mask and the frozen delta) while this index keeps serving and taking writes (into a
        new delta); a later call installs it (:meth:`poll_merge`).

        :returns: True if it merged or started a merge."""
        self.poll_merge(raise_errors=False)
        if self._pending is not None or (background and time.monotonic() < self.gate_retry_at):
            return False
        p = self._seg.n_postings
        if self._delta.n >= max(self.MERGE_MIN, p // self.MERGE_DIV) or self._seg_dead >= max(self.MERGE_MIN, p // 4):
            return self._start_merge(background)
        return False

    def idle_merge_due(self, small: bool = False) -> bool:
        """True when no merge is under way and the delta holds at least :attr:`MERGE_MIN`
        postings and 1/:attr:`IDLE_DIV` of the segment's (or dead postings reach that share):
        a shard whose writes have gone quiet then merges (:meth:`..shards.state.ShardState.idle_step`),
        below the write-time rule's 1/:attr:`MERGE_DIV`. With ``small``: :attr:`MERGE_MIN` alone, the
        rule after a longer quiet time (a snapshot no longer merges a small delta, :mod:`.delta_files`)."""
        if self._pending is not None:
            return False
        least = self.MERGE_MIN if small else max(self.MERGE_MIN, self._seg.n_postings // self.IDLE_DIV)
        return self._delta.n >= least or self._seg_dead >= least

    def merge_pending(self) -> int:
        """Delta postings a merge is folding in (a background merge under way or not installed
        yet) or that an idle merge will fold (:meth:`idle_merge_due`, ``small`` too); 0 when neither."""
        if self._pending is not None:
            return max(1, (self._frozen.n if self._frozen is not None else 0) + self._delta.n)
        return max(1, self._delta.n) if self.idle_merge_due(small=True) else 0

    @property
    def merging(self) -> bool:
        """True while a background merge is under way or waiting to be installed."""
        return self._pending is not None

    def poll_merge(self, raise_errors: bool = True) -> bool:
        """Install a finished background merge. :returns: True if one was installed.

        A merge that failed leaves the index serving from its delta (nothing is lost); its
        exception is kept in ``last_merge_error`` and raised here when ``raise_errors``.
        """
        if self._pending is None or self._pending[0].is_alive():
            return False
        try:
            self._finish()
        except Exception as exc:
            self.last_merge_error = exc
            if raise_errors:
                raise
            return False
        return True

    def wait_merge(self) -> None:
        """Wait for a background merge under way and install it."""
        if self._pending is not None:
            self._pending[0].join()
            self._finish()

    def _start_merge(self, background: bool) -> bool:
        """Freeze the delta and build the merged segment from an immutable view (in a thread with
        ``background``). The request loop's part is O(capacity) memory at most (the layer codes
        turned and copied); the thread computes the masks, the frozen chunks, the new segment's
        per-term counts and what the BM25 top-m keeps per segment (:func:`.listed_top.successor`),
        so that :meth:`_finish` is O(changes made during the merge).

        The build holds :attr:`gate` (when set): a foreground merge waits for it, a background
        one is not started while another shard's merge holds it (:returns: False then)."""
        gate = self.gate
        if gate is not None and not gate.acquire(blocking=not background):
            self.gate_retry_at = time.monotonic() + self.GATE_RETRY_S
            return False
        frozen = self._delta
        self._delta = Delta()
        self._frozen = frozen
        frozen._cache.clear()
        where = self._where
        where[where == _DELTA] = _FROZEN
        view = where.copy()  # (the layer codes at the start: where keeps changing meanwhile)
        self._gone = []  # segment and frozen chunks removed while the merge runs (PostingsIndex.remove)
        seg, d_terms, doc_len = self._seg, list(frozen.terms), self._doc_len
        pending: list = [None, None, 0.0, None]

        def build() -> None:
            from .listed_top import successor  # noqa: PLC0415 - it imports this package

            t0 = time.perf_counter()
            try:
                seg_live, frz_live = view == _SEG, view == _FROZEN
                d_doc_slots = np.flatnonzero(frz_live)  # == sorted(frozen.docs) at the start
                key, tf = frozen.consolidated()
                m = frz_live[key & 0xFFFFFFFF]
                if not m.all():  # (rebound: the unfiltered arrays are not kept through the merge)
                    key, tf = key[m], tf[m]
                m = None
                # a large background merge writes its posting arrays into the spill directory as
                # it builds them (seg_merge.merge's out_dir): not all held in memory at once
                spills = background and gate is not None
                out = (gate.spill_dir() if spills
                       and (seg.slots.size + key.size) * _POSTING_BYTES >= self.SPILL_MIN_BYTES else None)
                try:
                    new = merge(seg, seg_live, d_terms, key, tf, d_doc_slots, out_dir=out)
                except BaseException:
                    if out is not None:
                        shutil.rmtree(out, ignore_errors=True)
                    raise
                key = tf = None
                try:  # (a cache: should it fail, the first queries after the install build it, as before)
                    top = successor(self, new, seg_live | frz_live, doc_len)
                except Exception:  # noqa: BLE001
                    top = (new, None, None)
                if out is not None or (spills and new.unmapped_nbytes() >= self.SPILL_MIN_BYTES):
                    if new.spill(out if out is not None else gate.spill_dir()):
                        self.spills += 1
                pending[3] = (new.df(), d_doc_slots, top)
                pending[1] = new
            except BaseException as e:  # re-raised by _finish in the owner's thread
                pending[1] = e
            finally:
                if gate is not None:
                    gate.release()
            pending[2] = time.perf_counter() - t0

        if background:
            _drop_thread()  # (now, not at the install: starting a thread waits until it runs)
            pending[0] = threading.Thread(target=build, name="bm25-merge", daemon=True)
            self._pending = pending
            try:
                pending[0].start()
            except BaseException:  # (no thread will release it)
                if gate is not None:
                    gate.release()
                raise
        else:
            build()
            self._pending = pending
            self._finish()
        return True

    def _finish(self) -> None:
        """Install the merged segment, on the owner's thread: O(the frozen chunks + the chunks
        removed during the merge), not O(segment). Chunks removed (or re-added elsewhere) since
        the merge started are dead in it. What the install replaces (the previous segment, the
        frozen delta, the top-m's per-segment parts) is freed by a thread of its own."""
        t0 = time.perf_counter()
        _, new, build_s, prepared = self._pending
        self._pending = None
        gone, self._gone = self._gone, []
        if isinstance(new, BaseException):
            # keep serving from the frozen delta: fold it back into the current one's layer
            self._frozen_back()
            raise new
        seg_df, frozen_slots, top = prepared
        fs = frozen_slots[self._where[frozen_slots] == _FROZEN]  # (the others were removed meanwhile)
        self._where[fs] = _SEG
        dead = 0
        if gone:  # their postings in the new segment are dead
            n = np.bincount(new.rows_of(np.asarray(gone, np.int64)))
            seg_df[: n.size] -= n.astype(seg_df.dtype)
            dead = int(n.sum())
        old = [self._seg, self._seg_df, self._frozen]
        self._seg, self._seg_df, self._frozen, self._seg_dead = new, seg_df, None, dead
        from .listed_top import adopt  # noqa: PLC0415 - it imports this package

        old += adopt(self, top)
        old += listed_cache.take(self)  # (the widening cache's entries are views of the former segment)
        _drop(old)
        del old
        self.merges += 1
        self.last_merge_s = build_s
        self.last_swap_s = time.perf_counter() - t0

    #: (weak reference to the segment, directory, whether written as it is: not renumbered) of the
    #: last :meth:`_save_segment`, until the snapshot is complete (:meth:`adopt_files`); None: none
    _saved: tuple | None = None
    #: weak reference to the segment the last complete snapshot holds (renumbered or not)
    _written: weakref.ref | None = None
    #: (weak reference to that segment, its ``doc_len.npy``'s file ids): linked by the next save while it is the same
    _doc_len_src: tuple | None = None

    def _save_segment(self, d: Path) -> list[Path]:
        """Write the segment under ``d``, slots renumbered ``0..n-1`` (a load's). :returns: the files."""
        seg = self._seg
        files, as_is = seg.save_renumbered(d)
        self._saved = (weakref.ref(seg), Path(d), as_is)
        return files

    def unsaved_nbytes(self) -> int:
        """Bytes of the segment held in anonymous memory that no snapshot holds: a segment a
        merge built since the last :meth:`save` (an idle merge after an ingest: ~700 MB per
        1M-chunk shard). 0 for a segment the last save wrote (mapped by :meth:`adopt_files`, or
        renumbered in its files and so kept) once that snapshot is complete (:meth:`adopt_files`;
        not while it is written, when the shard holds the most), or one mapped from its files (a load). The frontend
        takes a snapshot when a shard reports enough (``Runtime._snapshot_loop``), after which
        :meth:`adopt_files` serves it from the files."""
        seg, w = self._seg, self._written
        return 0 if w is not None and w() is seg else seg.unmapped_nbytes()

    def adopt_files(self, d: Path) -> list:
        """Serve the segment from the files :meth:`save` just wrote under ``d``, memory-mapped
        read-only (as a snapshot's load does), instead of its copy in anonymous memory: only the
        pages queries read are then resident, and the kernel may drop them again (clean page
        cache), where the copy kept every posting resident (a 1M-chunk shard's segment is ~700 MB,
        of which a pass of 100 queries read ~160 MB: issue 13, mem17).

        Done only when those files hold this segment as it is now: written by the last
        :meth:`save` (chunks at slots ``0..D-1``: not renumbered) with no merge since. The
        :class:`~.segment.Segment` object stays (:meth:`~.segment.Segment.map_files`: the same
        values, shapes and dtypes): scores are unchanged and the caches keyed by it (the top-m's
        term bounds and wide rows, which hold no view of its arrays) stay valid; the widening
        cache (:mod:`.listed_cache`), whose entries are views of the former arrays, is emptied.
        The index's own thread, while no merge runs.

        :returns: what was replaced (the former arrays, the cache's entries), for the caller to
            free off the request loop; empty when nothing was adopted.
        """
        saved, self._saved = self._saved, None
        self._written = saved and saved[0]  # (the snapshot is complete: it holds that segment)
        if not saved or saved[0]() is not self._seg or saved[1] != Path(d):
            return []
        self._doc_len_src = (saved[0], file_ids(Path(d), ["doc_len.npy"]))  # (the lengths of its chunks: fixed)
        if not saved[2]:  # renumbered in its files: linked by the next snapshot while the segment is the same
            self._seg.note_renumbered(Path(d))
            return []
        if self.merging:
            return []
        old = self._seg.map_files(Path(d))
        return [] if old is None else [*old, *listed_cache.take(self)]

    def _frozen_back(self) -> None:
        frozen = self._frozen
        self._frozen = None
        if frozen is None or not frozen.docs:
            return
        slots = sorted(frozen.docs)
        # re-add the frozen chunks' postings to the current delta (rare: a failed merge)
        key, tf = frozen.consolidated()
        live = frozen.docs
        toks: list[list[str]] = [[] for _ in slots]
        pos = {s: i for i, s in enumerate(slots)}
        for k, c in zip(key.tolist(), tf.tolist()):
            s = k & 0xFFFFFFFF
            if s in live and self._where[s] == _FROZEN:
                toks[pos[s]].extend([frozen.terms[k >> 32]] * c)
        self._delta.add_batch(slots, toks)
        self._where[np.asarray(slots, np.int64)] = _DELTA

