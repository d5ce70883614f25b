"""A non-streamed HTTP reply that nobody waits for any more: its work is cancelled when the
client disconnects first, as gRPC cancels a call whose client went away (``http.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request


class ClientGone(Exception):
    """The client closed the connection before a non-streamed reply (499, counted CANCELLED)."""


async def unless_gone(request: Request, aw: Any) -> Any:
    """``await aw``, cancelled when the client disconnects first, as gRPC cancels a call whose
    client went away (a non-streamed chat generated every token for nobody, counted OK).

    :raises ClientGone: the client disconnected first."""
    async def gone() -> None:  # the body was read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(aw), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()  # no-op when done
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()
