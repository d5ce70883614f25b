"""Batch-invariant greedy decoding on CPU: the row-wise attention and the row alignment.

Goal: a prompt's greedy answer is the same token for token whether it is decoded alone or
inside a batch of prompts of other lengths. On CPU neither ``sdpa`` nor ``eager`` attention is
batch-invariant -- a padded row's logits differ from the same prompt alone by ~3e-5, which can
flip a near-tied argmax. Two sources were measured and removed:

* MKL sgemm gives a row a result that depends on the GEMM's row count M: rows computed in calls
  with M % 4 == 0 (or M >= 12) are bit-identical, rows of the M = 1..3 remainder kernels are
  not. So every forward of the decoding loop (:mod:`oprag_server.models.decoding`) has a row
  count that is a multiple of :data:`ROW_ALIGN` = 4: the prompt width is rounded up to a
  multiple of 4, the prefill keeps 4 logit positions, and the decode batch is topped up with
  dummy copies of a live row.
* Left padding shifts the real keys inside attention's reductions. :func:`rowwise_attention`
  (registered with ``transformers`` as :data:`ROWWISE_ATTENTION`) runs SDPA per row on that
  row's unpadded, contiguous keys, so its inputs and shapes are the same as when the prompt is
  decoded alone.

Result: the logits of a row are bit-identical batched or alone (tested in
``tests/unit/test_generator.py``). Cost at batch 1: ~11 tok/s instead of ~16 tok/s (a 4-row
GEMM is slower than MKL's 1-row path); batch 8 reaches ~65 tok/s.

``torch``/``transformers`` are imported inside the functions, not at module import.
"""

from __future__ import annotations

from typing import Any

#: Name of the attention implementation registered by :func:`register_rowwise` (CPU default
#: of :class:`oprag_server.models.generator.HFGenerator`).
ROWWISE_ATTENTION = "oprag_rowwise"
#: Row alignment that keeps the CPU (MKL sgemm) linear layers batch-invariant.
ROW_ALIGN = 4


def rowwise_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    oprag_pads: list[int] | None = None,
    oprag_lens: list[int] | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention computed one batch row at a time on that row's *unpadded* keys.

    With ``oprag_lens`` (the encoder, :class:`oprag_server.models.encoder.TransformersEncoder`):
    rows are right-padded, ``oprag_lens[r]`` real tokens each, attention is bidirectional, and
    row ``r`` runs SDPA (no mask) on its first ``oprag_lens[r]`` positions only, so its inputs and
    shapes do not depend on the padding width nor on the other rows.

    ``query``: ``[B, H, q, d]``; ``key``/``value``: ``[B, Hkv, kv, d]`` (cache included);
    ``oprag_pads[r]``: number of left-padding key positions of row ``r`` (``-1``: dummy row,
    output zeros). Each real row runs ``scaled_dot_product_attention`` on contiguous tensors
    whose shapes and contents do not depend on the rest of the batch, so its output is
    bit-identical to the same row decoded alone. Returns ``([B, q, H, d], None)``; outputs at
    padded query positions are 0.
    """
    import torch
    import torch.nn.functional as F

    if oprag_lens is not None:
        return _encoder_rows(query, key, value, scaling, oprag_lens)
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


def _encoder_rows(query: Any, key: Any, value: Any, scaling: float | None, lens: list[int]) -> tuple[Any, None]:
    """(:func:`rowwise_attention` with ``oprag_lens``) bidirectional attention of right-padded rows,
    row ``r`` on its first ``lens[r]`` positions only, no mask: ``([B, T, H, d], None)``, 0 at padding."""
    import torch.nn.functional as F

    bsz, heads, width, head_dim = query.shape
    out = query.new_zeros((bsz, width, heads, head_dim))
    for r in range(bsz):
        n = lens[r]
        o = F.scaled_dot_product_attention(
            query[r : r + 1, :, :n, :].contiguous(), key[r : r + 1, :, :n, :].contiguous(),
            value[r : r + 1, :, :n, :].contiguous(), scale=scaling)
        out[r, :n] = o[0].transpose(0, 1)
    return out, None


#: ``mkl_cbwr_set`` / ``mkl_cbwr_get`` flags (``mkl_service.h``).
_MKL_CBWR_ALL, _MKL_CBWR_AUTO, _MKL_CBWR_STRICT = -1, 2, 0x10000


def mkl_strict_cnr() -> bool:
    """Whether Intel MKL in PyTorch's CPU library runs in strict CNR mode, turning it on if possible.

    In strict conditional-numerical-reproducibility mode an MKL sgemm gives a row of the output
    the same bits whatever the row count M and the thread count (measured for the MiniLM
    layers, M = 1..4096, 1 and 2 threads; Intel documents the thread-count part). MKL fixes the
    mode at its first call: ``import oprag_server`` sets ``MKL_CBWR=AUTO,STRICT`` for that, and
    this function tries ``mkl_cbwr_set`` in case MKL has not been called yet. Linux/macOS
    builds that export ``mkl_serv_cbwr_get`` only; anything else returns False (imports torch).
    """
    import ctypes
    import os

    import torch

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            lib = ctypes.CDLL(os.path.join(lib_dir, name))
            get, set_ = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
        except (OSError, AttributeError):
            continue
        if not get(_MKL_CBWR_ALL) & _MKL_CBWR_STRICT:
            set_(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT)  # fails (< 0) once MKL has run
        return bool(get(_MKL_CBWR_ALL) & _MKL_CBWR_STRICT)
    return False


def register_rowwise() -> None:
    """Register :func:`rowwise_attention` with ``transformers`` as :data:`ROWWISE_ATTENTION`
    (idempotent; imports ``transformers``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
