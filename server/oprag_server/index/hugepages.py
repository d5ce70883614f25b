"""Transparent huge pages for the large arrays a shard reads at random (issue 13, served11).

numpy asks for huge pages on its own large allocations (``madvise(MADV_HUGEPAGE)``), but FAISS's
C++ buffers get none under the kernel's usual ``madvise`` THP mode: at 500K vectors per shard the
HNSW storage (768 MB of float32 rows) and its neighbour lists (~140 MB) sit on 4 KB pages, and
a query's graph walk and canonical rows touch a few thousand of those pages at random, nearly
every one a TLB miss with a page-table walk. :func:`advise` marks such a buffer
``MADV_HUGEPAGE`` and, with ``collapse``, folds its present pages into 2 MB ones now
(``MADV_COLLAPSE``, Linux >= 6.1) instead of waiting for khugepaged. The bytes are the same:
nothing read from them changes, only how the addresses are translated.

Best effort: on a kernel or platform without these calls :func:`advise` returns False and
nothing else happens.
"""

from __future__ import annotations

import ctypes
import errno
import sys
import threading

import numpy as np

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_HUGE = 1 << 21

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        f = lib.madvise
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _libc = f
    return _libc


def span(addr: int, nbytes: int) -> tuple[int, int]:
    """``(start, length)``: the 2 MB-aligned part of ``[addr, addr + nbytes)`` (length 0 when
    it holds no whole huge page)."""
    lo = (addr + _HUGE - 1) & ~(_HUGE - 1)
    hi = (addr + nbytes) & ~(_HUGE - 1)
    return lo, max(hi - lo, 0)


def advise(a: np.ndarray, collapse: bool = False) -> bool:
    """Ask for huge pages under the whole 2 MB pages of ``a``'s buffer (C-contiguous); with
    ``collapse`` also fold its present pages into huge pages now. :returns: True when the
    kernel accepted every call (False: not Linux, too small, or refused; nothing changed then
    beyond what was accepted)."""
    if not sys.platform.startswith("linux") or not a.flags.c_contiguous:
        return False
    lo, n = span(int(a.ctypes.data), int(a.nbytes))
    if n == 0:
        return False
    try:
        f = _madvise()
    except (OSError, AttributeError):
        return False
    if f(lo, n, MADV_HUGEPAGE) != 0:
        return False
    for _ in range(3 if collapse else 0):  # EAGAIN: a page was busy (transient), try again
        if f(lo, n, MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            return False
    return not collapse


def _numpy_asks(on: bool) -> bool:
    """Turn numpy's own ``MADV_HUGEPAGE`` on large allocations on or off (a private numpy switch, process-wide);
    :returns: what it was (True where the switch is missing: nothing changed)."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # noqa: PLC0415
    except ImportError:  # (numpy 1.x kept it in numpy.core)
        try:
            from numpy.core.multiarray import _set_madvise_hugepage  # noqa: PLC0415
        except ImportError:
            return True
    return bool(_set_madvise_hugepage(on))


def grown(rows: np.ndarray, capacity: int) -> np.ndarray:
    """A zeroed C-contiguous array of ``capacity`` rows shaped and typed as ``rows``, ``rows`` copied into its start;
    from :data:`GROW_QUIET` bytes on, huge pages folded in after the copy, by a thread (issue 13, session 40).

    Under the kernel's ``madvise`` THP mode with ``defrag`` ``madvise``, the first write to each 2 MB of a fresh
    numpy buffer (numpy asks for huge pages itself) compacts memory for a huge page in that write: a shard's
    float32 copy grown from 262,144 to 524,288 rows took 0.90 s in the writing apply against 0.21 s on 4 KB pages and
    0.07 s when freed huge pages were at hand (bench/RESULTS.md, session 40). So a large copy faults in 4 KB pages
    and a thread of its own then folds them (:func:`advise` with ``collapse``: the syscall leaves the GIL), since a
    flat scan of 500K rows on 4 KB pages takes 1.26x its time on huge pages (28.5 vs 22.5 ms).
    """
    quiet = rows.nbytes >= GROW_QUIET
    was = _numpy_asks(False) if quiet else False
    try:
        out = np.zeros((int(capacity),) + rows.shape[1:], dtype=rows.dtype)
    finally:
        if was:
            _numpy_asks(True)
    out[: rows.shape[0]] = rows
    if quiet:  # not a daemon: an exit waits for the syscall (a daemon thread ended in a foreign call may abort)
        threading.Thread(target=advise, args=(out, True), name="oprag-hugepages").start()
    return out


#: copies of at least this many bytes grow without huge page faults (:func:`grown`)
GROW_QUIET = 64 << 20
