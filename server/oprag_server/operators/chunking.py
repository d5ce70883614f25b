"""Fixed-size character chunking.

Units: sizes are counted in Unicode code points (Python ``str`` indexing), so a code
point -- including astral-plane characters such as emoji or CJK extension B
ideographs -- is never split.  Grapheme clusters made of several code points (e.g.
``"e" + U+0301``, ZWJ emoji sequences, flags) *can* be split across two chunks.
"""

from __future__ import annotations

__all__ = ["chunk_text"]


def chunk_text(text: str, size: int = 900, overlap: int = 0) -> list[str]:
    """Split ``text`` into windows of ``size`` code points advancing by ``size - overlap``.

    Window ``i`` is ``text[i*step : i*step + size]`` with ``step = size - overlap``;
    the last window is the first one that reaches the end of the text and it ends
    exactly at ``len(text)`` (it may be shorter than ``size``, but always contains at
    least one code point not in the previous window, so no window lies entirely
    inside its predecessor).  Nothing is dropped and no chunk is empty.  With
    ``overlap == 0``, ``"".join(chunk_text(t, s)) == t``.

    Examples: 1,801 characters -> lengths ``[900, 900, 1]``; 1,800 -> ``[900, 900]``;
    ``chunk_text("abcdefg", 4, 2)`` -> ``["abcd", "cdef", "efg"]``.

    Args:
        text: input ``str``.
        size: window length in code points, > 0.
        overlap: code points shared by consecutive windows, ``0 <= overlap < size``.

    Returns:
        ``list[str]``; ``[]`` for ``""``; ``[text]`` when ``len(text) <= size``.

    Raises:
        TypeError: ``text`` is not a ``str`` or ``size``/``overlap`` are not ints.
        ValueError: ``size <= 0`` or ``overlap`` not in ``[0, size)``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    for name, v in (("size", size), ("overlap", overlap)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be int, got {type(v).__name__}")
    if size <= 0:
        raise ValueError(f"size must be > 0, got {size}")
    if not 0 <= overlap < size:
        raise ValueError(f"overlap must be in [0, size={size}), got {overlap}")
    n = len(text)
    if n <= size:
        return [text] if n else []
    step = size - overlap
    out: list[str] = []
    start = 0
    while start + size < n:
        out.append(text[start : start + size])
        start += step
    out.append(text[start:])
    return out
