"""Shard worker process: owns one FAISS partition, the BM25 postings of its chunks and the
memory records of the sessions routed to it.

The process is spawned by :class:`oprag_server.shards.pool.ShardPool` before the gRPC server
starts. It speaks a request/response protocol over a ``multiprocessing`` pipe: each request is
``(request_id, op, args)`` and each reply ``(request_id, ok, result_or_error)``. It handles one
request at a time, so every operation is atomic with respect to queries.

This module imports neither torch nor grpc: shard processes stay small.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .. import records
from ..index.analyzer import Analyzer
from ..index.bm25 import PostingsIndex
from ..index.dense import DenseIndex
from ..index.wal import WriteAheadLog
from ..operators.fusion import fuse_minmax, lexical_listed, top_k_order

FORMAT_VERSION = 1


@dataclass
class ChunkRecord:
    chunk_id: str
    doc_id: str
    title: str
    text: str
    metadata: str  # JSON object
    ordinal: int
    generation: int
    content_hash: str


@dataclass
class MemoryRecord:
    session_id: str
    turn: int
    question: str
    summary: str
    chunk_ids: list[str]
    titles: list[str]
    vector: np.ndarray  # float32[D]
    created: float


def _fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temporary file, fsync, rename, fsync dir."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class ShardState:
    """Everything one shard holds. Pure in-process object (unit-testable without a process)."""

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> None:
        self.shard_id = shard_id
        self.dim = dim
        self.data_dir = data_dir
        self.analyzer = Analyzer(stem=stem)
        self.dense = DenseIndex(dim)
        self.postings = PostingsIndex()
        self.chunks: dict[int, ChunkRecord] = {}
        self.doc_slots: dict[str, list[int]] = {}
        self.doc_generation: dict[str, int] = {}
        self.next_slot = 0
        self.applied_seq = 0
        self.memory: dict[str, list[MemoryRecord]] = {}
        self._full_cache: dict[str, list] = {}
        self.meta_index: dict[str, dict[str, set[int]]] = {}
        self.staged: dict[str, list[pa.Table]] = {}
        self.prepared: dict[str, dict] = {}
        self.wal: WriteAheadLog | None = None
        self._row_ids_cache: np.ndarray | None = None
        self.dirty = False

    # ------------------------------------------------------------------ writes
    def _remove_doc(self, doc_id: str) -> int:
        slots = self.doc_slots.pop(doc_id, [])
        self.doc_generation.pop(doc_id, None)
        if slots:
            self.dense.remove(np.asarray(slots, dtype=np.int64))
            for s in slots:
                self.postings.remove(s)
                rec = self.chunks.pop(s, None)
                if rec is not None:
                    self._unindex_metadata(s, rec)
            self._row_ids_cache = None
        return len(slots)

    def _index_metadata(self, slot: int, rec: ChunkRecord) -> None:
        for k, v in json.loads(rec.metadata).items():
            self.meta_index.setdefault(k, {}).setdefault(v, set()).add(slot)

    def _unindex_metadata(self, slot: int, rec: ChunkRecord) -> None:
        for k, v in json.loads(rec.metadata).items():
            vals = self.meta_index.get(k, {})
            vals.get(v, set()).discard(slot)
            if v in vals and not vals[v]:
                del vals[v]
            if k in self.meta_index and not vals:
                del self.meta_index[k]

    def allowed(self, filters) -> np.ndarray | None:
        """Sorted int64 slots whose document metadata satisfies every ``(key, values)``
        filter (set membership; equality with one value); None when there is no filter."""
        if not filters:
            return None
        result: set[int] | None = None
        for key, values in filters:
            vals = self.meta_index.get(key, {})
            match: set[int] = set()
            for v in values:
                match |= vals.get(v, set())
            result = match if result is None else result & match
            if not result:
                break
        return np.asarray(sorted(result or ()), dtype=np.int64)

    def _row_ids(self) -> np.ndarray:
        """Chunk ids aligned with the dense index's rows (object array, cached until a write)."""
        if self._row_ids_cache is None or len(self._row_ids_cache) != len(self.dense):
            self._row_ids_cache = np.asarray([self.chunks[int(s)].chunk_id for s in self.dense.slots], dtype=object)
        return self._row_ids_cache

    def upsert(self, table: pa.Table, seq: int) -> dict:
        """Apply a bulk batch of chunks (schema :func:`records.chunk_schema`).

        A document whose stored generation differs from the batch's generation is replaced:
        its old chunks leave the dense index and the postings first. When the batch holds
        several versions of one document (the same id sent twice), the last version wins and
        the earlier ones are never indexed.
        :returns: ``{"added", "removed", "replaced_docs", "doc_ids", "delta"}``.
        """
        cols = {name: table.column(name).to_pylist() for name in table.column_names if name != "vector"}
        vecs = records.vectors_of(table)
        last_gen: dict[str, int] = {}
        for doc_id, g in zip(cols["doc_id"], cols["generation"]):
            last_gen[doc_id] = int(g)
        keep_rows = [i for i, (d, g) in enumerate(zip(cols["doc_id"], cols["generation"])) if int(g) == last_gen[d]]
        if len(keep_rows) != len(cols["doc_id"]):
            cols = {k: [v[i] for i in keep_rows] for k, v in cols.items()}
            vecs = vecs[keep_rows]
        removed = 0
        replaced = 0
        new_slots = []
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
            rec = ChunkRecord(
                chunk_id=cols["chunk_id"][i],
                doc_id=doc_id,
                title=cols["title"][i] or "",
                text=cols["text"][i],
                metadata=cols["metadata"][i] or "{}",
                ordinal=int(cols["ordinal"][i]),
                generation=gen,
                content_hash=cols["content_hash"][i] or "",
            )
            self.chunks[slot] = rec
            self._index_metadata(slot, rec)
            self.doc_slots[doc_id].append(slot)
            self.postings.add(slot, self._index_tokens(rec))
            new_slots.append(slot)
        if new_slots:
            self.dense.add(np.asarray(new_slots, dtype=np.int64), vecs)
            self._row_ids_cache = None
        self.applied_seq = max(self.applied_seq, int(seq))
        self.dirty = True
        self._full_cache.clear()
        return {"added": len(new_slots), "removed": removed, "replaced_docs": replaced,
                "doc_ids": sorted(set(cols["doc_id"])), "delta": self.postings.drain_delta()}

    def _index_tokens(self, rec: ChunkRecord) -> list[str]:
        # The title is part of what BM25 sees for every chunk of the document.
        return self.analyzer.tokens(f"{rec.title}\n{rec.text}" if rec.title else rec.text)

    # ------------------------------------------------------------------ transactions
    def stage(self, txn: str, table: pa.Table) -> dict:
        """Hold a bulk batch of an ingest stream without touching the index."""
        self.staged.setdefault(txn, []).append(table)
        return {"staged": sum(t.num_rows for t in self.staged[txn])}

    def abort(self, txn: str) -> dict:
        """Drop a transaction's staged batches, or its prepared record (never applied)."""
        self.prepared.pop(txn, None)
        return {"dropped": sum(t.num_rows for t in self.staged.pop(txn, []))}

    def reusable_vectors(self, doc_ids: list[str]) -> dict[str, dict[str, np.ndarray]]:
        """For each stored document: ``{content_hash: vector float32[D]}`` of its chunks, so a
        re-ingested document only embeds the chunks whose content changed."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for d in doc_ids:
            slots = self.doc_slots.get(d)
            if not slots:
                continue
            vecs = self.dense.vectors_of(np.asarray(slots, dtype=np.int64))
            out[d] = {self.chunks[s].content_hash: vecs[i].copy() for i, s in enumerate(slots)}
        return out

    def delete(self, doc_ids: list[str], seq: int) -> dict:
        """Remove documents. :returns: ``{"docs", "chunks", "delta"}``."""
        docs = chunks = 0
        for d in doc_ids:
            if d in self.doc_slots:
                docs += 1
                chunks += self._remove_doc(d)
        self.applied_seq = max(self.applied_seq, int(seq))
        if docs:
            self.dirty = True
            self._full_cache.clear()
        return {"docs": docs, "chunks": chunks, "delta": self.postings.drain_delta()}

    # ------------------------------------------------------------------ reads
    def _ids(self, slots) -> list[str]:
        return [self.chunks[int(s)].chunk_id for s in slots]

    def _dense_top(self, q: np.ndarray, n: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Top-n slots by inner product (FAISS, or exact numpy scoring of the allowed slots)."""
        if allowed is None:
            ids, scores = self.dense.search(q[None, :], n)
            return ids[0], scores[0].astype(np.float64)
        if allowed.size == 0:
            return allowed, np.zeros(0, np.float64)
        sc = self.dense.score_slots(q, allowed).astype(np.float64)
        order = top_k_order(sc, allowed.tolist(), n)  # ties: lower slot first
        return allowed[order], sc[order]

    def search(self, args: dict) -> list[dict]:
        """Batched candidate generation for B queries (one FAISS call for the unfiltered ones).

        ``args``: ``q`` float32[B, D]; ``terms`` B token lists; ``idf`` B float64[T] arrays
        (corpus-global, from the frontend); ``avgdl``, ``k1``, ``b``; ``mode`` in {"hybrid",
        "dense", "lexical"}; ``n`` local candidates per query; ``filters`` optional B filter
        lists.
        :returns: per query ``{"slots", "chunk_ids", "dense", "lexical", "n"}``, float64
            scores; ``n`` = chunks eligible on this shard.
        """
        q = records.as_query_matrix(args["q"], self.dim)
        mode, n = args["mode"], int(args["n"])
        k1, b, avgdl = args["k1"], args["b"], args["avgdl"]
        filters = args.get("filters") or [None] * q.shape[0]
        allowed = [self.allowed(f) for f in filters]
        out = []
        if mode in ("hybrid", "dense"):
            dmin_est = self._dense_min_estimate(q)
            plain = [i for i, a in enumerate(allowed) if a is None]
            faiss_res = {}
            if plain:
                ids, scores = self.dense.search(q[plain], n)
                faiss_res = {i: (ids[j], scores[j].astype(np.float64)) for j, i in enumerate(plain)}
            for i in range(q.shape[0]):
                slots, dense = faiss_res[i] if i in faiss_res else self._dense_top(q[i], n, allowed[i])
                lex = self.postings.score(slots, args["terms"][i], args["idf"][i], avgdl, k1, b)
                eligible = len(self.dense) if allowed[i] is None else int(allowed[i].size)
                out.append({"slots": slots, "chunk_ids": self._ids(slots), "dense": dense, "lexical": lex, "n": eligible,
                            "dmin_est": float(dmin_est[i])})
        elif mode == "lexical":
            for i in range(q.shape[0]):
                slots, lex = self.postings.score_all(args["terms"][i], args["idf"][i], avgdl, k1, b)
                if allowed[i] is not None:
                    keep = np.isin(slots, allowed[i], assume_unique=True)
                    slots, lex = slots[keep], lex[keep]
                cids = self._ids(slots)
                order = top_k_order(lex, cids, n)
                slots = slots[order]
                dense = self.dense.score_slots(q[i], slots).astype(np.float64)
                eligible = len(self.dense) if allowed[i] is None else int(allowed[i].size)
                out.append({"slots": slots, "chunk_ids": [cids[j] for j in order], "dense": dense,
                            "lexical": lex[order], "n": eligible})
        else:
            raise ValueError(f"unknown search mode {mode!r}")
        return out

    SAMPLE = 512

    def _dense_min_estimate(self, q: np.ndarray) -> np.ndarray:
        """float64[B]: the lowest inner product of each query with a fixed strided sample of at
        most :attr:`SAMPLE` of this shard's vectors (all of them when the shard is smaller): a
        cheap estimate of the corpus-wide dense minimum that dense-first fusion normalises with."""
        n = len(self.dense)
        if n == 0:
            return np.full(q.shape[0], np.inf)
        sample = self.dense.vectors[:: max(1, -(-n // self.SAMPLE))]
        return (q @ sample.T).min(axis=1).astype(np.float64)

    def _exact_scores(self, args: dict, q: np.ndarray) -> list[tuple]:
        """Every eligible chunk's dense and BM25 score, per query.

        :returns: per query ``(rows int64[M], dense float64[M], lexical float64[M])`` where
            rows index the dense index's row order (see :meth:`_row_ids`).
        """
        k1, b, avgdl = args["k1"], args["b"], args["avgdl"]
        filters = args.get("filters") or [None] * q.shape[0]
        row_slots = self.dense.slots
        order = np.argsort(row_slots, kind="stable")
        sorted_slots = row_slots[order]
        dense_all = self.dense.score_all(q)
        out = []
        for i in range(q.shape[0]):
            allowed = self.allowed(filters[i])
            lslots, lex = self.postings.score_all(args["terms"][i], args["idf"][i], avgdl, k1, b)
            lexical = np.zeros(len(row_slots), dtype=np.float64)
            if lslots.size:
                lexical[order[np.searchsorted(sorted_slots, lslots)]] = lex
            if allowed is None:
                rows = np.arange(len(row_slots), dtype=np.int64)
            else:
                rows = order[np.searchsorted(sorted_slots, allowed)] if allowed.size else np.zeros(0, np.int64)
            out.append((rows, dense_all[i][rows].astype(np.float64), lexical[rows]))
        return out

    def _lists(self, rows, d, lx, n: int) -> dict:
        """Local top-n by dense and top-n by BM25 (non-zero scores only: ``lexical_listed``),
        each entry with both scores."""
        ids = self._row_ids()[rows]
        od = top_k_order(d, ids, n)
        pos = np.nonzero(lexical_listed(lx))[0]
        ol = pos[top_k_order(lx[pos], ids[pos], n)] if pos.size else pos
        pick = lambda o: {"rows": rows[o], "chunk_ids": ids[o].tolist(), "dense": d[o], "lexical": lx[o]}  # noqa: E731
        return {"dense_list": pick(np.asarray(od, dtype=np.int64)), "lexical_list": pick(np.asarray(ol, dtype=np.int64))}

    def full_round1(self, args: dict) -> list[dict]:
        """Exact hybrid, round 1: score every eligible chunk (dense: one matrix product; BM25:
        postings of the query terms only, every other chunk scores exactly 0), cache the
        arrays under ``token`` and return the local score ranges.

        :returns: per query ``{"n", "dmin", "dmax", "lmin", "lmax"}``.
        """
        q = records.as_query_matrix(args["q"], self.dim)
        cache = self._exact_scores(args, q)
        out = []
        for rows, d, lx in cache:
            if rows.size == 0:
                out.append({"n": 0, "dmin": 0.0, "dmax": 0.0, "lmin": 0.0, "lmax": 0.0})
            else:
                out.append({"n": int(rows.size), "dmin": float(d.min()), "dmax": float(d.max()),
                            "lmin": float(lx.min()), "lmax": float(lx.max())})
        if len(self._full_cache) > 64:
            self._full_cache.clear()
        self._full_cache[args["token"]] = cache
        return out

    def full_round2(self, args: dict) -> list[dict]:
        """Exact hybrid, round 2: fuse with the corpus-global ranges; return the local top-k by
        (fused desc, chunk id asc) and the local top-``n`` dense and BM25 lists (for ranks)."""
        cache = self._full_cache.pop(args["token"])
        out = []
        for i, (rows, d, lx) in enumerate(cache):
            fused = fuse_minmax(
                d,
                lx,
                dense_range=tuple(args["dense_range"][i]),
                lexical_range=tuple(args["lexical_range"][i]),
                dense_weight=args["dense_weight"][i],
                lexical_weight=args["lexical_weight"][i],
            )
            ids = self._row_ids()[rows]
            order = np.asarray(top_k_order(fused, ids, int(args["k"])), dtype=np.int64)
            sel = rows[order]
            out.append({
                "slots": self.dense.slots[sel], "chunk_ids": ids[order].tolist(), "dense": d[order],
                "lexical": lx[order], "fused": fused[order],
                **self._slot_lists(self._lists(rows, d, lx, int(args["n"]))),
            })
        return out

    def full_lists(self, args: dict) -> list[dict]:
        """Exact retrieval for rank fusion: the local top-``n`` dense and BM25 lists over every
        eligible chunk, in one round."""
        q = records.as_query_matrix(args["q"], self.dim)
        return [
            {"n": int(rows.size), **self._slot_lists(self._lists(rows, d, lx, int(args["n"])))}
            for rows, d, lx in self._exact_scores(args, q)
        ]

    def _slot_lists(self, lists: dict) -> dict:
        for v in lists.values():
            v["slots"] = self.dense.slots[v.pop("rows")]
        return lists

    def fetch(self, slots: list[int]) -> list[dict | None]:
        """Stored fields of the given slots (None for a slot deleted meanwhile)."""
        out = []
        for s in slots:
            r = self.chunks.get(int(s))
            out.append(
                None
                if r is None
                else {"chunk_id": r.chunk_id, "doc_id": r.doc_id, "title": r.title, "text": r.text, "metadata": r.metadata}
            )
        return out

    # ------------------------------------------------------------------ memory
    def memory_upsert(self, rec: dict, max_turns: int, max_total: int = 0, ttl_s: float = 0.0) -> dict:
        """Append one turn record; enforce the per-session turn bound, drop sessions idle for
        longer than ``ttl_s`` and, past ``max_total`` records on this shard, the least recently
        active sessions' oldest records."""
        recs = self.memory.setdefault(rec["session_id"], [])
        recs.append(
            MemoryRecord(
                session_id=rec["session_id"],
                turn=len(recs) and recs[-1].turn + 1,
                question=rec["question"],
                summary=rec["summary"],
                chunk_ids=list(rec["chunk_ids"]),
                titles=list(rec["titles"]),
                vector=np.asarray(rec["vector"], dtype=np.float32).reshape(-1),
                created=time.time(),
            )
        )
        if len(recs) > max_turns:
            del recs[: len(recs) - max_turns]
        now = time.time()
        if ttl_s:
            for sid in [s for s, v in self.memory.items() if v and now - v[-1].created > ttl_s]:
                del self.memory[sid]
        total = sum(len(v) for v in self.memory.values())
        if max_total and total > max_total:
            for sid in sorted(self.memory, key=lambda s: self.memory[s][-1].created if self.memory[s] else 0):
                if total <= max_total:
                    break
                if sid == rec["session_id"]:
                    continue
                drop = min(len(self.memory[sid]), total - max_total)
                del self.memory[sid][:drop]
                total -= drop
                if not self.memory[sid]:
                    del self.memory[sid]
        self.dirty = True
        return {"records": len(recs)}

    def memory_search(self, args: dict) -> list[list[dict]]:
        """Per query: the session's most recent ``k`` turns (newest first), within ``ttl_s``.
        Only records of ``session_ids[i]`` are ever visible to query i."""
        ttl = float(args.get("ttl_s", 0) or 0)
        now = time.time()
        out = []
        for sid in args["session_ids"]:
            recs = [r for r in self.memory.get(sid, []) if not ttl or now - r.created <= ttl]
            recs = recs[-int(args["k"]) :][::-1]
            out.append(
                [
                    {
                        "turn": r.turn,
                        "question": r.question,
                        "summary": r.summary,
                        "chunk_ids": r.chunk_ids,
                        "titles": r.titles,
                    }
                    for r in recs
                ]
            )
        return out

    def memory_clear(self, session_id: str) -> dict:
        n = len(self.memory.pop(session_id, []))
        self.dirty = self.dirty or n > 0
        return {"removed": n}

    # ------------------------------------------------------------------ stats & persistence
    def stats(self, lexical: bool = False) -> dict:
        """Counts; with ``lexical`` also the full BM25 statistics ``(N, total length, df)``
        (the whole vocabulary: only for rebuilding the frontend's corpus statistics)."""
        out = {
            "shard": self.shard_id,
            "documents": len(self.doc_slots),
            "chunks": len(self.chunks),
            "memory_records": sum(len(v) for v in self.memory.values()),
            "applied_seq": self.applied_seq,
        }
        if lexical:
            out["lexical"] = self.postings.full_stats()
        return out

    def _dir(self) -> Path:
        assert self.data_dir is not None
        d = self.data_dir / f"shard-{self.shard_id}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def snapshot(self) -> dict:
        """Write chunks (with vectors) and memory into a new snapshot directory, switch the
        ``CURRENT`` pointer to it atomically (temp file, fsync, rename), then drop older
        snapshots and the write-ahead log records the snapshot now covers."""
        if self.data_dir is None:
            return {"written": False}
        d = self._dir()
        snap = d / f"snap-{self.applied_seq:012d}-{time.time_ns()}"
        snap.mkdir()
        slots = sorted(self.chunks)
        recs = [self.chunks[s] for s in slots]
        vecs = self.dense.vectors_of(np.asarray(slots, dtype=np.int64)) if slots else np.zeros((0, self.dim), np.float32)
        batch = records.make_chunk_batch(
            chunk_ids=[r.chunk_id for r in recs],
            doc_ids=[r.doc_id for r in recs],
            titles=[r.title for r in recs],
            texts=[r.text for r in recs],
            metadata=[json.loads(r.metadata) for r in recs],
            ordinals=[r.ordinal for r in recs],
            generations=[r.generation for r in recs],
            content_hashes=[r.content_hash for r in recs],
            vectors=vecs,
        )
        _fsync_write(snap / "chunks.arrow", records.to_ipc(batch))
        mem = [
            {
                "session_id": r.session_id,
                "turn": r.turn,
                "question": r.question,
                "summary": r.summary,
                "chunk_ids": r.chunk_ids,
                "titles": r.titles,
                "vector": r.vector.tolist(),
                "created": r.created,
            }
            for v in self.memory.values()
            for r in v
        ]
        _fsync_write(snap / "memory.json", json.dumps(mem).encode())
        meta = {"format_version": FORMAT_VERSION, "applied_seq": self.applied_seq, "dim": self.dim,
                "next_slot": self.next_slot, "chunks": len(recs)}
        _fsync_write(snap / "meta.json", json.dumps(meta).encode())
        _fsync_write(d / "CURRENT", snap.name.encode())
        for old in d.glob("snap-*"):
            if old.name != snap.name:
                shutil.rmtree(old, ignore_errors=True)
        if self.wal is not None:  # keep only records of transactions still in flight
            self.wal.reset([r for r in self.wal if r["txn"] in self.prepared])
        self.dirty = False
        return {"written": True, "chunks": len(recs)}

    def load(self, committed: set[str] | None = None) -> int:
        """Load the current snapshot if any, then replay the write-ahead log: records of
        committed transactions (``committed`` txn ids, from the frontend's commit log) with a
        sequence number above the snapshot's are applied in order; others are ignored.

        :returns: number of log records replayed.
        :raises RuntimeError: the snapshot's format version or vector width differ.
        """
        if self.data_dir is None:
            return 0
        d = self._dir()
        cur = d / "CURRENT"
        snap = d / cur.read_text().strip() if cur.exists() else (d if (d / "meta.json").exists() else None)
        if snap is not None:  # (a snapshot written directly into the shard directory: first layout)
            meta = json.loads((snap / "meta.json").read_text())
            if meta.get("format_version") != FORMAT_VERSION:
                raise RuntimeError(f"{snap}: snapshot format {meta.get('format_version')} != {FORMAT_VERSION}")
            if meta.get("dim") != self.dim:
                raise RuntimeError(f"{snap}: vectors have width {meta.get('dim')}, the embedder produces {self.dim}")
            table = records.from_ipc((snap / "chunks.arrow").read_bytes())
            if table.num_rows:
                self.upsert(table, 0)
                self.postings.drain_delta()
            self.applied_seq = int(meta.get("applied_seq", 0))
            self.next_slot = max(self.next_slot, int(meta.get("next_slot", 0)))
            for m in json.loads((snap / "memory.json").read_text()):
                self.memory.setdefault(m["session_id"], []).append(
                    MemoryRecord(
                        session_id=m["session_id"],
                        turn=m["turn"],
                        question=m["question"],
                        summary=m["summary"],
                        chunk_ids=m["chunk_ids"],
                        titles=m["titles"],
                        vector=np.asarray(m["vector"], dtype=np.float32),
                        created=m["created"],
                    )
                )
        self.wal = WriteAheadLog(d / "wal.log")
        replayed = 0
        for rec in sorted(self.wal.open(), key=lambda r: r["seq"]):
            if rec["seq"] <= self.applied_seq or committed is None or rec["txn"] not in committed:
                continue
            self._apply_record(rec)
            replayed += 1
        self.postings.drain_delta()
        self.dirty = replayed > 0
        return replayed

    def _apply_record(self, rec: dict) -> dict:
        if rec["kind"] == "upsert":
            if rec["ipc"]:
                out = self.upsert(records.from_ipc(rec["ipc"]), rec["seq"])
                out["docs"] = sorted(set(out.pop("doc_ids", [])))
                return out
            self.applied_seq = max(self.applied_seq, int(rec["seq"]))
            return {"added": 0, "removed": 0, "replaced_docs": 0, "docs": [], "delta": self.postings.drain_delta()}
        out = self.delete(rec["doc_ids"], rec["seq"])
        return out

    # ------------------------------------------------------------------ two-phase commit
    def prepare(self, txn: str, seq: int, kind: str, doc_ids: list[str] | None = None) -> dict:
        """Phase 1: make a transaction durable in this shard's write-ahead log (fsync) without
        applying it. ``kind`` is ``"upsert"`` (the batches staged under ``txn``) or
        ``"delete"`` (``doc_ids``)."""
        if kind == "upsert":
            tables = self.staged.pop(txn, [])
            ipc = records.to_ipc(pa.concat_tables(tables).combine_chunks().to_batches()[0]) if tables else b""
            rec = {"txn": txn, "seq": int(seq), "kind": "upsert", "ipc": ipc}
        elif kind == "delete":
            rec = {"txn": txn, "seq": int(seq), "kind": "delete", "doc_ids": list(doc_ids or [])}
        else:
            raise ValueError(f"unknown transaction kind {kind!r}")
        if self.wal is not None:
            self.wal.append(rec)
        self.prepared[txn] = rec
        return {"prepared": True}

    def apply(self, txn: str) -> dict:
        """Phase 2 (after the frontend logged the commit): apply a prepared transaction."""
        return self._apply_record(self.prepared.pop(txn))

    # ------------------------------------------------------------------ dispatch
    def handle(self, op: str, args: dict):
        if op == "search":
            return self.search(args)
        if op == "full1":
            return self.full_round1(args)
        if op == "full2":
            return self.full_round2(args)
        if op == "full_lists":
            return self.full_lists(args)
        if op == "fetch":
            return self.fetch(args["slots"])
        if op == "upsert":
            return self.upsert(records.from_ipc(args["ipc"]), args["seq"])
        if op == "delete":
            return self.delete(args["doc_ids"], args["seq"])
        if op == "stage":
            return self.stage(args["txn"], records.from_ipc(args["ipc"]))
        if op == "prepare":
            return self.prepare(args["txn"], args["seq"], args["kind"], args.get("doc_ids"))
        if op == "apply":
            return self.apply(args["txn"])
        if op == "abort":
            return self.abort(args["txn"])
        if op == "reuse":
            return self.reusable_vectors(args["doc_ids"])
        if op == "memory_upsert":
            return self.memory_upsert(args["record"], args["max_turns"], args.get("max_total", 0),
                                      args.get("ttl_s", 0.0))
        if op == "memory_search":
            return self.memory_search(args)
        if op == "memory_clear":
            return self.memory_clear(args["session_id"])
        if op == "stats":
            return self.stats(bool(args.get("lexical")))
        if op == "snapshot":
            return self.snapshot()
        if op == "ping":
            return {"shard": self.shard_id, "pid": os.getpid()}
        raise ValueError(f"unknown shard op {op!r}")


def run(shard_id: int, conn, dim: int, data_dir: str | None, stem: bool, committed: set[str] | None = None) -> None:
    """Process entry point: load the snapshot, report READY with stats, serve requests until
    ``shutdown`` (which snapshots first) or the pipe closes."""
    # the frontend decides when shards stop (a group SIGINT/SIGTERM must not kill them first)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import faiss

        faiss.omp_set_num_threads(1)
    except Exception:  # pragma: no cover
        pass
    try:
        state = ShardState(shard_id, dim, Path(data_dir) if data_dir else None, stem=stem)
        replayed = state.load(committed)
        conn.send((0, True, {"ready": True, "replayed": replayed, **state.stats(lexical=True)}))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, then exit
        conn.send((0, False, f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            req_id, op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "shutdown":
            try:
                res = state.snapshot() if args.get("snapshot", True) else {}
                conn.send((req_id, True, res))
            except Exception as exc:  # noqa: BLE001
                conn.send((req_id, False, f"{type(exc).__name__}: {exc}"))
            break
        try:
            res = state.handle(op, args)
            conn.send((req_id, True, res))
        except Exception as exc:  # noqa: BLE001 - never let a bad request kill the shard
            traceback.print_exc()  # to the service log; the client gets the message only
            conn.send((req_id, False, f"{type(exc).__name__}: {exc}"))
