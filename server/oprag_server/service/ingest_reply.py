"""The ``IngestResponse`` of a committed stream, kept under the message limit: gRPC fails a reply
over it on the way out (RESOURCE_EXHAUSTED) after the stream committed, so the client would
read a stored stream as failed (README: ingest semantics)."""

from __future__ import annotations

from typing import Any

from oprag.v1 import oprag_pb2


def ingest_response(res: Any, limits: Any = None) -> oprag_pb2.IngestResponse:
    """``IngestResponse`` from an :class:`~oprag_server.engine.ingest.IngestResult`. With ``limits``
    the reply stays under the message limit: a rejected id is shown up to ``max_doc_id_bytes``
    (an over-long id is itself a rejection, and 40 ids of 1 MB made the reply too big to send
    after the stream had committed), and rejections that would not fit are summed up in one last
    entry (its ``index``: the first one not listed)."""
    max_id = limits.max_doc_id_bytes if limits is not None else None
    msg = oprag_pb2.IngestResponse(
        documents_written=res.documents_written, chunks_written=res.chunks_written,
        documents_replaced=res.documents_replaced,
        chunks_split=res.chunks_split, chunks_reused=res.chunks_reused, seq=res.seq, elapsed_ms=res.elapsed_ms,
    )
    rejected = [oprag_pb2.RejectedDocument(index=i, id=_clip(d, max_id), reason=r) for i, d, r in res.rejected]
    if limits is not None:
        budget = limits.max_message_bytes - msg.ByteSize() - 1024  # room for the summary entry
        for n, rj in enumerate(rejected):
            budget -= rj.ByteSize() + 8  # tag and length of the entry
            if budget < 0:
                rejected[n:] = [oprag_pb2.RejectedDocument(index=rj.index, reason=(
                    f"this and {len(rejected) - n - 1} more rejected documents after it are not listed: the "
                    f"reply would exceed the {limits.max_message_bytes}-byte message limit (send fewer "
                    "documents per stream to see every reason)"))]
                break
    msg.rejected.extend(rejected)
    return msg


def _clip(text: str, max_bytes: int | None) -> str:
    """``text``, or its first ``max_bytes`` UTF-8 bytes (whole characters) followed by an ellipsis."""
    if max_bytes is None or len(text) <= max_bytes // 4 or len(b := text.encode("utf-8")) <= max_bytes:
        return text
    return b[:max_bytes].decode("utf-8", "ignore") + "…"
