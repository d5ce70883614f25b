"""Run one streaming query: the events of a :class:`~oprag_server.engine.job.QueryJob` as they
come, for the gRPC ``QueryStream`` RPC and the HTTP API's ``stream: true`` alike."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from ..engine.job import QueryJob


_END = object()  # put on the event queue once the query's task is done: the events before it are all


async def job_events(submit: Callable[[QueryJob], Awaitable[QueryJob]], job: QueryJob) -> AsyncIterator[tuple[str, Any]]:
    """Submit ``job`` with an event queue and yield its events: ``("sources", job)`` once the
    prep steps ran, ``("text", str)`` per generated piece, then ``("done", job)`` last.

    The query is cancelled when the consumer stops early (``aclose``) or is cancelled (the RPC
    was cancelled): its task is cancelled and awaited (up to 10 s) before this generator ends.
    The queue is read directly (no helper task per event), so a cancellation leaves no pending
    ``Queue.get`` task behind (trial24: asyncio logged "Task was destroyed but it is pending!"
    for ~15 % of streams cancelled after their first event).

    :raises Overloaded | InvalidArgument | ShardError | ...: what ``submit`` raised, when it
        raises (before or after some events were yielded).
    """
    events: asyncio.Queue = asyncio.Queue()
    job.events = events
    task = asyncio.create_task(submit(job))
    task.add_done_callback(lambda _: events.put_nowait((_END, None)))
    try:
        while True:
            kind, val = await events.get()
            if kind is _END:
                break
            yield kind, val
        yield "done", task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=10.0)  # (a second cancellation of ours ends the wait)
