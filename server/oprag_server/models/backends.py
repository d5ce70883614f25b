"""The generator backend named by :class:`~oprag_server.config.GenerateConfig`:

* ``builtin`` / ``smollm2`` / a local directory: :class:`~oprag_server.models.generator.HFGenerator`
  (in-process, batched by the query executor);
* ``openai``: :class:`~oprag_server.models.openai_engine.OpenAIGenerator` on ``url``;
* ``transformers-serve``: :class:`~oprag_server.models.managed_engine.TransformersServeGenerator`;
* ``none``: no generator.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oprag_server.config import GenerateConfig, default_cache_dir

#: Environment variable holding the engine's API key (when no key file is given).
API_KEY_ENV = "OPRAG_GENERATOR_API_KEY"


def _tls_verify(v: str) -> bool | str:
    low = v.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    if not Path(v).is_file():
        raise ValueError(f"--generator-tls-verify: expected true, false or a CA bundle file, got {v!r}")
    return v


def api_key(cfg: GenerateConfig) -> str:
    """The engine API key: first line of ``api_key_file``, else ``$OPRAG_GENERATOR_API_KEY``,
    else ``"none"``. :raises ValueError: the key file cannot be read."""
    if cfg.api_key_file is not None:
        try:
            return Path(cfg.api_key_file).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ValueError(f"--generator-api-key-file {cfg.api_key_file}: cannot read a key ({exc})") from exc
    return os.environ.get(API_KEY_ENV, "") or "none"


def load_backend(cfg: GenerateConfig, cache_dir: Path | None = None) -> Any | None:
    """The (not yet warmed up) generator of ``cfg``; None for ``"none"``.

    :raises ValueError: unknown model, unreadable key file, bad TLS setting.
    """
    common = {"timeout_s": cfg.timeout_s, "max_inflight": cfg.max_inflight}
    if cfg.model == "openai":
        from .openai_engine import OpenAIGenerator

        local = Path(cfg.engine_model).expanduser()
        tok = local if (local / "tokenizer_config.json").is_file() else None
        return OpenAIGenerator(cfg.url, cfg.engine_model, api_key=api_key(cfg), tokenizer_dir=tok,
                               tls_verify=_tls_verify(cfg.tls_verify), **common)
    if cfg.model == "transformers-serve":
        from .managed_engine import TransformersServeGenerator

        return TransformersServeGenerator(cfg.engine_model or "smollm2", cache_dir or default_cache_dir(),
                                          continuous_batching=cfg.continuous_batching,
                                          device=cfg.device,
                                          start_timeout_s=cfg.engine_start_timeout_s, **common)
    from .generator import load_generator

    return load_generator("smollm2" if cfg.model == "builtin" else cfg.model, device=cfg.device, cache_dir=cache_dir)
