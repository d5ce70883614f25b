"""Memory records of the sessions routed to one shard: one record per answered turn, bounded
per session (``max_turns``), per shard (``max_total``, least recently active sessions lose their
oldest records first) and in idle time (``ttl_s``). A record is only ever visible to lookups of
its own session.

Durability: with a write-ahead log attached (``wal``, set when the shard loads from its data
directory) every change -- a promoted turn with the retention it applied (turn bound, budget,
idle expiry, evaluated at the logged time ``now``), and a clear -- is appended and fsync'ed
*before* it is applied, so an acknowledged change survives kill -9 and a cleared session never
comes back. :meth:`MemoryStore.replay` re-applies the log's memory records, in log order, over
the snapshot (whose ``memory.json`` holds everything before the log was last reset).
Log records: ``{"kind": "memory_promote", "req": {PromoteRequest fields}, "now": float}`` and
``{"kind": "memory_clear", "session_id": str, "at": float}``.

A clear sticks: the store keeps, per cleared session, when the clear was asked (``cleared``,
the frontend's clock, as is each turn's ``started``), and a turn whose request started before
that is not recorded (a Query in flight during a ClearSession). The marks are in the log and in
the snapshot (``memory.json`` items ``{"session_id", "cleared"}``), so they hold after a shard
restart; a mark older than :data:`CLEAR_MARK_S` is dropped (no request runs that long).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields
from typing import Iterable

import numpy as np

from ..index.wal import WriteAheadLog

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
    resolved: str = ""
    doc_ids: list[str] = field(default_factory=list)
    terms: list[str] = field(default_factory=list)

    def as_turn(self) -> MemoryTurn:
        return MemoryTurn(self.turn, self.question, self.summary, self.chunk_ids, self.titles, self.resolved,
                          self.doc_ids, self.terms, self.vector)


MEMORY_KINDS = ("memory_promote", "memory_clear")
CLEAR_MARK_S = 3600.0  # how long a clear mark is kept (s): longer than any request runs


class MemoryStore:
    """``sessions`` {session_id: records oldest first}, least recently active session first (a turn moves its
    session to the end), so that idle expiry and the shard budget take sessions from the front: a turn costs the same
    whatever the number of sessions (trial52: scanning and sorting every session cost 4.3 ms a turn at 50K sessions,
    90 ms at the budget)."""

    def __init__(self) -> None:
        self.sessions: collections.OrderedDict[str, list[MemoryRecord]] = collections.OrderedDict()
        self._total = 0  # records held, over every session
        # session_id -> when its last clear was asked (frontend time.time() s), oldest first
        self.cleared: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.wal: WriteAheadLog | None = None  # attached by the shard's load; None: not logged

    def _log(self, rec: dict) -> None:
        if self.wal is not None:
            self.wal.append(rec)

    def __len__(self) -> int:
        """Records held, over every session."""
        return self._total

    def promote(self, req: PromoteRequest) -> PromoteReply:
        """Log, then append one turn record; enforce the per-session turn bound, drop sessions
        idle for longer than ``ttl_s`` (the writing session's own earlier turns too, when it was idle that long) and,
        past ``max_total`` records on this shard, the least recently active sessions' oldest records, the writing
        session's own older ones last (its new turn stays: at most ``max_total`` records remain). A turn whose
        request started (``req.started``) before the session's last clear is not recorded
        (``records`` -1)."""
        if req.started and req.started <= self.cleared.get(req.session_id, 0.0):
            return PromoteReply(records=-1)
        now = time.time()
        self._log({"kind": "memory_promote", "req": {f.name: getattr(req, f.name) for f in fields(req)}, "now": now})
        return self._promote(req, now)

    def _promote(self, req: PromoteRequest, now: float) -> PromoteReply:
        """:meth:`promote` at time ``now`` (time.time() seconds), without logging. Sessions are in the order of
        their last turn, so an idle one is found from the front; the front sweep stops at the first session still
        live (a clock set back may leave a later expired session stored until its turn comes: :meth:`lookup`
        never returns its records)."""
        sid, sessions = req.session_id, self.sessions
        recs = sessions.get(sid)
        if recs is None:
            recs = sessions[sid] = []
        else:
            sessions.move_to_end(sid)
            if req.ttl_s and recs and now - recs[-1].created > req.ttl_s:  # expired: it starts again (trial53 #1)
                self._total -= len(recs)
                recs.clear()
        recs.append(MemoryRecord(session_id=sid, turn=len(recs) and recs[-1].turn + 1,
                                 question=req.question, summary=req.summary, chunk_ids=list(req.chunk_ids),
                                 titles=list(req.titles), vector=np.asarray(req.vector, dtype=np.float32).reshape(-1),
                                 created=now, resolved=req.resolved, doc_ids=list(req.doc_ids), terms=list(req.terms)))
        self._total += 1
        if len(recs) > req.max_turns:
            self._total -= len(recs) - req.max_turns
            del recs[: len(recs) - req.max_turns]
        if req.ttl_s:
            while sessions:
                first, v = next(iter(sessions.items()))
                if first == sid or (v and now - v[-1].created <= req.ttl_s):
                    break
                self._total -= len(v)
                del sessions[first]
        while req.max_total and self._total > req.max_total:  # the least recently active sessions' oldest records
            first = next(iter(sessions))
            v = sessions[first]  # (the writer is the most recent: once it is first every other session is gone)
            drop = min(len(v) - (first == sid), self._total - req.max_total)  # (the writer keeps its new turn)
            if drop <= 0:
                break
            del v[:drop]
            self._total -= drop
            if not v:
                del sessions[first]
        return PromoteReply(records=len(recs))

    def lookup(self, req: MemoryLookupRequest) -> MemoryLookupReply:
        """Per session: its most recent ``k`` turns (newest first); none when its last turn is older than ``ttl_s``
        (0 = any age): the session is idle past it. The rule is the session's, as its expiry's (trial53b #5: each turn
        was filtered by its own age, so an active session's older turns were hidden yet stored and counted)."""
        ttl = float(req.ttl_s or 0)
        now = time.time()
        out = []
        for sid in req.session_ids:
            recs = self.sessions.get(sid, [])
            live = recs and (not ttl or now - recs[-1].created <= ttl)
            out.append([r.as_turn() for r in recs[-int(req.k):][::-1]] if live else [])
        return MemoryLookupReply(out)

    def clear(self, req: MemoryClearRequest) -> MemoryClearReply:
        """Log, then drop the session's records and mark the clear (turns of requests that
        started before it are not recorded). :returns: records removed."""
        at = float(req.at or time.time())
        self._log({"kind": "memory_clear", "session_id": req.session_id, "at": at})
        return MemoryClearReply(removed=self._clear(req.session_id, at))

    def _clear(self, session_id: str, at: float) -> int:
        """:meth:`clear` without logging; marks older than :data:`CLEAR_MARK_S` are dropped."""
        self.cleared[session_id] = max(at, self.cleared.pop(session_id, 0.0))  # (kept in time order)
        while self.cleared and next(iter(self.cleared.values())) < at - CLEAR_MARK_S:
            self.cleared.popitem(last=False)
        removed = len(self.sessions.pop(session_id, []))
        self._total -= removed
        return removed

    def replay(self, wal: WriteAheadLog, records: Iterable[dict] | None = None) -> int:
        """Re-apply the memory records of ``wal`` (``records``: its intact records when already
        read) in log order, then attach it for logging. :returns: records applied."""
        n = 0
        for rec in wal if records is None else records:
            kind = rec.get("kind")
            if kind == "memory_promote":
                self._promote(PromoteRequest(**rec["req"]), float(rec["now"]))
            elif kind == "memory_clear":
                self._clear(rec["session_id"], float(rec.get("at", 0.0)))
            else:
                continue
            n += 1
        self.wal = wal
        return n

    # ------------------------------------------------------------------ persistence
    def dump(self) -> tuple[list[dict], np.ndarray | None]:
        """What a snapshot writes, from one pass over the records: ``(items, vectors)``, every record as a
        JSON-ready dict with its vector by ``row`` (then the clear marks), and float32[R, D] those vectors
        (float32[0, 0] when there is none). A vector as decimal text was ~8.5 KB of a record's ~9.2 at D 384
        (trial52 #1). When the records' vectors differ in length, ``vectors`` is None and each item holds its own
        ``vector`` list."""
        recs = [r for v in self.sessions.values() for r in v]
        vecs = None if len({r.vector.shape for r in recs}) > 1 else (
            np.stack([r.vector for r in recs]).astype(np.float32, copy=False) if recs else np.zeros((0, 0), np.float32))
        return [{"session_id": r.session_id, "turn": r.turn, "question": r.question, "summary": r.summary,
                 "chunk_ids": r.chunk_ids, "titles": r.titles, "created": r.created, "resolved": r.resolved,
                 "doc_ids": r.doc_ids, "terms": r.terms, **({"vector": r.vector.tolist()} if vecs is None else {"row": i})}
                for i, r in enumerate(recs)] + [{"session_id": s, "cleared": t} for s, t in self.cleared.items()], vecs

    def load_json(self, items: list[dict], vectors: np.ndarray | None = None) -> None:
        """Append records written by :meth:`dump` (oldest first per session), and its clear marks. A record's
        vector is row ``row`` of ``vectors`` (float32[R, D]), or its own ``vector`` list (a snapshot written
        before the vectors had a file of their own)."""
        for m in items:
            if "cleared" in m:  # (a mark, written in time order; the session's later records stay)
                self.cleared[m["session_id"]] = float(m["cleared"])
                continue
            vec = m["vector"] if "vector" in m else vectors[int(m["row"])]
            self.sessions.setdefault(m["session_id"], []).append(
                MemoryRecord(session_id=m["session_id"], turn=m["turn"], question=m["question"], summary=m["summary"],
                             chunk_ids=m["chunk_ids"], titles=m["titles"],
                             vector=np.array(vec, dtype=np.float32), created=m["created"],
                             resolved=m.get("resolved", ""), doc_ids=m.get("doc_ids", []), terms=m.get("terms", [])))
            self._total += 1
        # least recently active first (a snapshot lists sessions in that order; an older one in first-turn order)
        for sid in sorted(self.sessions, key=lambda k: self.sessions[k][-1].created if self.sessions[k] else 0.0):
            self.sessions.move_to_end(sid)
