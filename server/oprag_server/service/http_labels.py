"""The label values of the HTTP API's requests in ``oprag_requests_total{method, code}`` and
``oprag_request_seconds{method}`` (:class:`.http.Guard` counts them): a bounded set, every
combination exported as 0 from the start (:func:`init_labels`)."""

from __future__ import annotations

from typing import Any

#: HTTP status -> the gRPC code name counted in ``oprag_requests_total{code}``.
CODE_NAME = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
             413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 503: "UNAVAILABLE"}
#: the API's routes by metric label; any other path counts as "HTTP other" (a bounded label set)
ROUTES = ("/v1/chat/completions", "/v1/embeddings", "/v1/retrieve", "/v1/models")


def metric_method(path: str) -> str:
    """``HTTP <route>`` for the API's routes (``/v1/models/{id}`` counts as ``/v1/models``),
    ``HTTP other`` for every other path, so a client cannot grow the metric's label set."""
    for route in ROUTES:
        if path == route or (route == "/v1/models" and path.startswith("/v1/models/") and path.count("/") == 3):
            return f"HTTP {route}"
    return "HTTP other"


def init_labels(metrics: Any, *, tokens: bool) -> None:
    """Export every ``method`` x ``code`` the API counts as 0 (``UNAUTHENTICATED`` only when
    bearer ``tokens`` are required; ``UNIMPLEMENTED``, a 405, and ``DEADLINE_EXCEEDED`` appear as used)."""
    codes = sorted({*CODE_NAME.values(), "INTERNAL"} - {"UNIMPLEMENTED"} - (set() if tokens else {"UNAUTHENTICATED"}))
    metrics.init_requests([metric_method(r) for r in ROUTES] + ["HTTP other"], codes)
