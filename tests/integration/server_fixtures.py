"""Module-scoped server fixtures of the same shape, shared by the integration test modules: a real
server (``python -m oprag_server``) with an HTTP port, some documents ingested up front.

A module defines its ``server`` fixture with :func:`http_server`::

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        yield from http_server(tmp_path_factory, "mytest", "--generator", "none", docs=DOCS)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from oprag_client.client import OpRAGClient
from oprag_client.testing import ServerProcess, free_port


def http_server(tmp_path_factory: Any, name: str, *args: str, docs: Sequence[Any] = (),
                timeout: float = 60.0, token: str | None = None) -> Iterator[ServerProcess]:
    """Start a server on free ports with ``--http-port`` and the options ``args``, ingest ``docs``
    (when any), yield it, and stop it when the fixture ends.

    :param name: the data folder's name under pytest's temporary folder.
    :param timeout: the deadline (s) of each call of the yielded server's ``grpc`` client.
    :param token: the bearer token that client sends (a server with ``--tokens-file``).
    :returns: (yields) the :class:`ServerProcess` with ``url`` (``http://127.0.0.1:<port>/v1``),
        ``grpc`` (an :class:`OpRAGClient` of it, open while the fixture lasts) and ``seq`` (the
        ingest's sequence number, 0 without documents).
    :raises RuntimeError: the server did not start (:meth:`ServerProcess.start`).
    """
    http_port = free_port()
    srv = ServerProcess(tmp_path_factory.mktemp(name) / "data", free_port(), free_port(), *args,
                        "--http-port", str(http_port)).start()
    srv.url = f"http://127.0.0.1:{http_port}/v1"
    try:
        with OpRAGClient(srv.target, timeout=timeout, token=token) as c:
            srv.seq = c.ingest(docs).seq if docs else 0
            srv.grpc = c
            yield srv
    finally:
        srv.stop()
