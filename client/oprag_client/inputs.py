"""Client-side checks of text inputs: protobuf refuses a string that is not valid Unicode (a lone
surrogate such as ``"\\ud800"``, from ``surrogateescape`` decoding or a JSON ``\\ud800`` escape)
with a bare ``UnicodeEncodeError``; :func:`bad_text` finds the field and says what to pass."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from oprag.v1 import oprag_pb2


def _strings(path: str, v: Any) -> Iterator[tuple[str, str]]:
    if isinstance(v, str):
        yield path, v
    elif isinstance(v, Mapping):
        for k, x in v.items():
            yield from _strings(f"{path} key {k!r}", k)
            yield from _strings(f"{path}[{k!r}]", x)
    elif isinstance(v, (list, tuple, set, frozenset)):
        for i, x in enumerate(v):
            yield from _strings(f"{path}[{i}]", x)


def bad_text(fields: Mapping[str, Any], prefix: str = "") -> ValueError:
    """The ValueError for the first string of ``fields`` (``{name: value}``; strings nested in
    lists, tuples and mappings, keys included) that cannot be encoded as UTF-8."""
    for name, v in fields.items():
        for path, s in _strings(name, v):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                return ValueError(
                    f"{prefix}{path} has an unpaired surrogate {s[exc.start]!r} at index {exc.start}, which UTF-8 "
                    "cannot encode: pass valid Unicode text (repair it with e.g. "
                    "s.encode('utf-8', 'replace').decode(), or decode the source bytes without 'surrogateescape')")
    return ValueError(f"{prefix}a text field is not valid Unicode: pass valid Unicode text")


def names_bad_text(*names: str):
    """Decorator: a ``UnicodeEncodeError`` (protobuf refusing a string) of the wrapped request
    builder becomes :func:`bad_text` of its arguments ``names``."""
    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            try:
                return fn(*args, **kw)
            except UnicodeEncodeError:
                given = sig.bind(*args, **kw).arguments
                raise bad_text({n: given.get(n) for n in names}) from None

        return wrapper

    return deco


@names_bad_text("doc_ids")
def delete_request(doc_ids: Iterable[str]) -> oprag_pb2.DeleteRequest:
    """:raises ValueError: an id that is not valid Unicode.
    :raises TypeError: ``doc_ids`` is one string (iterated, it would name one document per character)."""
    if isinstance(doc_ids, (str, bytes)):
        raise TypeError(f"doc_ids must be a list of ids, got the {type(doc_ids).__name__} {doc_ids!r} "
                        f"(read as one id per character): pass [{doc_ids!r}]")
    return oprag_pb2.DeleteRequest(doc_ids=list(doc_ids))


@names_bad_text("session_id")
def clear_session_request(session_id: str) -> oprag_pb2.ClearSessionRequest:
    """:raises ValueError: a session id that is not valid Unicode."""
    return oprag_pb2.ClearSessionRequest(session_id=session_id)
