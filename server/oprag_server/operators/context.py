"""The ``context`` operator: builds the prompt, a bounded, deterministic context payload with
provenance.

Hits are placed in rank order as numbered sources (``[1] Title``) until the token budget is
spent; a source that does not fit whole is cut at a token boundary (and marked ``truncated``),
and nothing after it is placed. Same hits, same question, same budget: same prompt.

Layout for engine prefix caches (vLLM, SGLang): the most stable parts come first -- the system
prompt (the same for every request), then the session's memory (grows turn by turn, its older
part unchanged), then the sources in rank order, then the question -- rendered with the
generator's chat template. Two requests share the engine's cached prefix up to their first
difference.
"""

from __future__ import annotations

from ..domain import ContextPayload, Hit, SourceRef
from ..models.protocols import Generator

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the numbered sources. "
    "Cite the sources you use like [1]. If the sources do not contain the answer, say that you do not know."
)


def _source_block(n: int, hit: Hit, text: str) -> str:
    title = f" {hit.title}" if hit.title else ""
    return f"[{n}]{title}\n{text.strip()}\n\n"


def _user(blocks: list[str], question: str, memory: str) -> str:
    mem = f"Earlier in this conversation:\n{memory}\n\n" if memory else ""
    return f"{mem}Sources:\n\n{''.join(blocks)}Question: {question}"


def build_context(
    question: str,
    hits: list[Hit],
    model: Generator,  # uses max_context, chat_prompt, count_tokens, truncate_to_tokens
    *,
    budget_tokens: int,
    max_new_tokens: int,
    memory_text: str = "",
) -> ContextPayload:
    """Build the prompt under ``min(budget_tokens, model.max_context) - max_new_tokens`` tokens:
    ``budget_tokens`` (``--context-tokens``) holds the prompt and the answer together.

    :raises ValueError: the question alone does not fit the budget.
    """
    window = min(int(budget_tokens), int(model.max_context))
    budget = window - int(max_new_tokens)
    base = model.chat_prompt(SYSTEM_PROMPT, _user([], question, memory_text))
    used = model.count_tokens(base)
    if used > budget:
        raise ValueError(
            f"the question needs {used} prompt tokens (system prompt and chat template included) "
            f"but the prompt budget is {budget} (context tokens {window} minus max_new_tokens "
            f"{int(max_new_tokens)}): shorten the question or lower max_new_tokens"
        )
    blocks: list[str] = []
    sources: list[SourceRef] = []
    margin = 4  # tokenisation across block boundaries may differ by a token or two
    for hit in hits:
        n = len(blocks) + 1
        block = _source_block(n, hit, hit.text)
        cost = model.count_tokens(block)
        room = budget - used - margin
        if cost <= room:
            blocks.append(block)
            used += cost
            sources.append(SourceRef(n, hit.chunk_id, hit.doc_id, hit.title, cost, False))
            continue
        header = _source_block(n, hit, "")
        text_room = room - model.count_tokens(header)
        if text_room >= 16:
            cut = model.truncate_to_tokens(hit.text.strip(), text_room)
            block = _source_block(n, hit, cut)
            cost = model.count_tokens(block)
            if cost <= room:
                blocks.append(block)
                used += cost
                sources.append(SourceRef(n, hit.chunk_id, hit.doc_id, hit.title, cost, True))
        break
    prompt = model.chat_prompt(SYSTEM_PROMPT, _user(blocks, question, memory_text))
    total = model.count_tokens(prompt)
    while total > budget and blocks:  # the margin was not enough: drop sources from the end
        blocks.pop()
        sources.pop()
        prompt = model.chat_prompt(SYSTEM_PROMPT, _user(blocks, question, memory_text))
        total = model.count_tokens(prompt)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _user(blocks, question, memory_text)}]
    return ContextPayload(prompt=prompt, prompt_tokens=total, sources=sources, messages=messages)
