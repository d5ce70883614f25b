"""The end of an ingest stream: its commit or its abort, and what the ingest counters say of it.

A stream whose client left (or whose deadline passed) after the commit point is stored whole
(trial16; :meth:`.commit.CommitProtocol.commit` then raises :class:`~.commit.CommittedAfterLeave`).
It counts in ``oprag_documents_ingested_total`` and ``oprag_chunks_ingested_total`` like any
stored stream, and not in ``oprag_ingest_streams_aborted_total``, which counts only streams that
stored nothing (before, it was counted aborted and its documents and chunks nowhere).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..shards.protocol import AbortRequest, ApplyReply, Op
from .commit import CommittedAfterLeave


async def commit_stream(commit: Callable[[str, str], Awaitable[tuple[int, list[ApplyReply]]]], txn: str,
                        res: Any, metrics: Any) -> None:
    """Commit the stream's transaction ``txn`` on every shard; set ``res`` (an
    :class:`~.ingest.IngestResult`: ``seq``, documents and chunks written, documents replaced)
    and count the documents and chunks written.

    :raises CommittedAfterLeave: the caller was cancelled after the commit point (the stream is
        stored, ``res`` set and counted first).
    :raises Exception | asyncio.CancelledError: what ``commit`` raised otherwise (nothing stored).
    """
    try:
        seq, replies = await commit(txn, "upsert")
    except CommittedAfterLeave as left:
        _written(res, *left.result, metrics)
        raise
    _written(res, seq, replies, metrics)


def _written(res: Any, seq: int, replies: list[ApplyReply], metrics: Any) -> None:
    res.seq = seq
    res.documents_written = sum(len(o.doc_ids) for o in replies)
    res.documents_replaced = sum(o.replaced_docs for o in replies)
    res.chunks_written = sum(o.added for o in replies)
    metrics.documents_ingested.inc(res.documents_written)
    metrics.chunks_ingested.inc(res.chunks_written)


async def abort_stream(pool: Any, txn: str, metrics: Any, caller_left: bool = False,
                       before_commit: BaseException | None = None) -> None:
    """Count the stream as aborted and drop what the shards staged under ``txn`` (a shard that
    is down has nothing staged any more: it is left out; errors are swallowed, the stream's own
    error is the one to report). ``caller_left``: the caller was cancelled (client gone, deadline
    passed) after its final message arrived and before the commit began: it cannot know the
    outcome, so the stream counts in ``oprag_writes_after_caller_left_total{kind=upsert,outcome=aborted}``
    too, as one cancelled during the commit does (:class:`~.commit.CommitProtocol`).
    ``before_commit``: the stream's error when its commit never began (nothing was stored): marked
    ``nothing_stored``, which the status interceptor sends as the trailer ``oprag-stored: none``
    (trial48 #18: a client that lost sight of the stream after its final message cannot know)."""
    if isinstance(before_commit, Exception):
        try:
            before_commit.nothing_stored = True
        except AttributeError:  # (an exception type without attributes: its status says nothing more)
            pass
    metrics.streams_aborted.inc()
    if caller_left:
        metrics.writes_after_caller_left.labels(kind="upsert", outcome="aborted").inc()
    try:
        await pool.gather_partial(Op.ABORT, AbortRequest(txn))
    except Exception:  # noqa: BLE001
        pass
