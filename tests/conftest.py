"""Shared fixtures: offline model loading, a shared model cache, free loopback ports."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One converted-model cache for the whole test session (GGUF conversion takes ~20 s once).
os.environ.setdefault("OPRAG_CACHE_DIR", str(Path(tempfile.gettempdir()) / "oprag-test-cache"))

