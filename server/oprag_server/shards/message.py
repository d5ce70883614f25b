"""The ``@message`` decorator of the shard protocol's types (:mod:`.protocol`): a ``slots``
dataclass that pickles as ``(cls, field values)``. Imports the standard library only."""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields


def message(cls):
    """A protocol type: a ``slots`` dataclass that pickles as ``(cls, field values)`` (half the
    cost of the generic slots state on the retrieve path)."""
    cls = dataclass(slots=True)(cls)
    names = tuple(f.name for f in fields(cls))
    get = operator.attrgetter(*names) if len(names) > 1 else None
    one = operator.attrgetter(names[0]) if len(names) == 1 else None
    cls.__reduce__ = (lambda self: (cls, get(self))) if get else (lambda self: (cls, (one(self),))) if one else \
        (lambda self: (cls, ()))
    return cls
