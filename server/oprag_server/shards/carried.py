"""The stored fields a search reply carries, built from the stored UTF-8 bytes (issue 13 hot
path, shard side): no string is decoded on the shard nor encoded again for the pipe."""

from __future__ import annotations

from . import packed
from .protocol import FetchReply


class CarriedFields(FetchReply):
    """A :class:`FetchReply` built from the stored fields' UTF-8 bytes (:meth:`.fields.StoredFields.hit_utf8`):
    its columns decode a string when read (:class:`.packed.FieldColumn`), and it pickles as the
    compact form :func:`.packed.reduce_fetch` gives the same values (the same bytes on the pipe;
    the other side gets a plain ``FetchReply``) without decoding and encoding them first."""

    __slots__ = ("raw",)

    @classmethod
    def of(cls, slots: list[int], blob: bytes, lens: list[int]) -> "CarriedFields":
        n = len(slots)
        rows = packed._Utf8Rows(blob, n, lens)  # noqa: SLF001
        rep = cls([True] * n, *(packed.FieldColumn(rows, c) for c in range(4)), slots)
        rep.raw = (rep.found, n, blob, lens, slots)
        return rep

    def __reduce__(self):
        return packed.fetch_reply, self.raw
