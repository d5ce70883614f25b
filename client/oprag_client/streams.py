"""The ``QueryStream`` calls the clients return: :class:`SyncStreamCall` (``OpRAGClient``) and
:class:`StreamCall` (``AsyncOpRAGClient``). Both delegate every method of the gRPC call
(``cancel``, ``code``, ...) and cancel the query on the server when a loop over them stops early.

Why a wrapper: a gRPC call object is freed only by a garbage collection (grpc's iterator and call
hold each other, and the sync call's own ``__del__`` runs only when it is freed), so a loop left by
``break`` over a call the caller still held went on generating on the server, for nobody and ahead
of other queries (trial15 for asyncio, trial26 for the sync client). Here each ``for`` /
``async for`` gets a generator of its own that only the loop holds: when the loop ends (``break``,
an exception, ``return``), CPython frees that generator at once, and its ``finally`` cancels the
call (a no-op once the stream ended).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class SyncStreamCall:
    """A blocking ``QueryStream`` call (``OpRAGClient.query_stream``): the grpc call's methods
    (``cancel``, ``code``, ``details``, ...) and an iterable of QueryEvents.

    What cancels the query on the server: leaving a ``for`` loop over it early (``break``, an
    exception; also with the call still held in a variable, and through wrappers such as
    ``enumerate(call)``), :meth:`close`, the end of a ``with call:`` block, :meth:`cancel`, and the
    call being freed. What does not: stopping after ``next(call)`` while holding the call; call
    :meth:`close` (or use ``with``) then.
    """

    def __init__(self, call: Any) -> None:
        self._call = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    def __iter__(self) -> Iterator[Any]:
        return self._events()

    def __next__(self) -> Any:
        """The next event (as the grpc call's ``next``); ``StopIteration`` at the end.

        :raises grpc.RpcError: the stream failed (the server's status), was cancelled or passed its deadline.
        """
        return next(self._call)

    def _events(self) -> Iterator[Any]:
        try:
            yield from self._call
        finally:
            self._call.cancel()  # a no-op once the stream ended

    def close(self) -> None:
        """Cancel the query on the server unless the stream already ended (then nothing happens)."""
        self._call.cancel()

    def __enter__(self) -> SyncStreamCall:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        call = self.__dict__.get("_call")
        if call is not None:
            call.cancel()


class StreamCall:
    """An asyncio ``QueryStream`` call (``AsyncOpRAGClient.query_stream``): the grpc.aio call's
    methods (``cancel``, ``code``, ``read``, ...), and ``async for`` over it cancels the call
    when the loop stops early (``break``, an exception). grpc.aio's own iterator and its call
    hold each other, so a stream left by ``break`` went on generating on the server, for nobody
    and ahead of other queries, until a garbage collection found the pair (trial15)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    def __aiter__(self):
        return self._events()

    async def _events(self):
        try:
            async for event in self._call:
                yield event
        finally:
            self._call.cancel()  # a no-op once the stream ended
