"""Typed document metadata (README: typed metadata): the value types, their checks, the wire
form they arrive in and the keys filters compare them by.

A value is a ``str``, ``int`` (signed 64-bit), ``float`` (finite) or ``bool``. The types are
distinct: boolean ``True`` equals only ``True`` (never the string ``"true"`` nor the number 1);
numbers compare by numeric value, so integer 1 equals float 1.0 (:func:`match_key`). ``None``
(JSON null, or a wire ``MetadataValue`` with no kind set) means "no value": the key is dropped,
the same in every ingestion path. Stored metadata is a JSON object (``records`` column
``metadata``); data written when metadata was string-only holds strings, which stay strings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Union

Value = Union[str, int, float, bool]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_WIRE_KINDS = ("string_value", "int_value", "float_value", "bool_value")


def check_value(key: str, v: Any) -> Value | None:
    """``v`` as a metadata value (``None`` stays ``None``: the caller drops the key).

    :raises ValueError: a type other than str/int/float/bool/None, an integer outside signed
        64-bit, a NaN or infinite float (the message names the key and what to send).
    """
    if v is None or isinstance(v, (str, bool)):
        return v
    if isinstance(v, int):
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"metadata {key!r}: integer {v} is outside signed 64-bit; send it as a string")
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"metadata {key!r}: {v} is not a finite number; send a finite float or a string")
        return float(v)
    raise ValueError(f"metadata {key!r} is a {type(v).__name__}: values must be string, integer, float or boolean")


#: the longest metadata key, in bytes of UTF-8: the filter key limit (``service.convert.MAX_FILTER_KEY_BYTES``),
#: so that every stored key can be filtered on (trial28b: a 5,000-byte key was stored, then no filter could name it)
MAX_KEY_BYTES = 1024


def normalise(m: Mapping[str, Any] | None) -> dict[str, Value]:
    """Checked copy of a metadata mapping with the ``None`` values dropped.

    :raises ValueError: a key that is not a string, is empty or is over :data:`MAX_KEY_BYTES`, or a bad value
        (:func:`check_value`).
    """
    out: dict[str, Value] = {}
    for k, v in (m or {}).items():
        if not isinstance(k, str):
            raise ValueError(f"metadata key {k!r} is not a string")
        if not k:
            raise ValueError("a metadata key is empty: name every metadata key (a filter cannot match an empty key)")
        if (kb := len(k.encode("utf-8", "surrogatepass"))) > MAX_KEY_BYTES:
            raise ValueError(f"metadata key starting {k[:40]!r} is {kb} bytes of UTF-8; the limit is {MAX_KEY_BYTES} "
                             "(a filter key's: no filter could name it): shorten the key")
        cv = check_value(k, v)
        if cv is not None:
            out[k] = cv
    return out


def wire_value(mv: Any) -> Value | None:
    """The value of a wire ``MetadataValue`` (None when no kind is set: null)."""
    kind = mv.WhichOneof("kind")
    return None if kind is None else getattr(mv, kind)


def from_wire(plain: Mapping[str, str], typed: Mapping[str, Any]) -> dict[str, Value]:
    """A document's metadata from its wire maps ``metadata`` (strings) and ``typed_metadata``
    (``MetadataValue``); null typed values are dropped.

    :raises ValueError: a key in both maps, a NaN or infinite float.
    """
    if not plain and not typed:  # (most documents of a bulk load: nothing to check or copy)
        return {}
    both = sorted(set(plain) & set(typed))
    if both:
        raise ValueError(f"metadata key {both[0]!r} is in both metadata and typed_metadata: send it once")
    out = dict(plain)
    out.update({k: wire_value(v) for k, v in typed.items()})
    return normalise(out)


def of_document(doc: Any) -> dict[str, Value]:
    """A wire ``Document``'s metadata: its ``metadata`` and (optional attribute)
    ``typed_metadata`` maps through :func:`from_wire`. :raises ValueError: as ``from_wire``."""
    return from_wire(doc.metadata, getattr(doc, "typed_metadata", {}))


def wire_kind(v: Value) -> dict[str, Value]:
    """Keyword arguments of the wire ``MetadataValue`` holding ``v``."""
    if isinstance(v, bool):
        return {"bool_value": v}
    if isinstance(v, int):
        return {"int_value": v}
    if isinstance(v, float):
        return {"float_value": v}
    return {"string_value": v}


def match_key(v: Value) -> tuple[str, Value]:
    """The key a filter compares ``v`` by: ``("b", bool)``, ``("n", number)`` or ``("s", str)``.
    Python's int/float equality and hashing are exact and agree (1 == 1.0, 2**53 + 1 != 2.0**53),
    so numbers match by exact numeric value."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", v)
    return ("s", v)


def as_text(v: Value) -> str:
    """``v`` as text (the wire's legacy string map): strings unchanged, booleans ``true`` /
    ``false``, numbers in JSON form (``1``, ``1.5``)."""
    return v if isinstance(v, str) else json.dumps(v)


def size_bytes(m: Mapping[str, Value]) -> int:
    """UTF-8 bytes of the keys and the text form of the values (the metadata size limit)."""
    return sum(len(k.encode()) + len(as_text(v).encode()) for k, v in m.items())


def dumps(m: Mapping[str, Value]) -> str:
    """The stored form: a JSON object, keys sorted."""
    return json.dumps(m, sort_keys=True, ensure_ascii=False)


def loads(s: str) -> dict[str, Value]:
    """A stored JSON object back as typed metadata ("" is {})."""
    return json.loads(s) if s else {}
