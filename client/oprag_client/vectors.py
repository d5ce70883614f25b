"""Query vectors on the wire: a numpy array without a numpy scalar per value."""

from __future__ import annotations


def floats(v) -> list[float]:
    """A query vector as a list of Python floats (``[]`` for None): a 1-D float numpy array through
    ``tolist`` (the same values as ``float(x)`` of each element, ~2.5x faster for 384 values),
    anything else element by element.

    :raises ValueError: an array that is not one-dimensional (a matrix, a 0-d scalar)."""
    if v is None:
        return []
    if getattr(v, "ndim", 1) != 1:
        raise ValueError(f"query_vector must be one vector (shape (D,)), got shape {getattr(v, 'shape', None)}: "
                         "pass one row, e.g. vectors[i]")
    dt = getattr(v, "dtype", None)
    if dt is not None and getattr(dt, "kind", "") == "f" and getattr(v, "ndim", 0) == 1:
        return v.tolist()
    return [float(x) for x in v]
