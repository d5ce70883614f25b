"""The batched greedy decoding loop over an unchanged Hugging Face causal-LM forward.

The left-padded batch is prefilled with an attention mask and ``position_ids = cumsum(mask) -
1``, then one token per step is decoded with the KV cache (``transformers.DynamicCache``). Rows
stop independently (EOS, their own budget, or cancellation) and finished rows are dropped from
the batch (``cache.batch_select_indices``).

The prefill runs in chunks of at most :data:`PREFILL_CHUNK` token columns, counted from the
right (the prompts' common end), so a row's chunk boundaries depend only on its own length;
before each chunk after the first, ``should_stop`` is polled and cancelled rows leave the batch:
a request whose caller went away (deadline, cancel) stops costing prefill after at most one
chunk, and a batch whose rows are all cancelled ends there (trial21: six queries past their
2 s deadline held the generator for a 67 s prefill). With the row-wise attention every forward's row
count is a multiple of :data:`~oprag_server.models.rowwise_attention.ROW_ALIGN`, which makes a
row's logits bit-identical batched or alone (see :mod:`oprag_server.models.rowwise_attention`).

``torch``/``transformers`` are imported inside :func:`greedy_decode`.
"""

from __future__ import annotations

from typing import Any

from .protocols import GenerationResult, OnToken, ShouldStop
from .rowwise_attention import ROW_ALIGN

#: Token columns per prefill forward (a multiple of ROW_ALIGN); ``should_stop`` is polled between
#: chunks. A prompt of at most this many tokens is prefilled in one forward as before.
PREFILL_CHUNK = 128


class StreamDetokenizer:
    """Incremental detokenizer for one row: :meth:`push` a token id, get the text it adds.

    Decodes a sliding window of ids (``prefix`` .. end) and returns only the new suffix; a
    suffix ending in U+FFFD (an incomplete UTF-8 sequence of byte-level BPE) is held back
    until a later token completes it; :meth:`flush` (the end of the answer) drops what is still incomplete then
    (a length cut inside a character). ``text`` is the concatenation of
    every returned delta; ``ids`` every pushed id.
    """

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
        if final:  # a character the length cut left incomplete is dropped, not shown as U+FFFD (trial51 #3)
            new = new.rstrip("\ufffd")
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


def greedy_decode(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    budgets: list[int],
    *,
    device: str,
    pad_token_id: int,
    eos_token_ids: set[int],
    cache_kwarg: str = "cache",
    rowwise: bool = False,
    on_token: OnToken | None = None,
    should_stop: ShouldStop | None = None,
) -> list[GenerationResult]:
    """Greedy-decode already tokenized, validated prompts; rows finish independently.

    :param model: a loaded ``transformers`` causal LM in eval mode on ``device``.
    :param tokenizer: its tokenizer (``decode(ids, skip_special_tokens=True)`` is used).
    :param prompt_ids: one non-empty token id list per prompt (no added specials).
    :param budgets: max new tokens per row (>= 0; EOS counts), e.g. from
        :func:`~oprag_server.models.protocols.validate_budgets`. The caller checks that
        prompt + budget fits the model's context.
    :param device: torch device string of ``model``.
    :param pad_token_id: id used for left padding (masked out).
    :param eos_token_ids: ids that finish a row with ``"stop"`` (not included in its output).
    :param cache_kwarg: name of the forward's KV-cache argument (``"cache"`` or
        ``"past_key_values"``, depending on the ``transformers`` version).
    :param rowwise: the model uses :func:`~oprag_server.models.rowwise_attention.rowwise_attention`
        (pass per-row pad counts, align every forward's row count to ``ROW_ALIGN``).
    :param on_token: ``on_token(row, text_delta)``, called from this thread as text grows.
    :param should_stop: ``should_stop(row)``, polled for unfinished rows before the prefill,
        before each later prefill chunk (:data:`PREFILL_CHUNK`) and before every step.
    :returns: one :class:`~oprag_server.models.protocols.GenerationResult` per prompt, in order.
    """
    import torch

    n = len(prompt_ids)
    results = [
        GenerationResult(text="", token_ids=[], prompt_tokens=len(ids), finish_reason="length")
        for ids in prompt_ids
    ]
    streams = [StreamDetokenizer() for _ in range(n)]
    tok = tokenizer

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

    dev = device
    align = ROW_ALIGN if rowwise else 1
    longest = max(len(prompt_ids[i]) for i in rows)
    width = -(-longest // align) * align  # B * width tokens: a multiple of ROW_ALIGN
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
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

    cache = DynamicCache(config=model.config)
    extra: dict[str, Any] = {cache_kwarg: cache}
    eos = eos_token_ids
    # prefill spans [s, e), right-aligned: the last ends at width, each is <= PREFILL_CHUNK wide
    ends = list(range(width, 0, -PREFILL_CHUNK))[::-1]
    spans = list(zip([0, *ends[:-1]], ends))
    with torch.inference_mode():
        for s, e in spans:
            if s > 0 and should_stop is not None:  # cancelled rows leave before the next chunk
                keep = []
                for r, i in enumerate(rows):
                    if should_stop(i):
                        finish(i, "cancelled")
                    else:
                        keep.append(r)
                if not keep:
                    return results
                if len(keep) < len(rows):
                    sel_t = torch.tensor(keep, dtype=torch.long, device=dev)
                    cache.batch_select_indices(sel_t)
                    input_ids, mask, position_ids = input_ids[sel_t], mask[sel_t], position_ids[sel_t]
                    next_pos = next_pos[sel_t]
                    pads, rows = [pads[r] for r in keep], [rows[r] for r in keep]
            if rowwise:
                extra["oprag_pads"] = pads
            part = dict(input_ids=input_ids[:, s:e], attention_mask=mask[:, :e], position_ids=position_ids[:, s:e],
                        use_cache=True, **extra)
            if e < width:  # no logits needed: the decoder alone (the same hidden states and cache)
                model.get_decoder()(**part)
            else:  # lm_head rows = B * align: keeps its GEMM batch-invariant
                out = model(**part, logits_to_keep=align)
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
            # one up to a multiple of ROW_ALIGN (dummies: attention skipped, output ignored).
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
            out = model(
                input_ids=next_tokens,
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **extra,
            )
            next_pos = next_pos + 1
    return results
