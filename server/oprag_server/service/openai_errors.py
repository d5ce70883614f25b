"""OpenAI-style errors of the HTTP API (:mod:`.http`): the message of a request that failed pydantic
validation (:func:`validation_message`: the field's path, what it must be, what was sent), OpenAI's
``param`` of an ``INVALID_ARGUMENT`` raised by the shared gRPC validation (:func:`error_param`), and
the error replies ``{"error": {"message", "type", "param", "code"}}`` of an exception
(:func:`exception_response`: the gRPC status mapping turned into HTTP). The request shapes are
:mod:`.openai_api`'s."""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..engine.query import Overloaded
from .convert import range_error
from .interceptors import status_for

#: the wire's uint32 bound (the request models' ``le``; a knob past it gets the server's range message)
U32 = 2**32 - 1

#: pydantic type errors -> what the field must be
_KINDS = {"string_type": "a string", "bool_type": "a boolean", "int_type": "an integer", "int_parsing": "an integer",
          "int_from_float": "an integer", "float_type": "a number", "float_parsing": "a number", "list_type": "a list",
          "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object", "none_required": "null"}


def _path(e: dict, body: Any) -> tuple[list, bool]:
    """The error's path in the body (keys and list indexes; pydantic's union-branch and validator
    tags dropped) and whether it is about a mapping key ("[key]")."""
    path, cur, key = [], body, False
    loc = list(e.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    for i, x in enumerate(loc):
        if x == "[key]":
            key = True
        elif isinstance(cur, dict) and isinstance(x, str) and x in cur:
            path.append(x)
            cur = cur[x]
        elif isinstance(cur, list) and isinstance(x, int) and 0 <= x < len(cur):
            path.append(x)
            cur = cur[x]
        elif i == len(loc) - 1 and e.get("type") == "missing" and isinstance(x, str):
            path.append(x)
    return path, key


def _name(path: list) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else ("." if i else "") + x for i, x in enumerate(path))


def _shown(v: Any) -> str:
    try:
        t = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        t = repr(v)
    return t if len(t) <= 60 else t[:57] + "..."


def _fields_at(model: Any, path: list) -> list[str]:
    """Field names of the model at ``path`` (the parent of an unknown field), [] when not a model."""
    for x in path:
        if isinstance(x, int):
            continue
        f = getattr(model, "model_fields", {}).get(x)
        ann = getattr(f, "annotation", None)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return list(getattr(model, "model_fields", {}))


#: the retrieval knobs: top-level fields of /v1/retrieve, under "oprag" in a chat request
_KNOBS = {"mode", "top_k", "candidates", "filters", "fusion", "session_id", "disable_memory", "include_trace",
          "ef_search", "nprobe", "group_by_document", "chunks_per_document", "query_vector", "min_seq"}
_FIELD = re.compile(r"(?:metadata filter '(?P<key>.*?)'|(?P<filters>a metadata filter|\d+ metadata filters)"
                    r"|(?:top_k x )?(?P<f>[a-z_]+(?:\.[a-z_]+)*(?:\[-?\d+\])?) (?:must|is|has|needs|contains|starts|ends) "
                    r"|the (?P<q>question) needs)")


def error_param(message: str, path: str) -> str | None:
    """OpenAI's ``param`` of an INVALID_ARGUMENT raised by the shared validation (its message
    starts with the field's wire name): the request's own path to the field, e.g. ``top_k`` on
    /v1/retrieve and ``oprag.top_k`` in a chat request; the question is ``query`` or ``messages``."""
    m = _FIELD.match(message)
    if m is None:
        return None
    field = (f"filters.{m['key']}" if m["key"] is not None else "filters" if m["filters"] else m["f"] or m["q"])
    root = re.split(r"[.\[]", field)[0]
    chat = path.endswith("/chat/completions")
    if root == "question":
        return "messages" if chat else "query" if path.endswith("/retrieve") else None
    if root in _KNOBS:
        return f"oprag.{field}" if chat else field
    return field if root in {"input", "dimensions", "max_tokens", "max_completion_tokens", "messages", "stop"} else None


def validation_message(errors: list[dict], body: Any, model: Any = None) -> tuple[str | None, str]:
    """As :func:`_message`, with lone surrogates (JSON ``\\ud800`` escapes in a key or value) escaped:
    the error body must encode as UTF-8."""
    param, msg = _message(errors, body, model)
    safe = lambda t: t.encode("utf-8", "backslashreplace").decode("utf-8")  # noqa: E731
    return (None if param is None else safe(param)), safe(msg)


def _message(errors: list[dict], body: Any, model: Any = None) -> tuple[str | None, str]:
    """``(param, message)`` of a request that failed validation: the first error's field (a path
    such as ``messages[0].content`` or ``oprag.top_k``), what it must be, what was sent; a union's
    alternatives in one sentence; an unknown field with the known ones (``model``: the request's
    pydantic class)."""
    # an unknown field first: a typo ("qury") also makes its field missing, and the typo is the cause
    errors = sorted(errors, key=lambda x: x.get("type") != "extra_forbidden")
    e = errors[0] if errors else {"type": "", "msg": "invalid request", "loc": ()}
    path, key = _path(e, body)
    param = _name(path) or None
    what = f"a key of {param or 'the body'}" if key else param or "the body"
    t, ctx, got = e.get("type", ""), e.get("ctx") or {}, _shown(e.get("input"))
    if t == "extra_forbidden":
        known = _fields_at(model, path[:-1])
        near = difflib.get_close_matches(str(path[-1]) if path else "", known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return param, (f"unknown field {param!r}: {hint}the fields here are {', '.join(known)}" if known
                       else f"unknown field {param!r}: remove it")
    if t == "missing":
        return param, f"{what} is required: add it"
    deeper = [x for x in errors if len(p := _path(x, body)[0]) > len(path) and p[:len(path)] == path]
    if t in _KINDS and deeper:  # a list alternative failed inside: its element is what to fix
        return _message(deeper, body, model)
    if t in _KINDS:  # a union fails once per alternative: name them all
        kinds = []
        for x in errors:
            if x.get("type") in _KINDS and _path(x, body)[0] == path and _KINDS[x["type"]] not in kinds:
                kinds.append(_KINDS[x["type"]])
        if "a number" in kinds and "an integer" in kinds:
            kinds.remove("an integer")
        one = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
        return param, f"{what} must be {one}, got {got}"
    if t == "literal_error":
        return param, f"{what} must be one of {ctx.get('expected')}, got {got}"
    bounds = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
              "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}
    if t == "less_than_equal" and ctx.get("le") == U32 and path[-1:] in (["top_k"], ["candidates"], ["ef_search"], ["nprobe"]):
        return param, range_error(path[-1], got)  # the server's message for 101 (not the wire type's bound)
    if t in bounds:
        return param, f"{what} must be {bounds[t][0]} {ctx.get(bounds[t][1])}, got {got}"
    if t == "too_short":
        return param, f"{what} needs at least {ctx.get('min_length')} item(s), got {got}"
    if t == "string_unicode":
        return param, f"{what} is not valid Unicode (an unpaired surrogate), got {got}: send valid Unicode"
    if t == "value_error":
        return param, f"{what}: {ctx.get('error', e.get('msg'))}"
    return param, f"{what}: {e.get('msg')}, got {got}"


# ------------------------------------------------------------------------------ error replies
#: gRPC status of an exception (interceptors.status_for) -> HTTP status and OpenAI error type.
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}


class NotFound(LookupError):
    """An unknown model id (-> 404, code ``model_not_found``)."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def exception_response(exc: Exception, method: str) -> JSONResponse:
    """The HTTP error of an exception a handler raised: the gRPC mapping
    (:func:`~oprag_server.service.interceptors.status_for`) turned into HTTP."""
    if isinstance(exc, NotFound):
        return error_response(404, str(exc), param="model", code="model_not_found")
    code, msg, _ = status_for(exc, method)
    status, type_ = _HTTP.get(code, (500, "server_error"))
    headers = None
    if isinstance(exc, Overloaded):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    param = error_param(msg, method) if code == grpc.StatusCode.INVALID_ARGUMENT else None
    return error_response(status, msg, type_, param=param, code=code.name.lower(), headers=headers)
