"""The ``memory`` operator: per-session state reached through the shard path.

Records of a session live on the shard its session id routes to (the same stable hash as
documents). *Lookup* runs before embedding, for all sessions of a scheduler batch in one call
per shard, and resolves what a follow-up question leaves implicit by appending the previous
turn's subject (question and source titles) to the retrieval text. *Promotion* after an answer
writes a compact record (question, answer summary, chunk ids, source titles, embedding)
through the shard upsert path. A record is only ever visible to queries of its own session.
"""

from __future__ import annotations

import re

import numpy as np

from ..config import MemoryConfig
from ..domain import MemoryContext
from ..index.analyzer import strip_ignorable
from ..shards.pool import ShardPool, route

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

        ``session_ids[i] == ""`` means no memory for query i. One shard call per shard.
        """
        out = [MemoryContext(q, "", 0) for q in questions]
        by_shard: dict[int, list[int]] = {}
        for i, sid in enumerate(session_ids):
            if sid:
                by_shard.setdefault(route(sid, self.pool.n), []).append(i)
        if not by_shard:
            return out
        shards = sorted(by_shard)
        # a shard that is down is left out: its sessions are answered without memory
        got, _ = await self.pool.gather_partial(
            "memory_search",
            [{"session_ids": [session_ids[i] for i in by_shard[s]], "k": self.cfg.lookup_turns,
              "ttl_s": self.cfg.ttl_s} for s in shards],
            shards=shards,
        )
        for s, rep in got.items():
            for i, turns in zip(by_shard[s], rep):
                if not turns:
                    continue
                last = turns[0]
                titles = list(dict.fromkeys(t for t in last["titles"] if t))[:2]
                memory_text = f"Previous question: {last['question']}"
                if titles:
                    memory_text += f" (sources: {'; '.join(titles)})"
                if is_follow_up(questions[i]):
                    # name the subject once (the previous turn's top source title, else its
                    # question): more would drown the detail the follow-up asks about
                    subject = titles[0] if titles else last["question"]
                    out[i] = MemoryContext(f"{questions[i]} ({subject})", memory_text, len(turns))
                else:
                    out[i] = MemoryContext(questions[i], memory_text, len(turns))
        return out

    async def promote(
        self, session_id: str, question: str, answer: str, chunk_ids: list[str], titles: list[str], vector: np.ndarray
    ) -> None:
        """Write one turn record to the session's shard (bounded by ``max_turns_per_session``)."""
        rec = {
            "session_id": session_id,
            "question": question,
            "summary": summarise(answer, self.cfg.summary_chars),
            "chunk_ids": chunk_ids,
            "titles": titles,
            "vector": np.asarray(vector, dtype=np.float32).reshape(-1),
        }
        await self.pool.call(
            route(session_id, self.pool.n), "memory_upsert",
            {"record": rec, "max_turns": self.cfg.max_turns_per_session, "max_total": self.cfg.max_records_total,
             "ttl_s": self.cfg.ttl_s},
        )

    async def clear(self, session_id: str) -> int:
        res = await self.pool.call(route(session_id, self.pool.n), "memory_clear", {"session_id": session_id})
        return int(res["removed"])
