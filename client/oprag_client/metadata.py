"""Typed metadata values of the Python clients (README: typed metadata): what a ``Doc``'s
``metadata`` and a filter may hold, and how a wire ``Hit`` / ``Document``'s metadata reads back."""

from __future__ import annotations

import math
from typing import Any

from oprag.v1 import oprag_pb2

MetadataValue = str | int | float | bool
_INT64 = (-(2**63), 2**63 - 1)


def metadata_value(key: str, v: Any, kind: str = "metadata") -> oprag_pb2.MetadataValue:
    """The wire ``MetadataValue`` of a typed metadata value (README: typed metadata); a numpy
    scalar counts as its Python value (``np.int64(3)`` is the integer 3).

    :param kind: what the messages call the key: ``metadata``, or ``metadata filter`` for a
        query's filter value (the server's word).
    :raises ValueError: a type other than str/int/float/bool, an integer outside signed 64-bit,
        NaN or infinity (the message names the key).
    """
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0:
        v = v.item()  # a numpy scalar (np.int64, np.float32, np.bool_, np.str_): its Python value
    if isinstance(v, bool):
        return oprag_pb2.MetadataValue(bool_value=v)
    if isinstance(v, int):
        if not _INT64[0] <= v <= _INT64[1]:
            raise ValueError(f"{kind} {key!r}: integer {v} is outside signed 64-bit; send it as a string")
        return oprag_pb2.MetadataValue(int_value=v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{kind} {key!r}: {v} is not a finite number; send a finite float or a string")
        return oprag_pb2.MetadataValue(float_value=v)
    if isinstance(v, str):
        return oprag_pb2.MetadataValue(string_value=v)
    name = type(v).__name__
    what = "None" if v is None else f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
    raise ValueError(f"{kind} {key!r} is {what}: values must be string, integer, float or boolean")


def metadata_of(pb: Any) -> dict[str, MetadataValue]:
    """Typed metadata of a wire ``Hit`` or ``Document``: its ``typed_metadata`` over its string
    ``metadata`` (a server that predates typed metadata sends strings only)."""
    out: dict[str, MetadataValue] = dict(pb.metadata)
    for k, mv in pb.typed_metadata.items():
        kind = mv.WhichOneof("kind")
        if kind is not None:
            out[k] = getattr(mv, kind)
    return out
