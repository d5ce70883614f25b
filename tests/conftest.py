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
