"""The ``memory`` operator: per-session state reached through the shard path.

Records of a session live on the shard its session id routes to (the same stable hash as
documents). *Lookup* runs before embedding, for all sessions of a scheduler batch in one call
per shard, and resolves what a follow-up question leaves implicit by appending the previous
turn's subject (question and source titles) to the retrieval text. *Promotion* after an answer
writes a compact record (question, answer summary, chunk ids, source titles, embedding)
through the shard's promote op. A record is only ever visible to queries of its own session.
"""

from __future__ import annotations

import re

import numpy as np

from ..config import MemoryConfig
from ..domain import MemoryContext
from ..index.analyzer import strip_ignorable
from ..shards.pool import ShardPool
from ..shards.protocol import MemoryClearRequest, MemoryLookupRequest, MemoryTurn, Op, PromoteRequest

# Words that make a question depend on an earlier turn (anaphora, demonstratives).
_FOLLOW_UP = frozenset(
    "it its it's they them their theirs this that these those he she him his her hers there "
    "then such former latter".split()
)
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def is_follow_up(question: str) -> bool:
    """True when the question refers back (a pronoun or demonstrative) or is very short."""
    words = [w.casefold() for w in _WORD.findall(strip_ignorable(question))]
    return bool(words) and (len(words) <= 3 or any(w in _FOLLOW_UP for w in words))


def summarise(answer: str, limit: int) -> str:
    """First sentence(s) of the answer, at most ``limit`` characters (deterministic)."""
    a = " ".join(answer.split())
    if len(a) <= limit:
        return a
    cut = a[:limit]
    dot = cut.rfind(". ")
    return cut[: dot + 1] if dot > limit // 3 else cut


class Memory:
    def __init__(self, pool: ShardPool, cfg: MemoryConfig) -> None:
        self.pool = pool
        self.cfg = cfg

    async def lookup(self, questions: list[str], session_ids: list[str]) -> list[MemoryContext]:
        """Augment a batch of questions with their sessions' recent turns.

        ``session_ids[i] == ""`` means no memory for query i. One shard call per shard; a
        shard that is down is left out (its sessions are answered without memory).
        """
        out = [MemoryContext(q, "", 0) for q in questions]
        asking = [i for i, sid in enumerate(session_ids) if sid]
        got, _ = await self.pool.scatter(
            Op.MEMORY_LOOKUP, asking, lambda i: self.pool.owner(session_ids[i]),
            lambda idx: MemoryLookupRequest([session_ids[i] for i in idx], self.cfg.lookup_turns, self.cfg.ttl_s))
        for pos, rep in got.values():
            for p, turns in zip(pos, rep.turns):
                if turns:
                    i = asking[p]
                    out[i] = self._context(questions[i], turns)
        return out

    @staticmethod
    def _context(question: str, turns: list[MemoryTurn]) -> MemoryContext:
        """The retrieval text and memory context of one question given its session's turns
        (newest first)."""
        last = turns[0]
        titles = list(dict.fromkeys(t for t in last.titles if t))[:2]
        memory_text = f"Previous question: {last.question}"
        if titles:
            memory_text += f" (sources: {'; '.join(titles)})"
        if is_follow_up(question):
            # name the subject once (the previous turn's top source title, else its question):
            # more would drown the detail the follow-up asks about
            subject = titles[0] if titles else last.question
            return MemoryContext(f"{question} ({subject})", memory_text, len(turns))
        return MemoryContext(question, memory_text, len(turns))

    async def promote(
        self, session_id: str, question: str, answer: str, chunk_ids: list[str], titles: list[str], vector: np.ndarray
    ) -> None:
        """Write one turn record to the session's shard (bounded by ``max_turns_per_session``)."""
        req = PromoteRequest(session_id=session_id, question=question, summary=summarise(answer, self.cfg.summary_chars),
                             chunk_ids=chunk_ids, titles=titles, vector=np.asarray(vector, dtype=np.float32).reshape(-1),
                             max_turns=self.cfg.max_turns_per_session, max_total=self.cfg.max_records_total,
                             ttl_s=self.cfg.ttl_s)
        await self.pool.call(self.pool.owner(session_id), Op.PROMOTE, req)

    async def clear(self, session_id: str) -> int:
        """Drop a session's records. :returns: records removed."""
        res = await self.pool.call(self.pool.owner(session_id), Op.MEMORY_CLEAR, MemoryClearRequest(session_id))
        return int(res.removed)
