"""Memory records of the sessions routed to one shard: one record per answered turn, bounded
per session (``max_turns``), per shard (``max_total``, least recently active sessions lose their
oldest records first) and in idle time (``ttl_s``). A record is only ever visible to lookups of
its own session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .protocol import (MemoryClearReply, MemoryClearRequest, MemoryLookupReply, MemoryLookupRequest, MemoryTurn,
                       PromoteReply, PromoteRequest)


@dataclass(slots=True)
class MemoryRecord:
    session_id: str
    turn: int
    question: str
    summary: str
    chunk_ids: list[str]
    titles: list[str]
    vector: np.ndarray  # float32[D]
    created: float  # time.time() seconds


class MemoryStore:
    """``sessions`` {session_id: records oldest first}."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[MemoryRecord]] = {}

    def __len__(self) -> int:
        """Records held, over every session."""
        return sum(len(v) for v in self.sessions.values())

    def promote(self, req: PromoteRequest) -> PromoteReply:
        """Append one turn record; enforce the per-session turn bound, drop sessions idle for
        longer than ``ttl_s`` and, past ``max_total`` records on this shard, the least recently
        active sessions' oldest records (never the writing session's)."""
        recs = self.sessions.setdefault(req.session_id, [])
        recs.append(MemoryRecord(session_id=req.session_id, turn=len(recs) and recs[-1].turn + 1,
                                 question=req.question, summary=req.summary, chunk_ids=list(req.chunk_ids),
                                 titles=list(req.titles), vector=np.asarray(req.vector, dtype=np.float32).reshape(-1),
                                 created=time.time()))
        if len(recs) > req.max_turns:
            del recs[: len(recs) - req.max_turns]
        now = time.time()
        if req.ttl_s:
            for sid in [s for s, v in self.sessions.items() if v and now - v[-1].created > req.ttl_s]:
                del self.sessions[sid]
        total = len(self)
        if req.max_total and total > req.max_total:
            for sid in sorted(self.sessions, key=lambda s: self.sessions[s][-1].created if self.sessions[s] else 0):
                if total <= req.max_total:
                    break
                if sid == req.session_id:
                    continue
                drop = min(len(self.sessions[sid]), total - req.max_total)
                del self.sessions[sid][:drop]
                total -= drop
                if not self.sessions[sid]:
                    del self.sessions[sid]
        return PromoteReply(records=len(recs))

    def lookup(self, req: MemoryLookupRequest) -> MemoryLookupReply:
        """Per session: its most recent ``k`` turns (newest first) within ``ttl_s`` (0 = any age)."""
        ttl = float(req.ttl_s or 0)
        now = time.time()
        out = []
        for sid in req.session_ids:
            recs = [r for r in self.sessions.get(sid, []) if not ttl or now - r.created <= ttl]
            out.append([MemoryTurn(r.turn, r.question, r.summary, r.chunk_ids, r.titles)
                        for r in recs[-int(req.k):][::-1]])
        return MemoryLookupReply(out)

    def clear(self, req: MemoryClearRequest) -> MemoryClearReply:
        return MemoryClearReply(removed=len(self.sessions.pop(req.session_id, [])))

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> list[dict]:
        """Every record as a JSON-ready dict (vector as a list of floats)."""
        return [{"session_id": r.session_id, "turn": r.turn, "question": r.question, "summary": r.summary,
                 "chunk_ids": r.chunk_ids, "titles": r.titles, "vector": r.vector.tolist(), "created": r.created}
                for v in self.sessions.values() for r in v]

    def load_json(self, items: list[dict]) -> None:
        """Append records written by :meth:`to_json` (oldest first per session)."""
        for m in items:
            self.sessions.setdefault(m["session_id"], []).append(
                MemoryRecord(session_id=m["session_id"], turn=m["turn"], question=m["question"], summary=m["summary"],
                             chunk_ids=m["chunk_ids"], titles=m["titles"],
                             vector=np.asarray(m["vector"], dtype=np.float32), created=m["created"]))
