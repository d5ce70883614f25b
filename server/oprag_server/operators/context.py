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

The question has priority over the memory: the memory (an earlier question, which may be long)
takes at most ``1 / MEMORY_SHARE`` of the prompt budget and never more than the question leaves;
a longer one is cut at a token boundary and ends in ``...`` (:func:`fit_memory`). Only a
question that does not fit by itself is refused.
"""

from __future__ import annotations

from ..domain import ContextPayload, Hit, SourceRef
from ..models.protocols import Generator

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the numbered sources. "
    "Cite the sources you use like [1]. If the sources do not contain the answer, say that you do not know."
)
MEMORY_SHARE = 4  # the session's memory takes at most a quarter of the prompt budget (the sources keep room)


def _source_block(n: int, hit: Hit, text: str) -> str:
    title = f" {hit.title}" if hit.title else ""
    return f"[{n}]{title}\n{text.strip()}\n\n"


def _user(blocks: list[str], question: str, memory: str) -> str:
    mem = f"Earlier in this conversation:\n{memory}\n\n" if memory else ""
    return f"{mem}Sources:\n\n{''.join(blocks)}Question: {question}"


def fit_memory(model: Generator, question: str, memory: str, room: int) -> str:
    """``memory`` cut (at a token boundary, then ``" ..."``) so that it adds at most ``room``
    tokens to the prompt of ``question`` with no sources; "" when not even a few tokens fit.
    Token counts are the model's (``count_tokens`` of the rendered chat prompt)."""
    if not memory:
        return ""

    def cost(m: str) -> int:
        return model.count_tokens(model.chat_prompt(SYSTEM_PROMPT, _user([], question, m)))

    limit = cost("") + room
    if cost(memory) <= limit:
        return memory
    n = room - (cost("...") - cost(""))  # tokens left for the text itself after the wrapper
    while n > 0:
        cut = model.truncate_to_tokens(memory, n).rstrip()
        if cut and cost(cut + " ...") <= limit:
            return cut + " ..."
        n -= max(1, n // 8)
    return ""


def question_fits(question: str, model: Generator, *, budget_tokens: int, max_new_tokens: int) -> tuple[int, int]:
    """The prompt budget ``min(budget_tokens, model.max_context) - max_new_tokens`` and the tokens the question
    alone takes in it (system prompt and chat template included, no memory, no source): checked by the query
    scheduler before a request starts (a stream then fails before its sources event: trial51 #4) and again by
    :func:`build_context`. :raises ValueError: the question does not fit."""
    window = min(int(budget_tokens), int(model.max_context))
    budget = window - int(max_new_tokens)
    used = model.count_tokens(model.chat_prompt(SYSTEM_PROMPT, _user([], question, "")))
    if used > budget:
        raise ValueError(
            f"the question needs {used} prompt tokens (system prompt and chat template included) "
            f"but the prompt budget is {budget} (context tokens {window} minus max_new_tokens "
            f"{int(max_new_tokens)}): shorten the question or lower max_new_tokens"
        )
    return budget, used


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
    ``memory_text`` (the session's earlier turn) is cut to what the question leaves, at most
    ``budget // MEMORY_SHARE`` tokens (:func:`fit_memory`); ``messages`` hold what was placed.

    :raises ValueError: the question alone (system prompt and chat template included, no
        memory) does not fit the budget.
    """
    budget, used = question_fits(question, model, budget_tokens=budget_tokens, max_new_tokens=max_new_tokens)
    if memory_text:
        memory_text = fit_memory(model, question, memory_text, min(budget - used, budget // MEMORY_SHARE))
        used = model.count_tokens(model.chat_prompt(SYSTEM_PROMPT, _user([], question, memory_text)))
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
        while text_room >= 16:  # the cut text, header included, may tokenise a token or two longer
            cut = model.truncate_to_tokens(hit.text.strip(), text_room)
            block = _source_block(n, hit, cut)
            cost = model.count_tokens(block)
            if cost <= room:
                blocks.append(block)
                used += cost
                sources.append(SourceRef(n, hit.chunk_id, hit.doc_id, hit.title, cost, True))
                break
            text_room -= cost - room  # cut again by what it went over
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
