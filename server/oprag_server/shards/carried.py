"""The stored fields a search reply carries, built from the stored UTF-8 bytes (issue 13 hot
path, shard side): no string is decoded on the shard nor encoded again for the pipe."""

from __future__ import annotations

import numpy as np

from . import packed
from .protocol import FetchReply, FetchRequest, FieldsReply, FieldsRequest, SearchRequest


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


class Later:
    """The fields a search reply carries (``fetch_k`` > 0), computed from its candidates: per
    query the top-k when one score ranks them (they come ranked by it), for hybrid the
    k-skyband of both lists (cut by the min-max cone when ``weights`` are given). A search
    sent with ``fields_later`` keeps this and computes them on the FIELDS request right behind
    it (after its reply is on the way); ``version``: the store's write counter at the search."""

    __slots__ = ("token", "version", "mode", "k", "cands", "lexical", "cones")

    def __init__(self, req: SearchRequest, cands: list, lexical: list | None, dense_min: list, version: int) -> None:
        self.token, self.version, self.mode, self.k = req.fields_later, version, req.mode, int(req.fetch_k)
        self.cands, self.lexical, qb = cands, lexical, req.batch
        w = req.weights or [None] * len(cands)
        self.cones = [w[i] and (w[i], dense_min[i], qb.idf[i], qb.k1) for i in range(len(cands))]

    def fields(self, searcher) -> list[FetchReply]:
        """Per query, the :class:`FetchReply` (with ``slots``) of ``searcher`` (a :class:`.search.Searcher`)."""
        k = self.k
        return [searcher._fields(c.slots[:k] if self.mode != "hybrid" else  # noqa: SLF001
                                 searcher._skyband_slots(c, self.lexical[i] if self.lexical else None, k,  # noqa: SLF001
                                                         self.cones[i]))
                for i, c in enumerate(self.cands)]


class FieldsMixin:
    """The stored-fields side of :class:`.search.Searcher` (``self.store``: its ChunkStore;
    ``self._later``: the last search sent with ``fields_later``)."""

    def fetch(self, req: FetchRequest) -> FetchReply:
        """Stored fields of the given slots (``found`` False for a slot deleted meanwhile): from
        the stored UTF-8 bytes (:meth:`_fields`) when every slot is live, else decoded."""
        raw = self.store.fields.hit_utf8(np.asarray(req.slots, np.int64)) if len(req.slots) else None
        if raw is not None:
            return CarriedFields.of(list(req.slots), *raw)
        found, doc_ids, titles, texts, metadata = self.store.fields.hit_fields(req.slots)
        return FetchReply(found=found, doc_ids=doc_ids, titles=titles, texts=texts, metadata=metadata)

    def fields_later(self, req: FieldsRequest) -> FieldsReply:
        """FIELDS: what the reply of the last search sent with ``fields_later`` = ``req.token`` left out
        (:meth:`.carried.Later.fields`); None when that is not the last such search or a write came since."""
        later, self._later = self._later, None
        ok = later is not None and later.token == req.token and later.version == self.store.version
        return FieldsReply(later.fields(self) if ok else None)

    def _fields(self, slots: np.ndarray) -> FetchReply:
        """:meth:`fetch` of live slots int64[M], with ``slots`` set (carried by a search reply):
        from the stored UTF-8 bytes as they are where it can (:class:`CarriedFields`)."""
        raw = self.store.fields.hit_utf8(slots)
        if raw is None:
            rep = self.fetch(FetchRequest(slots.tolist()))
            rep.slots = slots.tolist()
            return rep
        return CarriedFields.of(slots.tolist(), *raw)
