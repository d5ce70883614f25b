"""Run one streaming query: the events of a :class:`~oprag_server.engine.job.QueryJob` as they
come, for the gRPC ``QueryStream`` RPC and the HTTP API's ``stream: true`` alike."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from ..engine.job import QueryJob


async def job_events(submit: Callable[[QueryJob], Awaitable[QueryJob]], job: QueryJob) -> AsyncIterator[tuple[str, Any]]:
    """Submit ``job`` with an event queue and yield its events: ``("sources", job)`` once the
    prep steps ran, ``("text", str)`` per generated piece, then ``("done", job)`` last.

    The query is cancelled when the consumer stops early (``aclose``).

    :raises Overloaded | InvalidArgument | ShardError | ...: what ``submit`` raised, when it
        raises (before or after some events were yielded).
    """
    job.events = asyncio.Queue()
    task = asyncio.create_task(submit(job))
    try:
        while True:
            get = asyncio.create_task(job.events.get())
            done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                break
            yield get.result()
        while not job.events.empty():
            yield job.events.get_nowait()
        yield "done", task.result()
    finally:
        if not task.done():
            task.cancel()
