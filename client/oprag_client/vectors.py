"""Query vectors on the wire: a numpy array without a numpy scalar per value."""

from __future__ import annotations


def floats(v) -> list[float]:
    """A query vector as a list of Python floats (``[]`` for None): a 1-D float numpy array through
    ``tolist`` (the same values as ``float(x)`` of each element, ~2.5x faster for 384 values),
    anything else element by element."""
    if v is None:
        return []
    dt = getattr(v, "dtype", None)
    if dt is not None and getattr(dt, "kind", "") == "f" and getattr(v, "ndim", 0) == 1:
        return v.tolist()
    return [float(x) for x in v]
