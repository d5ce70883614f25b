"""Compile every numba kernel into numba's on-disk cache ahead of the first start:
``python -m oprag_server.precompile`` (``make install`` runs it). Otherwise the first server
start compiles them in its shard processes (~95 s on a 2-core machine, logged as "compiling
search kernels, first start only"), and so does the first test that starts a server.

Each kernel module (:data:`.startup.JIT_MODULES`) has a ``warm()`` that compiles, or loads from
the cache, the signatures a shard or the frontend passes (writable and read-only arrays); then
:mod:`.warm_workload` runs a shard's paths end to end (staging, every query mode, a snapshot and
its load) for the signatures those reach beyond them. The
cache is where a server started from this installation looks (:func:`.startup.uncached_kernels`);
an upgrade that changes a kernel module's source makes the cache of every kernel module stale (a
kernel compiled in holds the other modules' functions it calls), and the next start (or this
command) deletes those caches and compiles again.

Exit status: 0 when every kernel module is cached afterwards, 1 otherwise (the start still works:
it compiles what is missing).
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

from . import warm_workload
from .startup import JIT_MODULES, uncached_kernels


def kernel_modules(package: Path | None = None) -> list[str]:
    """Dotted names (``oprag_server.index.kernels``, ...) of the files :data:`.startup.JIT_MODULES` matches."""
    package = package or Path(__file__).resolve().parent
    files = sorted(p for pattern in JIT_MODULES for p in package.glob(pattern))
    return [".".join((__package__, *p.relative_to(package).with_suffix("").parts)) for p in files]


def main() -> int:
    t0 = time.perf_counter()
    uncached_kernels(drop=True)  # caches older than any kernel source: compiled anew below
    for name in kernel_modules():
        t = time.perf_counter()
        importlib.import_module(name).warm()
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    try:  # the signatures the served paths reach beyond warm()'s (warm_workload.py): each cost a request 1-7 s
        warm_workload.run()
        print(f"a shard's paths (oprag_server.warm_workload): {time.perf_counter() - t:.1f} s", flush=True)
    except Exception as exc:  # noqa: BLE001 - what it did not compile, the first use does
        print(f"a shard's paths (oprag_server.warm_workload) failed: {exc!r}", flush=True)
    cold, total = uncached_kernels()
    print(f"numba kernels: {total - len(cold)} of {total} modules cached in {time.perf_counter() - t0:.1f} s"
          + (f"; not cached: {', '.join(p.name for p in cold)}" if cold else ""), flush=True)
    return 1 if cold else 0


if __name__ == "__main__":
    sys.exit(main())
