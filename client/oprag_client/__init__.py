"""OpRAG's Python client: ``from oprag_client import OpRAGClient, AsyncOpRAGClient, Doc, query_request`` (the
names of :mod:`.client`, imported on first use, so ``oprag_client.testing`` and the CLI pay nothing for them)."""

_CLIENT = ("OpRAGClient", "AsyncOpRAGClient", "Doc", "query_request")
__all__ = list(_CLIENT)


def __getattr__(name: str):
    if name in _CLIENT:
        from . import client  # noqa: PLC0415

        return getattr(client, name)
    raise AttributeError(f"module 'oprag_client' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CLIENT})
