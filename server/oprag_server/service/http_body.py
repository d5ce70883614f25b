"""Request bodies of the HTTP front door (:mod:`oprag_server.service.http`): every POST body is
parsed here, before FastAPI's own parse, as strict UTF-8 JSON, so that

- a body that is not UTF-8 is a 400 -- also UTF-16 and UTF-32, which ``json.loads`` of bytes would
  detect and accept (trial22);
- malformed JSON is a 400 whose message gives the byte offset (FastAPI's gives none);
- JSON nested too deeply for the parser (about 1,000 levels, Python's recursion limit) is a 400
  saying so (FastAPI's was "There was an error parsing the body" with ``code`` null).

Each is :class:`BadBody`, answered 400 with ``code`` ``invalid_json``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute

_SEND = "send a JSON object encoded as UTF-8 (Content-Type: application/json)"


class BadBody(ValueError):
    """A request body that is not UTF-8 JSON (-> 400, ``code`` ``invalid_json``); the message says
    why and at which byte offset."""


def parse_body(body: bytes) -> Any:
    """The JSON value of a request body.

    :param body: the raw body (UTF-8; a leading UTF-8 byte order mark is allowed and skipped).
    :returns: what ``json.loads`` returns.
    :raises BadBody: the body is not UTF-8 (an invalid byte, or a NUL byte, which UTF-8 JSON never
        holds but UTF-16 and UTF-32 text always does), is not valid JSON, or nests arrays and
        objects too deeply; byte offsets count from the start of the body.
    """
    bom = 3 if body.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadBody(f"the body is not valid UTF-8 (byte offset {e.start}: {e.reason}): {_SEND}") from e
    if (nul := body.find(b"\x00")) >= 0:
        raise BadBody(f"the body is not UTF-8 (byte offset {nul}: a NUL byte, as in UTF-16 or UTF-32 text): {_SEND}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = bom + len(text[:e.pos].encode("utf-8"))
        raise BadBody(f"the body is not valid JSON (byte offset {at}: {e.msg}): {_SEND}") from e
    except RecursionError as e:
        raise BadBody("the body's JSON is nested too deeply: arrays and objects nested about 1,000 levels or "
                      f"more cannot be parsed here; {_SEND}") from e


class JSONRoute(APIRoute):
    """An API route whose POST body is parsed by :func:`parse_body` first (raising
    :class:`BadBody`); the parsed value is left where ``Request.json()`` finds it, so FastAPI does
    not parse it again (were that cache gone, FastAPI would parse the same, valid, UTF-8 again)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def parsed_first(request: Request) -> Any:
            if request.method == "POST" and (body := await request.body()):
                request._json = parse_body(body)  # starlette's Request.json() cache
            return await handler(request)

        return parsed_first
