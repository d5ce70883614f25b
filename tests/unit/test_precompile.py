"""``python -m oprag_server.precompile`` (run by ``make install``) reaches every kernel module the
start-up check counts (startup.JIT_MODULES), and each has the ``warm()`` it calls."""

from __future__ import annotations

import importlib

from oprag_server import precompile, startup


def test_every_kernel_module_is_precompiled_by_its_warm():
    names = precompile.kernel_modules()
    _, total = startup.uncached_kernels()
    assert len(names) == total >= 10
    assert "oprag_server.index.kernels_exact" in names and "oprag_server.operators.union" in names
    for name in names:
        assert callable(getattr(importlib.import_module(name), "warm", None)), name
