"""What a session id may be (README: memory), shared by gRPC (``Query``, ``QueryStream``,
``Retrieve``, ``ClearSession``) and the HTTP API (``oprag.session_id``, ``/v1/retrieve``), which
validates through :func:`oprag_server.service.convert.check_session_id` as well.

A session id is 1 to ``max_bytes`` (256) bytes of UTF-8 with no control character (Unicode
category Cc: C0 U+0000-U+001F, DEL U+007F, C1 U+0080-U+009F; NUL included) and no leading or
trailing whitespace (what ``str.strip`` removes: spaces, tabs, U+00A0, U+3000, ...). Whitespace
inside is allowed ("alice smith"). "" is no session where one is optional.

The characters rule applies where a session can be created or written (``Query``, ``QueryStream``,
``Retrieve``, the HTTP requests: each records a turn); ``ClearSession`` (``existing=True``) takes
any non-empty id within the length bound, so that a session stored before the rule (whitespace
around the id, a control character) can still be cleared.
"""

from __future__ import annotations

import unicodedata


def rule(max_bytes: int) -> str:
    """The sentence every refusal ends with."""
    return (f"a session id is 1 to {max_bytes} bytes of UTF-8 with no control characters (U+0000-U+001F, "
            "U+007F-U+009F) and no leading or trailing whitespace")


def problem(session_id: str, max_bytes: int, *, required: bool = False, existing: bool = False) -> str | None:
    """What is wrong with ``session_id`` (a message starting with ``session_id``, ending with
    :func:`rule`), or None when it is allowed ("" is allowed unless ``required``; with ``existing``,
    naming a session that may have been stored before the characters rule, only the length
    bound applies)."""
    if not session_id:
        return f"session_id is empty: name the session to clear ({rule(max_bytes)})" if required else None
    if len(session_id.encode("utf-8", "surrogatepass")) > max_bytes:
        return f"session_id is longer than {max_bytes} bytes: {rule(max_bytes)}"
    if existing:
        return None
    for i, ch in enumerate(session_id):
        if unicodedata.category(ch) == "Cc":
            return f"session_id contains the control character U+{ord(ch):04X} at character {i}: {rule(max_bytes)}"
    if session_id != session_id.strip():
        where = ("is only whitespace" if not session_id.strip() else
                 "starts with whitespace" if session_id[0].isspace() else "ends with whitespace")
        return f"session_id {where}: {rule(max_bytes)}"
    return None
