"""A shard's chunk store: stored chunk fields, the dense index, the BM25 postings and the
metadata index, with the writes that keep them consistent (apply a bulk batch, delete
documents). Reads live in :mod:`oprag_server.shards.search`.

Every chunk has a shard-local *slot* (int64, never reused). A document's chunks carry the
document's generation; a batch with another generation replaces the stored version.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .. import metadata as md
from .. import records
from ..index.analyzer import Analyzer
from ..index.bm25 import PostingsIndex
from ..config import DenseConfig
from ..index.dense import DenseIndex
from .protocol import ApplyReply, ReuseReply, ReuseRequest


def _record_bytes(rec: "ChunkRecord") -> int:
    return (sys.getsizeof(rec) + 200 + sum(map(sys.getsizeof, (rec.chunk_id, rec.doc_id, rec.title, rec.text,
                                                              rec.metadata, rec.content_hash))))


@dataclass(slots=True)
class ChunkRecord:
    chunk_id: str
    doc_id: str
    title: str
    text: str
    metadata: str  # JSON object of typed values (:mod:`..metadata`)
    ordinal: int
    generation: int
    content_hash: str


class ChunkStore:
    """Chunks of one shard (pure in-process object).

    :param dim: vector width D. :param stem: BM25 analyser stemming.
    Attributes: ``chunks`` {slot: ChunkRecord}; ``doc_slots`` {doc_id: [slot]};
    ``applied_seq`` the highest applied sequence number; ``version`` grows on every write.
    """

    def __init__(self, dim: int, stem: bool = False, dense: DenseConfig | None = None) -> None:
        self.dim = dim
        self.analyzer = Analyzer(stem=stem)
        self.dense = DenseIndex(dim, dense)
        self.postings = PostingsIndex()
        self.chunks: dict[int, ChunkRecord] = {}
        self.doc_slots: dict[str, list[int]] = {}
        self.doc_generation: dict[str, int] = {}
        self.meta_index: dict[str, dict[tuple, set[int]]] = {}
        self.hash_slots: dict[str, set[int]] = {}  # content hash -> slots holding that text  # key -> match_key(value) -> slots
        self.next_slot = 0
        self.applied_seq = 0
        self.version = 0
        self._row_ids_cache: np.ndarray | None = None
        self._slot_ids = np.empty(0, dtype=object)  # slot -> chunk id (None once removed)
        self._chunk_bytes = 0  # estimate of the stored fields (see nbytes)

    # ------------------------------------------------------------------ writes
    def analyse(self, table: pa.Table, out: dict[tuple[str, str], list[str]]) -> None:
        """BM25 tokens of each chunk of ``table`` into ``out``, keyed by ``(title, text)``."""
        for title, text in zip(table.column("title").to_pylist(), table.column("text").to_pylist()):
            title = title or ""
            if (title, text) not in out:
                out[(title, text)] = self.analyzer.tokens(f"{title}\n{text}" if title else text)

    def upsert(self, table: pa.Table, seq: int, index_ann: bool = True,
               tokens: dict[tuple[str, str], list[str]] | None = None, index_lexical: bool = True) -> ApplyReply:
        """Apply a bulk batch of chunks (schema :func:`records.chunk_schema`); ``index_ann=False``
        leaves the approximate dense structure to the caller (snapshot load), and so does
        ``index_lexical=False`` the BM25 postings (a snapshot load that maps stored postings).

        A document whose stored generation differs from the batch's generation is replaced:
        its old chunks leave the dense index and the postings first. When the batch holds
        several versions of one document (the same id sent twice), the last version wins and
        the earlier ones are never indexed.
        """
        cols = {name: table.column(name).to_pylist() for name in table.column_names if name != "vector"}
        # a snapshot written with HNSW keeps its vectors in the structure only (DenseIndex.load_ann)
        vecs = records.vectors_of(table) if "vector" in table.column_names else None
        last_gen: dict[str, int] = {}
        for doc_id, g in zip(cols["doc_id"], cols["generation"]):
            last_gen[doc_id] = int(g)
        keep_rows = [i for i, (d, g) in enumerate(zip(cols["doc_id"], cols["generation"])) if int(g) == last_gen[d]]
        if len(keep_rows) != len(cols["doc_id"]):
            cols = {k: [v[i] for i in keep_rows] for k, v in cols.items()}
            vecs = vecs[keep_rows] if vecs is not None else None
        removed = replaced = 0
        new_slots: list[int] = []
        new_tokens: list[list[str]] = []
        for i, doc_id in enumerate(cols["doc_id"]):
            gen = int(cols["generation"][i])
            if self.doc_generation.get(doc_id) != gen:
                if doc_id in self.doc_slots:
                    replaced += 1
                removed += self._remove_doc(doc_id)
                self.doc_generation[doc_id] = gen
                self.doc_slots[doc_id] = []
            slot = self.next_slot
            self.next_slot += 1
            rec = ChunkRecord(chunk_id=cols["chunk_id"][i], doc_id=doc_id, title=cols["title"][i] or "",
                              text=cols["text"][i], metadata=cols["metadata"][i] or "{}",
                              ordinal=int(cols["ordinal"][i]), generation=gen,
                              content_hash=cols["content_hash"][i] or "")
            self.chunks[slot] = rec
            self._chunk_bytes += _record_bytes(rec)
            self._index_metadata(slot, rec)
            self.hash_slots.setdefault(rec.content_hash, set()).add(slot)
            self.doc_slots[doc_id].append(slot)
            toks = tokens.get((rec.title, rec.text)) if tokens else None
            if index_lexical:
                new_tokens.append(toks if toks is not None else self._index_tokens(rec))
            new_slots.append(slot)
        if index_lexical:
            self.postings.add_batch(new_slots, new_tokens)
        if new_slots:
            if self.next_slot > self._slot_ids.size:
                grown = np.empty(max(self.next_slot, 2 * self._slot_ids.size, 1024), dtype=object)
                grown[: self._slot_ids.size] = self._slot_ids
                self._slot_ids = grown
            self._slot_ids[new_slots] = [self.chunks[s].chunk_id for s in new_slots]
            if vecs is None:
                self.dense.add_pending(np.asarray(new_slots, dtype=np.int64))
            else:
                self.dense.add(np.asarray(new_slots, dtype=np.int64), vecs, ann=index_ann)
            self._row_ids_cache = None
        self.applied_seq = max(self.applied_seq, int(seq))
        self.version += 1
        self.postings.maybe_merge(background=True)
        return ApplyReply(doc_ids=sorted(set(cols["doc_id"])), added=len(new_slots), removed=removed,
                          replaced_docs=replaced, delta=self.postings.drain_delta())

    def delete(self, doc_ids: list[str], seq: int) -> ApplyReply:
        """Remove documents (ids not stored here are ignored)."""
        docs = chunks = 0
        for d in doc_ids:
            if d in self.doc_slots:
                docs += 1
                chunks += self._remove_doc(d)
        self.applied_seq = max(self.applied_seq, int(seq))
        if docs:
            self.version += 1
            self.postings.maybe_merge(background=True)
        return ApplyReply(deleted_docs=docs, removed=chunks, delta=self.postings.drain_delta())

    def _remove_doc(self, doc_id: str) -> int:
        slots = self.doc_slots.pop(doc_id, [])
        self.doc_generation.pop(doc_id, None)
        if slots:
            self.dense.remove(np.asarray(slots, dtype=np.int64))
            for s in slots:
                self.postings.remove(s)
                rec = self.chunks.pop(s, None)
                self._slot_ids[s] = None
                if rec is not None:
                    self._chunk_bytes -= _record_bytes(rec)
                    self._unindex_metadata(s, rec)
                    held = self.hash_slots.get(rec.content_hash)
                    if held is not None:
                        held.discard(s)
                        if not held:
                            del self.hash_slots[rec.content_hash]
            self._row_ids_cache = None
        return len(slots)

    def _index_tokens(self, rec: ChunkRecord) -> list[str]:
        # The title is part of what BM25 sees for every chunk of the document.
        return self.analyzer.tokens(f"{rec.title}\n{rec.text}" if rec.title else rec.text)

    def _index_metadata(self, slot: int, rec: ChunkRecord) -> None:
        for k, v in md.loads(rec.metadata).items():
            self.meta_index.setdefault(k, {}).setdefault(md.match_key(v), set()).add(slot)

    def _unindex_metadata(self, slot: int, rec: ChunkRecord) -> None:
        for k, v in md.loads(rec.metadata).items():
            v = md.match_key(v)
            vals = self.meta_index.get(k, {})
            vals.get(v, set()).discard(slot)
            if v in vals and not vals[v]:
                del vals[v]
            if k in self.meta_index and not vals:
                del self.meta_index[k]

    def nbytes(self) -> dict[str, int]:
        """Bytes held by component: ``postings`` and ``terms`` (BM25, :meth:`PostingsIndex.nbytes`),
        ``vectors`` and ``ann`` (:meth:`DenseIndex.nbytes`), and ``chunks``: the stored fields,
        estimated per chunk as ``sys.getsizeof`` of the record and of its six strings (id,
        document id, title, text, metadata JSON, content hash) plus 200 bytes for its entries
        in the slot, document, hash and metadata maps."""
        return {**self.postings.nbytes(), **self.dense.nbytes(), "chunks": int(self._chunk_bytes)}

    # ------------------------------------------------------------------ lookups
    def allowed(self, filters) -> np.ndarray | None:
        """Sorted int64 slots whose document metadata satisfies every ``(key, values)``
        filter (set membership; equality with one value); None when there is no filter.
        Values compare as typed values (:func:`..metadata.match_key`: ``True`` matches only
        boolean true, ``"true"`` only the string, 1 and 1.0 match each other)."""
        if not filters:
            return None
        result: set[int] | None = None
        for key, values in filters:
            vals = self.meta_index.get(key, {})
            match: set[int] = set()
            for v in values:
                match |= vals.get(md.match_key(v), set())
            result = match if result is None else result & match
            if not result:
                break
        return np.asarray(sorted(result or ()), dtype=np.int64)

    def row_ids(self) -> np.ndarray:
        """Chunk ids aligned with the dense index's rows (object array, cached until a write)."""
        if self._row_ids_cache is None or len(self._row_ids_cache) != len(self.dense):
            self._row_ids_cache = self._slot_ids[self.dense.slots]
        return self._row_ids_cache

    def ids(self, slots) -> list[str]:
        """Chunk ids of the given live slots (int64[M] or a sequence of ints)."""
        return self._slot_ids[np.asarray(slots, dtype=np.int64)].tolist()

    def reuse(self, req: ReuseRequest) -> ReuseReply:
        """For each stored document asked for: ``{content_hash: vector float32[D]}`` of its
        chunks, so a re-ingested document only embeds the chunks whose content changed; and for
        each content hash asked for that a chunk here has, the vector of its lowest slot."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for d in req.doc_ids:
            slots = self.doc_slots.get(d)
            if not slots:
                continue
            vecs = self.dense.vectors_of(np.asarray(slots, dtype=np.int64))
            out[d] = {self.chunks[s].content_hash: vecs[i].copy() for i, s in enumerate(slots)}
        by_hash = {}
        for h in req.content_hashes:
            slots = self.hash_slots.get(h)
            if slots:
                by_hash[h] = self.dense.vectors_of(np.asarray([min(slots)], dtype=np.int64))[0].copy()
        return ReuseReply(out, by_hash)

    def batch(self, vectors: bool = True) -> pa.RecordBatch:
        """Every stored chunk with its vector (``vectors=False``: without the ``vector``
        column), in slot order (for a snapshot)."""
        slots = sorted(self.chunks)
        recs = [self.chunks[s] for s in slots]
        if not vectors:
            vecs = np.zeros((len(slots), self.dim), np.float32)
        else:
            vecs = self.dense.vectors_of(np.asarray(slots, dtype=np.int64)) if slots else np.zeros((0, self.dim), np.float32)
        out = records.make_chunk_batch(
            chunk_ids=[r.chunk_id for r in recs], doc_ids=[r.doc_id for r in recs], titles=[r.title for r in recs],
            texts=[r.text for r in recs], metadata=[md.loads(r.metadata) for r in recs],
            ordinals=[r.ordinal for r in recs], generations=[r.generation for r in recs],
            content_hashes=[r.content_hash for r in recs], vectors=vecs,
        )
        return out if vectors else out.drop_columns(["vector"])
