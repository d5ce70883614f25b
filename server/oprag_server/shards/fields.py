"""Stored chunk fields of one shard in Arrow, not as Python objects (issue 13).

Each applied batch adds a *part*: its fields columns (``chunk_id``, ``doc_id``, ``title``,
``text``, ``metadata``, ``ordinal``, ``generation``, ``content_hash``) copied out of the message
(``take``: fresh buffers, so the message and its vectors are freed), or the columns of a
snapshot's memory-mapped ``chunks.arrow`` as they are (file-backed pages: resident only once
read; a snapshot writes it as record batches of bounded size, read as one part whose columns
have a chunk per batch, :class:`.strcols.StrColumn`). A slot maps to ``(part, row)``; a removed
slot maps to nothing and its row stays in its part until :meth:`StoredFields.maybe_compact`
rewrites the parts (once dead rows are half the live ones). Fields are read for the final hits
only (:meth:`StoredFields.records`), a few ``take`` calls per request.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .strcols import StrColumn, groups as _groups, in_order as _in_order


@functools.cache
def _kernels_fields():
    """:mod:`..index.kernels_fields` (numba), imported on first use: the frontend reads stored fields too."""
    return importlib.import_module("..index.kernels_fields", __package__)

FIELDS = ("chunk_id", "doc_id", "title", "text", "metadata", "ordinal", "generation", "content_hash")


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


class StoredFields:
    """Slot -> stored fields (see the module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._parts: list[pa.Table] = []
        self._part = np.full(0, -1, dtype=np.int32)  # slot -> part, -1 when absent
        self._row = np.zeros(0, dtype=np.int32)  # slot -> row in its part
        self._gen = np.zeros(0, dtype=np.uint64)  # slot -> document generation
        self._live = 0
        self._rows = 0  # rows held in parts, dead ones included
        self._cols: dict[tuple, tuple] = {}  # (id(part), names) -> (part, string column readers)
        #: ``[(Path, rows, crc32)]``: the snapshot files whose rows, in order, are the first live rows in slot order,
        #: nothing removed since and nothing stored below them (the next snapshot may link them: :mod:`.chunk_files`),
        #: or None
        self.prefix: list | None = None
        self._hi = -1  # the highest slot stored so far
        self._maps: list = []  # mmaps the parts view (their pages dropped from RSS: release_mapped)

    def __len__(self) -> int:
        return self._live

    def add(self, table: pa.Table, slots: list[int], rows: list[int], copy: bool = True) -> None:
        """Store rows ``rows`` of ``table`` (schema :func:`..records.chunk_schema`, the vector
        column ignored) under ``slots`` (int, ascending, new).

        :param copy: False keeps the table's buffers (a memory-mapped snapshot file); True
            copies the rows out (``take``), so nothing else of the table stays alive.
        """
        if not slots:
            return
        if slots[0] <= self._hi:  # (rows below a file's: the files are no longer the first rows)
            self.prefix = None
        self._hi = max(self._hi, int(slots[-1]))
        part = table.select(list(FIELDS))
        if copy or len(rows) != table.num_rows:
            part = part.take(pa.array(rows, type=pa.int64()))
        top = slots[-1] + 1
        if top > self._part.size:
            cap = max(top, 2 * self._part.size, 1024)
            self._part = np.concatenate([self._part, np.full(cap - self._part.size, -1, np.int32)])
            self._row = np.concatenate([self._row, np.zeros(cap - self._row.size, np.int32)])
            self._gen = np.concatenate([self._gen, np.zeros(cap - self._gen.size, np.uint64)])
        s = np.asarray(slots, dtype=np.int64)
        self._part[s] = len(self._parts)
        self._row[s] = np.arange(len(slots), dtype=np.int32)
        self._gen[s] = part.column("generation").to_numpy()
        self._parts.append(part)
        self._live += len(slots)
        self._rows += len(slots)

    def generation(self, slot: int) -> int:
        return int(self._gen[slot])

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < self._part.size and self._part[slot] >= 0

    def slots(self) -> np.ndarray:
        """int64[n]: the live slots, ascending."""
        return np.flatnonzero(self._part >= 0).astype(np.int64)

    def _gather(self, slots, names) -> dict[str, list]:
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if not s.size:
            return {n: [] for n in names}
        parts = self._part[s]
        if parts.size and parts[0] == parts[-1] and (parts == parts[0]).all():  # one part (a snapshot): in order
            return self._parts[int(parts[0])].select(list(names)).take(pa.array(self._row[s].astype(np.int64))).to_pydict()
        out: dict[str, list] = {n: [None] * s.size for n in names}
        for p in np.unique(parts).tolist():
            pos = np.flatnonzero(parts == p)
            got = self._parts[p].select(list(names)).take(pa.array(self._row[s[pos]].astype(np.int64))).to_pydict()
            for n in names:
                col = out[n]
                for j, v in zip(pos.tolist(), got[n]):
                    col[j] = v
        return out

    def _strings(self, s: np.ndarray, names: tuple[str, ...]) -> dict[str, list]:
        """:meth:`_gather` of string columns, read from the Arrow buffers directly where a part's
        columns are plain one-chunk string arrays (the same values; ~5x less CPU than ``take`` +
        ``to_pydict`` for the ~20 rows a search reply carries), else through :meth:`_gather`."""
        if not s.size:
            return {n: [] for n in names}
        groups = _groups(self._part[s])
        got: list[list] = [[] for _ in names]
        for pos, p in groups:
            cols = self._readers(p, names)
            if cols is None:
                return self._gather(s, names)
            rows = self._row[s if pos is None else s[pos]].astype(np.int64)
            for k, c in enumerate(cols):
                got[k] += c(rows)
        return {n: _in_order(v, groups) for n, v in zip(names, got)}

    def _readers(self, p: int, names: tuple[str, ...]) -> "list[StrColumn] | None":
        """Readers of part ``p``'s columns ``names`` (cached with the part), None when one is
        not a plain string array."""
        part = self._parts[p]
        hit = self._cols.get((id(part), names))
        if hit is not None and hit[0] is part:
            return hit[1]
        cols = [StrColumn.of(part.column(n)) for n in names]
        out = None if any(c is None for c in cols) else cols
        if len(self._cols) > 64:
            self._cols.clear()
        self._cols[(id(part), names)] = (part, out)
        return out

    def hit_utf8(self, slots: np.ndarray) -> tuple[bytes, list[int]] | None:
        """:meth:`hit_fields` of live slots int64[M] as their UTF-8 bytes: the four columns
        (doc_id, title, text, metadata) back to back, column-major, and each string's byte
        length (the compact pickled form of a ``FetchReply``, :func:`.packed.reduce_fetch`,
        without decoding the strings and encoding them again); None when a slot is not stored,
        a column is not a plain string array or has a null doc_id / text (the caller takes
        :meth:`hit_fields`). Rows of several parts are read part by part, then put in order."""
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if not s.size:
            return None
        kf = _kernels_fields()  # compiled: rows of one part with plain columns (the usual case)
        p, rows = kf.one_part(s, self._part, self._row)
        if p == -2:  # out of range or not stored
            return None
        if p >= 0 and (cols := self._readers(p, _HIT)) is not None and all(c.plain() for c in cols):
            out, lens = kf.gather4(rows, *(kf.read_only(x) for c in cols for x in (c.off, c.u8())), kf.META_NONE)
            return out.tobytes(), lens.tolist()
        parts = self._part[s]
        groups = _groups(parts)
        one = len(groups) == 1  # (then every column appends to the same two lists)
        pieces: list[list] = [[]] * len(_HIT) if one else [[] for _ in _HIT]
        lens: list[list] = [[]] * len(_HIT) if one else [[] for _ in _HIT]
        for pos, p in groups:
            cols = self._readers(p, _HIT)
            if cols is None or cols[0].valid is not None or cols[2].valid is not None:
                return None
            rows = self._row[s if pos is None else s[pos]].astype(np.int64)
            for k, (c, none) in enumerate(zip(cols, (b"", b"", b"", b"{}"))):
                c.utf8(rows, none, pieces[k], lens[k])
        if one:
            return b"".join(pieces[0]), lens[0]
        return (b"".join([x for v in pieces for x in _in_order(v, groups)]),
                [x for v in lens for x in _in_order(v, groups)])

    def hit_fields(self, slots) -> tuple[list[bool], list[str], list[str], list[str], list[str]]:
        """What a hit carries of each slot (a sequence of ints): ``(found, doc_ids, titles, texts,
        metadata)``, ``""`` for a slot not stored; the values :meth:`records` gives (a missing
        title ``""``, missing metadata ``"{}"``) without building the records' other fields."""
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        ok = (s >= 0) & (s < self._part.size)
        ok[ok] = self._part[s[ok]] >= 0
        got = self._strings(s[ok], _HIT)
        d, t, x, m = got["doc_id"], [v or "" for v in got["title"]], got["text"], [v or "{}" for v in got["metadata"]]
        if ok.all():
            return [True] * s.size, d, t, x, m
        found, it = ok.tolist(), iter(range(len(d)))
        idx = [next(it) if k else -1 for k in found]
        pick = lambda col: [col[i] if i >= 0 else "" for i in idx]  # noqa: E731
        return found, pick(d), pick(t), pick(x), pick(m)

    def column(self, slots, name: str) -> list:
        """One field of live slots (a sequence of ints), in order."""
        return self._gather(slots, (name,))[name]

    def records(self, slots) -> list[ChunkRecord | None]:
        """The records of the given slots, None for one not stored."""
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        ok = (s >= 0) & (s < self._part.size)
        ok[ok] = self._part[s[ok]] >= 0
        got = self._gather(s[ok], FIELDS)
        recs = [ChunkRecord(*(got[n][j] for n in FIELDS)) for j in range(int(ok.sum()))]
        it = iter(recs)
        return [_clean(next(it)) if k else None for k in ok.tolist()]

    def pop(self, slots: list[int]) -> list[ChunkRecord]:
        """Remove live slots; returns their records (what the maps need to forget them)."""
        recs = self.records(slots)
        s = np.asarray(slots, dtype=np.int64)
        self.prefix = None
        self._part[s] = -1
        self._live -= len(slots)
        return [r for r in recs if r is not None]

    def adopt(self, table: pa.Table, slots: np.ndarray) -> None:
        """Serve the live ``slots`` (int64[n], ascending) from ``table``, row i for slot i:
        a snapshot just written, memory-mapped (one part); the parts held so
        far are dropped.

        :raises ValueError: the row count differs from the live slots'.
        """
        if table.num_rows != slots.size or slots.size != self._live:
            raise ValueError(f"{table.num_rows} rows for {slots.size} slots ({self._live} live)")
        self._set_parts([table.select(list(FIELDS))])
        self._part[slots] = 0
        self._row[slots] = np.arange(slots.size, dtype=np.int32)
        self._rows = self._live

    def mapped(self, files: list, maps: list, reusable: bool) -> None:
        """Parts were just taken from snapshot files ``files`` (``[(Path, rows, crc32)]``) mapped as mmaps ``maps``;
        ``reusable``: they are exactly the live rows in slot order (:attr:`prefix` until a removal)."""
        self._maps.extend(maps)
        self.prefix = list(files) if reusable else None

    def release_mapped(self) -> None:
        """Drop the pages of the memory-mapped snapshot files read so far from this process's
        RSS (clean page-cache pages, read back when needed: a snapshot's writer reading them all)."""
        import mmap  # noqa: PLC0415

        for m in self._maps:
            try:
                m.madvise(mmap.MADV_DONTNEED)
            except (ValueError, OSError):  # (closed)
                pass

    def _set_parts(self, parts: list[pa.Table]) -> None:
        """Replace the parts, and forget the string readers cached for the former ones: a reader
        holds its part's buffers, and a former snapshot's part is a mapping of a file the next
        snapshot deletes (trial16: up to 64 such readers kept their deleted ``chunks.arrow``
        files open, mapped and on the disk, one more per snapshot until the cache filled)."""
        self._parts = parts
        self._cols.clear()
        self._maps, self.prefix = [], None

    def maybe_compact(self) -> None:
        """Rewrite the parts as one, live rows only, once dead rows are half the live ones and
        at least 1,024 (so dead rows never hold more than ~half again the live fields; each
        rewrite is paid for by as many removals), or drop them all when nothing is live."""
        if not self._live:
            self._set_parts([])
            self._rows = 0
            return
        if self._rows - self._live < max(self._live // 2, 1024):
            return
        slots = self.slots()
        table = self.table(slots)
        self._set_parts([table])
        self._part[slots] = 0
        self._row[slots] = np.arange(slots.size, dtype=np.int32)
        self._rows = self._live

    def table(self, slots: np.ndarray, schema: pa.Schema | None = None, fresh: bool = True) -> pa.Table:
        """The fields of live slots int64[n], in that order, as one table: fresh buffers, or
        with ``fresh=False`` (a caller that writes it out and drops it: a snapshot) consecutive
        rows of a part sliced, not gathered (the table may then share a part's buffers)."""
        names = list(FIELDS)
        if not slots.size:
            sch = pa.schema([schema.field(n) for n in names]) if schema is not None else None
            return pa.table({n: [] for n in names}, schema=sch) if sch is not None else pa.table({n: [] for n in names})
        parts = self._part[slots]
        pieces, order = [], []
        for p in np.unique(parts).tolist():
            pos = np.flatnonzero(parts == p)
            rows = self._row[slots[pos]].astype(np.int64)
            pieces.append(self._parts[p].take(pa.array(rows)) if fresh else _rows_of(self._parts[p], rows))
            order.append(pos)
        t = pa.concat_tables(pieces)
        cat = np.concatenate(order)
        if len(pieces) > 1 and (np.diff(cat) < 0).any():  # parts hold ascending slots: usually in order
            inv = np.empty(slots.size, np.int64)
            inv[cat] = np.arange(slots.size)
            t = t.take(pa.array(inv))
        if schema is not None:
            t = t.cast(pa.schema([schema.field(n) for n in names]))
        return t.combine_chunks()

    def nbytes(self) -> int:
        """Arrow buffers of every part (a memory-mapped part counts in full; dead rows count
        until :meth:`maybe_compact`) and the per-slot arrays (part, row, generation: 16 bytes
        per live slot; their capacity, sized by the highest slot, is not counted)."""
        return int(sum(p.get_total_buffer_size() for p in self._parts) + 16 * self._live)

    def view(self) -> "FieldsView":
        return FieldsView(self)


_HIT = ("doc_id", "title", "text", "metadata")


def _rows_of(part: pa.Table, rows: np.ndarray) -> pa.Table:
    """Rows int64[n] of ``part``: a zero-copy slice when they are consecutive (a bulk load's
    parts and a snapshot's file hold their live rows in order: the caller's ``combine_chunks``
    is then the only copy; a ``take`` gathered them first, ~2-3% of a shard's samples in a 1M
    ingest, its snapshots), else a ``take``."""
    if rows.size and int(rows[-1]) - int(rows[0]) == rows.size - 1 and (rows.size == 1 or (np.diff(rows) == 1).all()):
        return part.slice(int(rows[0]), int(rows.size))
    return part.take(pa.array(rows))


def _clean(r: ChunkRecord) -> ChunkRecord:
    r.title, r.metadata, r.content_hash = r.title or "", r.metadata or "{}", r.content_hash or ""
    r.ordinal, r.generation = int(r.ordinal), int(r.generation)
    return r


class FieldsView(Mapping):
    """Read-only ``{slot: ChunkRecord}`` over :class:`StoredFields` (records built on access)."""

    def __init__(self, fields: StoredFields) -> None:
        self._f = fields

    def __getitem__(self, slot: int) -> ChunkRecord:
        rec = self._f.records([slot])[0] if isinstance(slot, (int, np.integer)) else None
        if rec is None:
            raise KeyError(slot)
        return rec

    def __iter__(self) -> Iterator[int]:
        return iter(self._f.slots().tolist())

    def __len__(self) -> int:
        return len(self._f)

    def __contains__(self, slot) -> bool:
        return isinstance(slot, (int, np.integer)) and int(slot) in self._f
