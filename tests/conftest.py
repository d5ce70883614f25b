"""Shared fixtures: offline model loading, a shared model cache, free loopback ports."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP threads spin while they wait by default; on a 2-core machine shared with shard
# processes (and other jobs) a spinning thread holds the core its partner needs, and a 16-token
# SmolLM2 batch took 19-26 s instead of 2-4 s (load ~5). Sleeping waits keep the tests' time
# independent of the machine's load. Set before torch is imported; servers the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# MKL strict reproducibility, as `import oprag_server` sets it (the CPU encoder's batch invariance
# needs it before MKL's first call): here too, in case a test module calls torch before importing it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# One converted-model cache for the whole test session (GGUF conversion takes ~20 s once).
os.environ.setdefault("OPRAG_CACHE_DIR", str(Path(tempfile.gettempdir()) / "oprag-test-cache"))


# Test servers forked from a process that has imported torch and transformers once (about 5 s
# less per start; tests/server_zygote.py). OPRAG_TEST_FORK=0: plain subprocesses.
from oprag_client.testing import ServerProcess  # noqa: E402

from tests import server_zygote  # noqa: E402

ServerProcess.launcher = staticmethod(server_zygote.launcher)


# The modules that took longest in `make test` (per-test times of a 3-worker run, bench/RESULTS.md session 57), run
# first: pytest-xdist's --dist loadfile hands whole modules to the workers in collection order, so a long module
# collected last ran alone at the end (the suite sat at 10:00-10:36 with the cores half idle). Longest first is the
# classic way to shorten such a schedule; every other module keeps its place after them.
HEAVY_FIRST = (
    "unit/test_generator.py", "integration/test_engine.py", "integration/test_http.py", "integration/test_service.py",
    "integration/test_damaged_logs.py", "integration/test_trial18_server.py", "unit/test_chunking.py",
    "integration/test_hybrid_first_round.py", "integration/test_trial15.py", "integration/test_durability.py",
    "unit/test_encoder.py", "integration/test_fix21c.py", "integration/test_fix23b.py", "integration/test_security.py",
    "integration/test_det17.py", "unit/test_fix21d_prefill.py", "integration/test_fix22a.py",
    "integration/test_fix23a.py", "unit/test_seeds_snapshot.py", "integration/test_refused_start_keeps_logs.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}

    def key(pair):
        i, item = pair
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return (rank.get(path, len(rank)), i)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
