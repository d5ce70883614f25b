"""A shard's chunk store: stored chunk fields, the dense index, the BM25 postings and the
metadata index, with the writes that keep them consistent (apply a bulk batch, delete
documents). Reads live in :mod:`oprag_server.shards.search`.

Every chunk has a shard-local *slot* (int64, never reused). A document's chunks carry the
document's generation; a batch with another generation replaces the stored version.

Stored fields stay in Arrow (:mod:`.fields`): each applied batch's columns (copied out of the
message) or the snapshot's ``chunks.arrow`` memory-mapped, never one Python object per field;
only chunk ids, document ids and content hashes are Python strings (the maps that need them).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from .. import metadata as md
from .. import records
from ..index import kernels_delta, term_ids
from ..index.term_ids import TermTable, take_rows
from ..index.bm25 import PostingsIndex
from ..config import DenseConfig
from ..index.dense import DenseIndex
from .fields import ChunkRecord, StoredFields
from .protocol import ApplyReply, ReuseReply, ReuseRequest

__all__ = ["ChunkRecord", "ChunkStore"]

#: per chunk besides its strings: a dict entry in the document and hash maps (~2 x 40 bytes with
#: the index table), an object-array slot for its id, a list slot and a small int object
_MAP_ENTRY_BYTES = 120
#: rows per record batch of a snapshot's ``chunks.arrow`` (:meth:`ChunkStore.batches`)
BATCH_ROWS = 65536


def _slots_of(v) -> list[int]:
    return [v] if isinstance(v, int) else v


class ChunkStore:
    """Chunks of one shard (pure in-process object).

    :param dim: vector width D. :param stem: BM25 analyser stemming.
    Attributes: ``chunks`` a read-only mapping {slot: ChunkRecord} over the stored fields;
    ``doc_slots`` {doc_id: slot, or [slot, ...] for several chunks}; ``applied_seq`` the highest applied sequence number;
    ``version`` grows on every write.
    """

    def __init__(self, dim: int, stem: bool = False, dense: DenseConfig | None = None) -> None:
        self.dim = dim
        self.terms = TermTable(stem=stem)  # BM25 tokens as shard-wide term ids (..index.term_ids)
        self.analyzer = self.terms.analyzer  # the one analyser (its ``stem`` goes into snapshots)
        term_ids.warm()
        kernels_delta.warm()
        self.dense = DenseIndex(dim, dense)
        self.postings = PostingsIndex()
        self.fields = StoredFields()
        self.chunks = self.fields.view()
        self.doc_slots: dict[str, int | list[int]] = {}
        self.meta_index: dict[str, dict[tuple, set[int]]] = {}  # key -> match_key(value) -> slots
        # content hash -> the slot holding that text, or the set of them when several do
        self.hash_slots: dict[str, int | set[int]] = {}
        self.next_slot = 0
        self.applied_seq = 0
        self.version = 0
        self._row_ids_cache: np.ndarray | None = None
        self._slot_ids = np.empty(0, dtype=object)  # slot -> chunk id (None once removed)
        self._key_bytes = 0  # sys.getsizeof of the id, document id and hash strings held

    # ------------------------------------------------------------------ writes
    def analyse(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """BM25 tokens of every row of ``table`` as term ids: ``(gids int64, lens int64 [rows])``
        (:meth:`..index.term_ids.TermTable.rows`: the analyser's tokens of ``title\ntext``)."""
        return self.terms.rows(table)

    def upsert(self, table: pa.Table, seq: int, index_ann: bool = True,
               tokens: tuple[np.ndarray, np.ndarray] | None = None, index_lexical: bool = True,
               copy_fields: bool = True) -> ApplyReply:
        """Apply a bulk batch of chunks (schema :func:`records.chunk_schema`); ``index_ann=False``
        leaves the approximate dense structure to the caller (snapshot load), and so does
        ``index_lexical=False`` the BM25 postings (a snapshot load that maps stored postings).
        ``copy_fields=False`` keeps the table's own buffers for the stored fields (a snapshot's
        memory-mapped file; a message's buffers would keep its vectors alive too: copied).

        ``tokens``: :meth:`analyse` of ``table`` when the caller has it (analysed at staging).
        A document whose stored generation differs from the batch's generation is replaced:
        its old chunks leave the dense index and the postings first. When the batch holds
        several versions of one document (the same id sent twice), the last version sent wins
        (the highest generation: the frontend numbers a stream's documents in order) and the
        earlier ones are never indexed, wherever their rows are (chunks with reused or supplied
        vectors reach the shard before earlier chunks still being embedded).
        """
        # Python objects only for what the maps need (titles and texts are analysed from Arrow)
        cols = {name: table.column(name).to_pylist() for name in ("chunk_id", "doc_id", "generation", "content_hash",
                                                                   "metadata")}
        if index_lexical:
            tokens = tokens if tokens is not None else self.analyse(table)
        # a snapshot written with HNSW keeps its vectors in the structure only (DenseIndex.load_ann)
        vecs = records.vectors_of(table) if "vector" in table.column_names else None
        last_gen: dict[str, int] = {}
        for doc_id, g in zip(cols["doc_id"], cols["generation"]):
            if int(g) > last_gen.get(doc_id, -1):
                last_gen[doc_id] = int(g)
        keep_rows = [i for i, (d, g) in enumerate(zip(cols["doc_id"], cols["generation"])) if int(g) == last_gen[d]]
        if len(keep_rows) != len(cols["doc_id"]):
            cols = {k: [v[i] for i in keep_rows] for k, v in cols.items()}
            vecs = vecs[keep_rows] if vecs is not None else None
            tokens = take_rows(*tokens, keep_rows) if index_lexical else None
        removed = replaced = 0
        if self.doc_slots.keys().isdisjoint(cols["doc_id"]):  # every document new here (a load)
            new_slots = self._add_new(cols)
        else:
            new_slots, removed, replaced = self._add_rows(cols)
        self.fields.add(table, new_slots, keep_rows, copy=copy_fields)
        if removed:
            self.fields.maybe_compact()
        if index_lexical:
            self.postings.add_ids(new_slots, tokens[0], tokens[1], self.terms)
        if new_slots:
            if self.next_slot > self._slot_ids.size:
                grown = np.empty(max(self.next_slot, 2 * self._slot_ids.size, 1024), dtype=object)
                grown[: self._slot_ids.size] = self._slot_ids
                self._slot_ids = grown
            self._slot_ids[new_slots] = cols["chunk_id"]
            if vecs is None:
                self.dense.add_pending(np.asarray(new_slots, dtype=np.int64))
            else:
                # HNSW: into the graph between requests (ShardState.background_step), not here
                self.dense.add(np.asarray(new_slots, dtype=np.int64), vecs, ann=index_ann, defer=True)
            self._row_ids_cache = None
        self.applied_seq = max(self.applied_seq, int(seq))
        self.version += 1
        self.postings.maybe_merge(background=True)
        return ApplyReply(doc_ids=sorted(set(cols["doc_id"])), added=len(new_slots), removed=removed,
                          replaced_docs=replaced, delta=self.postings.drain_delta())

    def delete(self, doc_ids: list[str], seq: int) -> ApplyReply:
        """Remove documents (ids not stored here are ignored)."""
        gone = [d for d in dict.fromkeys(doc_ids) if d in self.doc_slots]
        docs, chunks = len(gone), self._remove_docs(gone)
        self.fields.maybe_compact()
        self.applied_seq = max(self.applied_seq, int(seq))
        if docs:
            self.version += 1
            self.postings.maybe_merge(background=True)
        return ApplyReply(deleted_docs=docs, removed=chunks, delta=self.postings.drain_delta())

    def _add_new(self, cols: dict) -> list[int]:
        """The maps of rows whose documents are all new here, in bulk (C-level dict updates:
        a snapshot load's 500K rows take ~1 s, not ~10 s row by row)."""
        docs, n = cols["doc_id"], len(cols["doc_id"])
        new_slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        if len(set(docs)) == n:
            self.doc_slots.update(zip(docs, new_slots))
        else:
            for d, slot in zip(docs, new_slots):
                held = self.doc_slots.get(d)
                self.doc_slots[d] = slot if held is None else ([held, slot] if isinstance(held, int) else [*held, slot])
        hashes = [h or "" for h in cols["content_hash"]]
        if len(set(hashes)) == n and self.hash_slots.keys().isdisjoint(hashes):
            self.hash_slots.update(zip(hashes, new_slots))
        else:
            for h, slot in zip(hashes, new_slots):
                self._hash_add(h, slot)
        for i, meta in enumerate(cols["metadata"]):
            if meta and meta != "{}":
                self._index_metadata(new_slots[i], meta)
        self._key_bytes += sum(map(sys.getsizeof, cols["chunk_id"])) + sum(map(sys.getsizeof, docs)) + sum(
            map(sys.getsizeof, hashes))
        return new_slots

    def _add_rows(self, cols: dict) -> tuple[list[int], int, int]:
        """The maps of rows one by one (documents replaced or extended): the replaced documents' old chunks leave
        first, together (one by one, a replacing ingest's apply took ~0.6 ms a document: session 41)."""
        gen = dict(zip(cols["doc_id"], cols["generation"]))  # (one generation a document: kept above)
        gone = [d for d, g in gen.items() if d in self.doc_slots and self.doc_generation(d) != int(g)]
        replaced, removed = len(gone), self._remove_docs(gone)
        new_slots: list[int] = []
        for i, doc_id in enumerate(cols["doc_id"]):
            slot = self.next_slot
            self.next_slot += 1
            held = self.doc_slots.get(doc_id)
            if held is None:
                self.doc_slots[doc_id] = slot  # one-chunk documents (most at scale): no list
            elif isinstance(held, int):
                self.doc_slots[doc_id] = [held, slot]
            else:
                held.append(slot)
            h = cols["content_hash"][i] or ""
            meta = cols["metadata"][i] or "{}"
            if meta != "{}":
                self._index_metadata(slot, meta)
            self._hash_add(h, slot)
            self._key_bytes += sum(map(sys.getsizeof, (cols["chunk_id"][i], doc_id, h)))
            new_slots.append(slot)
        return new_slots, removed, replaced

    def doc_generation(self, doc_id: str) -> int | None:
        """The stored generation of a document (None when it is not stored)."""
        held = self.doc_slots.get(doc_id)
        return None if held is None else self.fields.generation(_slots_of(held)[0])

    def _hash_add(self, h: str, slot: int) -> None:
        held = self.hash_slots.get(h)
        self.hash_slots[h] = slot if held is None else ({held, slot} if isinstance(held, int) else held | {slot})

    def _hash_discard(self, h: str, slot: int) -> None:
        held = self.hash_slots.get(h)
        if held is None or held == slot:
            self.hash_slots.pop(h, None)
        elif not isinstance(held, int):
            held.discard(slot)
            if len(held) == 1:
                self.hash_slots[h] = next(iter(held))

    def _remove_docs(self, doc_ids: list[str]) -> int:
        """Remove every chunk of the stored documents ``doc_ids`` (one dense remove and one fields gather for all).
        :returns: chunks removed."""
        slots = [s for d in doc_ids for s in _slots_of(self.doc_slots.pop(d, []))]
        if slots:
            self.dense.remove(np.asarray(slots, dtype=np.int64))
            recs = self.fields.pop(slots)
            for s, rec in zip(slots, recs):
                self.postings.remove(s)
                self._slot_ids[s] = None
                self._key_bytes -= sum(map(sys.getsizeof, (rec.chunk_id, rec.doc_id, rec.content_hash)))
                if rec.metadata and rec.metadata != "{}":
                    self._unindex_metadata(s, rec.metadata)
                self._hash_discard(rec.content_hash, s)
            self._row_ids_cache = None
        return len(slots)

    def _index_metadata(self, slot: int, metadata: str) -> None:
        for k, v in md.loads(metadata).items():
            self.meta_index.setdefault(k, {}).setdefault(md.match_key(v), set()).add(slot)

    def _unindex_metadata(self, slot: int, metadata: str) -> None:
        for k, v in md.loads(metadata).items():
            v = md.match_key(v)
            vals = self.meta_index.get(k, {})
            vals.get(v, set()).discard(slot)
            if v in vals and not vals[v]:
                del vals[v]
            if k in self.meta_index and not vals:
                del self.meta_index[k]

    def nbytes(self) -> dict[str, int]:
        """Bytes held by component: ``postings`` and ``terms`` (BM25, :meth:`PostingsIndex.nbytes`, and the
        term-id table of :mod:`..index.term_ids`),
        ``vectors`` and ``ann`` (:meth:`DenseIndex.nbytes`), and ``chunks``: the stored fields'
        Arrow buffers and per-slot arrays (:meth:`.fields.StoredFields.nbytes`; a memory-mapped
        snapshot file counts in full, though only the pages read are resident), plus
        ``sys.getsizeof`` of the chunk id, document id and content hash strings the maps hold,
        8 bytes per chunk of the slot-to-id array and ~120 of map entries (per live chunk)."""
        n = len(self.fields)
        maps = self._key_bytes + (8 + _MAP_ENTRY_BYTES) * n
        out = {**self.postings.nbytes(), **self.dense.nbytes(), "chunks": int(self.fields.nbytes() + maps)}
        out["terms"] += self.terms.nbytes()  # the staging's term-id table (..index.term_ids)
        return out

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

    def lay_out(self, seeds=None) -> bool:
        """HNSW: renumber the dense graph for locality when due (:meth:`..index.graph_rows.GraphRows.lay_out_ann`),
        then :meth:`rows_moved`. :returns: whether it did."""
        if not self.dense.lay_out_ann(seeds):
            return False
        self.rows_moved()
        return True

    def rows_moved(self) -> None:
        """The dense index's rows were put in another order (a renumbering for locality; a background compaction's
        install, which adds the live vectors in slot order): drop what follows that order, as a write does (the
        chunk ids by row; the exact scan's caches, keyed by :attr:`version`: trial47 #1, ``FULL_HYBRID`` named its
        hits by other rows' chunk ids)."""
        self._row_ids_cache = None
        self.version += 1

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
            if slots is None:  # (a one-chunk document's value is its slot: 0 is a slot)
                continue
            slots = _slots_of(slots)
            vecs = self.dense.vectors_of(np.asarray(slots, dtype=np.int64))
            hashes = self.fields.column(slots, "content_hash")
            out[d] = {h: vecs[i].copy() for i, h in enumerate(hashes)}
        by_hash = {}
        for h in req.content_hashes:
            slots = self.hash_slots.get(h)
            if slots is not None:
                low = slots if isinstance(slots, int) else min(slots)
                by_hash[h] = self.dense.vectors_of(np.asarray([low], dtype=np.int64))[0].copy()
        return ReuseReply(out, by_hash)

    def batch(self, vectors: bool = True) -> pa.RecordBatch:
        """Every stored chunk with its vector (``vectors=False``: without the ``vector``
        column), in slot order; built from the Arrow columns, not per row."""
        return self._block(self.fields.slots(), vectors)

    def batches(self, vectors: bool = True, rows: int | None = None, start: int = 0) -> Iterator[pa.RecordBatch]:
        """:meth:`batch` as record batches of at most ``rows`` (default :data:`BATCH_ROWS`) rows,
        at least one (maybe empty), each built once the previous one was consumed: a snapshot's
        writer streams them to the file and holds one at a time (one batch of every row was a
        ~0.85 GB copy of a 1M-chunk shard's texts). Rows of one mapped part are sliced, not
        copied (:meth:`.fields.StoredFields.table`); after each batch, the pages of the mapped
        snapshot files it read leave the RSS (:meth:`.fields.StoredFields.release_mapped`). ``start``: from the
        live row of that rank on (the rows after a snapshot's linked files, :mod:`.chunk_files`)."""
        slots, rows = self.fields.slots()[start:], rows or BATCH_ROWS
        for i in range(0, max(int(slots.size), 1), rows):
            yield self._block(slots[i: i + rows], vectors)
            self.fields.release_mapped()

    def _block(self, slots: np.ndarray, vectors: bool) -> pa.RecordBatch:
        t = self.fields.table(slots, records.chunk_schema(self.dim), fresh=False)  # written out, then dropped
        # (a one-chunk column as it is: a slice of a part; ChunkedArray.combine_chunks copies even one chunk)
        out = pa.RecordBatch.from_arrays([c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in t.columns],
                                         schema=t.schema)
        if vectors:
            vecs = self.dense.vectors_of(slots) if slots.size else np.zeros((0, self.dim), np.float32)
            col = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(vecs, np.float32).reshape(-1)), self.dim)
            out = pa.RecordBatch.from_arrays([*out.columns, col], schema=records.chunk_schema(self.dim))
        return out
