"""The replies of one request sent to several shards, resolved together: the awaiting task wakes
once, when the last reply is in, instead of once per reply.

A :class:`Gather` holds one :class:`Slot` per shard; a transport answers into a slot where it
would resolve its own future (a slot has the three methods its resolvers use: ``done``,
``set_result``, ``set_exception``). A pipe transport answers on the event loop's thread, so the
last slot set resolves :attr:`Gather.future` there. A thread transport answers from the shard's
thread (:meth:`Gather.put`): only the last of the group's shards hands over to the loop
(``call_soon_threadsafe``: one self-pipe write and one loop wake-up per request instead of one
per shard; the hand-offs were 80-260 us each served, bench/RESULTS.md fe13).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
from typing import Any

from .protocol import FieldsRequest, Op

_UNSET = object()

#: set ``OPRAG_FANOUT_HOLD=0`` to send a broadcast without :func:`hold_wakeups` (A/B benches)
HOLD = os.environ.get("OPRAG_FANOUT_HOLD", "1") != "0"
_BATCH, _OTHER = getattr(os, "SCHED_BATCH", None), getattr(os, "SCHED_OTHER", None)
_NO_HOLD: set[int] = set()  # pids whose policy cannot be (or is not ours to be) changed


def hold_wakeups(clients: list) -> list[int]:
    """Before a broadcast's writes: the shard processes of ``clients`` (all but the last
    written) switched from ``SCHED_OTHER`` to ``SCHED_BATCH``; :func:`release` switches them
    back after the last write. A batch task woken by a write does not preempt the writer (the
    kernel's wake-up preemption skips batch and idle wakees), so on a machine with no idle core
    the frontend finishes the broadcast before the first shard takes its core; without it the
    first shard woken on the frontend's core ran its whole search before the second shard's
    request was written (the two searches in series: bench/RESULTS.md, fe14 / fe15). Only
    process shards (a pipe transport with its process); a pid whose policy is not
    ``SCHED_OTHER`` or cannot be changed is left alone from then on. :returns: the pids held."""
    if not HOLD or _BATCH is None:
        return []
    held = []
    for c in clients[:-1]:
        proc = getattr(c, "proc", None)
        pid = getattr(proc, "pid", None)
        if pid is None or pid in _NO_HOLD or not getattr(c, "_alive", False):
            continue
        try:
            if os.sched_getscheduler(pid) != _OTHER:
                _NO_HOLD.add(pid)
                continue
            os.sched_setscheduler(pid, _BATCH, os.sched_param(0))
        except OSError:
            _NO_HOLD.add(pid)
            continue
        held.append(pid)
    return held


def release(held: list[int]) -> None:
    """Switch the pids :func:`hold_wakeups` held back to ``SCHED_OTHER``."""
    for pid in held:
        try:
            os.sched_setscheduler(pid, _OTHER, os.sched_param(0))
        except OSError:
            _NO_HOLD.add(pid)


_tokens = itertools.count(1)


def fields_later(op: Op, per: list, clients: list, into: list | None) -> list:
    """For :meth:`.pool.ShardPool.gather_partial`: per client, None, or the FIELDS request to send
    right behind its SEARCH, whose ``per[k]`` is then replaced by a copy with ``fields_later``
    set (shared by those clients: one pickled frame). Only a SEARCH with ``fetch_k`` > 0, only
    to clients with ``defers_fields`` (process shards), and only when another client searches
    on the frontend's own thread (``inline``): the process shard's reply is then what the
    frontend waits for after its own search, and it comes ~0.1-0.2 ms sooner without the
    fields, which the shard computes while the frontend merges (0.97x the served p50; with every
    shard in a process the frontend has no search of its own and waits for the fields after
    the merge instead: 1.05x, so they stay in the reply there; bench/RESULTS.md, session 32).
    ``into`` None: none."""
    out: list = [None] * len(clients)
    if into is None or op is not Op.SEARCH or not any(getattr(c, "inline", False) for c in clients):
        return out
    late = {}
    for k, c in enumerate(clients):
        req = per[k]
        if getattr(c, "defers_fields", False) and getattr(req, "fetch_k", 0) > 0 and not req.fields_later:
            if id(req) not in late:
                tok = next(_tokens)
                late[id(req)] = (dataclasses.replace(req, fields_later=tok), FieldsRequest(tok))
            per[k], out[k] = late[id(req)]
    return out


class Gather:
    """``n`` outcomes (a reply, or the exception of a failed call) in shard order;
    :attr:`future` resolves to their list once every slot is set."""

    __slots__ = ("loop", "outs", "left", "future", "held", "_lock")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop, self.outs, self.left = loop, [_UNSET] * n, n
        self.future: asyncio.Future = loop.create_future()
        self.held: list[tuple[set, Slot]] = []  # (a transport's set of pending calls, the slot in it)
        self._lock = threading.Lock()

    def slot(self, k: int) -> "Slot":
        return Slot(self, k)

    def put(self, k: int, value: Any) -> bool:
        """(Any thread) set outcome ``k`` unless it is set already; True when this was the last
        one (the caller then runs :meth:`finish` on the loop)."""
        with self._lock:
            if self.outs[k] is not _UNSET:
                return False
            self.outs[k] = value
            self.left -= 1
            return self.left == 0

    def is_set(self, k: int) -> bool:
        return self.outs[k] is not _UNSET

    def finish(self) -> None:
        """(On the loop) drop the slots from the transports' pending sets that hold them, and
        resolve :attr:`future` (unless its awaiter was cancelled meanwhile)."""
        for pending, slot in self.held:
            pending.discard(slot)
        self.held = []
        if not self.future.done():
            self.future.set_result(self.outs)


class Slot:
    """One shard's outcome in a :class:`Gather`, set like an ``asyncio.Future`` on the loop."""

    __slots__ = ("group", "k")

    def __init__(self, group: Gather, k: int) -> None:
        self.group, self.k = group, k

    def done(self) -> bool:
        return self.group.is_set(self.k)

    def set_result(self, value: Any) -> None:
        if self.group.put(self.k, value):
            self.group.finish()

    def set_exception(self, exc: BaseException) -> None:
        self.set_result(exc)
