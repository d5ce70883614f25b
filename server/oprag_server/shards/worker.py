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
from ..operators.fusion import fuse_minmax, top_k_order

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
        self._full_cache: dict[str, tuple] = {}
        self.dirty = False

    # ------------------------------------------------------------------ writes
    def _remove_doc(self, doc_id: str) -> int:
        slots = self.doc_slots.pop(doc_id, [])
        self.doc_generation.pop(doc_id, None)
        if slots:
            self.dense.remove(np.asarray(slots, dtype=np.int64))
            for s in slots:
                self.postings.remove(s)
                self.chunks.pop(s, None)
        return len(slots)

    def upsert(self, table: pa.Table, seq: int) -> dict:
        """Apply a bulk batch of chunks (schema :func:`records.chunk_schema`).

        A document whose stored generation differs from the batch's generation is replaced:
        its old chunks leave the dense index and the postings first.
        :returns: ``{"added", "removed", "replaced_docs", "delta"}``.
        """
        cols = {name: table.column(name).to_pylist() for name in table.column_names if name != "vector"}
        vecs = records.vectors_of(table)
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
            self.doc_slots[doc_id].append(slot)
            self.postings.add(slot, self._index_tokens(rec))
            new_slots.append(slot)
        if new_slots:
            self.dense.add(np.asarray(new_slots, dtype=np.int64), vecs)
        self.applied_seq = max(self.applied_seq, int(seq))
        self.dirty = True
        self._full_cache.clear()
        return {"added": len(new_slots), "removed": removed, "replaced_docs": replaced, "delta": self.postings.drain_delta()}

    def _index_tokens(self, rec: ChunkRecord) -> list[str]:
        # The title is part of what BM25 sees for every chunk of the document.
        return self.analyzer.tokens(f"{rec.title}\n{rec.text}" if rec.title else rec.text)

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

    def search(self, args: dict) -> list[dict]:
        """Batched candidate generation for B queries.

        ``args``: ``q`` float32[B, D]; ``terms`` list of B token lists; ``idf`` list of B
        float64[T] arrays (corpus-global, computed by the frontend); ``avgdl``, ``k1``, ``b``;
        ``mode`` in {"hybrid", "dense", "lexical"}; ``n`` local candidates per query.
        :returns: per query ``{"slots", "chunk_ids", "dense", "lexical"}`` with float64 scores.
        """
        q = records.as_query_matrix(args["q"], self.dim)
        mode, n = args["mode"], int(args["n"])
        k1, b, avgdl = args["k1"], args["b"], args["avgdl"]
        out = []
        if mode in ("hybrid", "dense"):
            ids, scores = self.dense.search(q, n)
            for i in range(q.shape[0]):
                slots = ids[i]
                lex = self.postings.score(slots, args["terms"][i], args["idf"][i], avgdl, k1, b)
                out.append(
                    {"slots": slots, "chunk_ids": self._ids(slots), "dense": scores[i].astype(np.float64), "lexical": lex}
                )
        elif mode == "lexical":
            for i in range(q.shape[0]):
                slots, lex = self.postings.score_all(args["terms"][i], args["idf"][i], avgdl, k1, b)
                cids = self._ids(slots)
                order = top_k_order(lex, cids, n)
                slots = slots[order]
                dense = self.dense.score_slots(q[i], slots).astype(np.float64)
                out.append({"slots": slots, "chunk_ids": [cids[j] for j in order], "dense": dense, "lexical": lex[order]})
        else:
            raise ValueError(f"unknown search mode {mode!r}")
        return out

    def full_round1(self, args: dict) -> list[dict]:
        """Exact hybrid, round 1: score every chunk (dense) and every chunk containing a query
        term (BM25); cache them under ``token``; return local score ranges.

        :returns: per query ``{"n", "dmin", "dmax", "lmin", "lmax"}`` (``n`` live chunks).
        """
        q = records.as_query_matrix(args["q"], self.dim)
        k1, b, avgdl = args["k1"], args["b"], args["avgdl"]
        dense_all = self.dense.score_all(q)
        row_slots = self.dense.slots
        out, cache = [], []
        n = len(row_slots)
        for i in range(q.shape[0]):
            d = dense_all[i].astype(np.float64)
            lslots, lex = self.postings.score_all(args["terms"][i], args["idf"][i], avgdl, k1, b)
            if n == 0:
                out.append({"n": 0, "dmin": 0.0, "dmax": 0.0, "lmin": 0.0, "lmax": 0.0})
                cache.append((d, lslots, lex))
                continue
            lmin = float(lex.min()) if lex.size else 0.0
            lmax = float(lex.max()) if lex.size else 0.0
            if lex.size < n:  # some chunk contains no query term: its BM25 score is exactly 0
                lmin, lmax = min(lmin, 0.0), max(lmax, 0.0)
            out.append({"n": n, "dmin": float(d.min()), "dmax": float(d.max()), "lmin": lmin, "lmax": lmax})
            cache.append((d, lslots, lex))
        if len(self._full_cache) > 64:
            self._full_cache.clear()
        self._full_cache[args["token"]] = (row_slots.copy(), cache)
        return out

    def full_round2(self, args: dict) -> list[dict]:
        """Exact hybrid, round 2: fuse with the corpus-global ranges and return the local top-k
        by (fused desc, chunk id asc)."""
        row_slots, cache = self._full_cache.pop(args["token"])
        out = []
        pos = {int(s): r for r, s in enumerate(row_slots.tolist())}
        cids_all = self._ids(row_slots)
        for i, (d, lslots, lex) in enumerate(cache):
            lexical = np.zeros(len(row_slots), dtype=np.float64)
            if lslots.size:
                lexical[[pos[int(s)] for s in lslots]] = lex
            fused = fuse_minmax(
                d,
                lexical,
                dense_range=tuple(args["dense_range"][i]),
                lexical_range=tuple(args["lexical_range"][i]),
                dense_weight=args["dense_weight"],
                lexical_weight=args["lexical_weight"],
            )
            order = top_k_order(fused, cids_all, int(args["k"]))
            out.append(
                {
                    "slots": row_slots[order],
                    "chunk_ids": [cids_all[j] for j in order],
                    "dense": d[order],
                    "lexical": lexical[order],
                    "fused": fused[order],
                }
            )
        return out

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
    def memory_upsert(self, rec: dict, max_turns: int) -> dict:
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
        self.dirty = True
        return {"records": len(recs)}

    def memory_search(self, args: dict) -> list[list[dict]]:
        """Per query: the session's most recent ``k`` turns (newest first) with their cosine
        similarity to the query. Only records of ``session_ids[i]`` are ever visible to query i."""
        q = records.as_query_matrix(args["q"], self.dim)
        ttl = float(args.get("ttl_s", 0) or 0)
        now = time.time()
        out = []
        for i, sid in enumerate(args["session_ids"]):
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
                        "similarity": float(r.vector @ q[i]),
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
    def stats(self) -> dict:
        n, total_len, df = self.postings.full_stats()
        return {
            "shard": self.shard_id,
            "documents": len(self.doc_slots),
            "chunks": len(self.chunks),
            "memory_records": sum(len(v) for v in self.memory.values()),
            "applied_seq": self.applied_seq,
            "lexical": (n, total_len, df),
        }

    def _dir(self) -> Path:
        assert self.data_dir is not None
        d = self.data_dir / f"shard-{self.shard_id}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def snapshot(self) -> dict:
        """Write chunks (with vectors) and memory to ``data_dir/shard-N`` atomically."""
        if self.data_dir is None:
            return {"written": False}
        d = self._dir()
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
        _fsync_write(d / "chunks.arrow", records.to_ipc(batch))
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
        _fsync_write(d / "memory.json", json.dumps(mem).encode())
        meta = {"format_version": FORMAT_VERSION, "applied_seq": self.applied_seq, "dim": self.dim, "next_slot": self.next_slot}
        _fsync_write(d / "meta.json", json.dumps(meta).encode())
        self.dirty = False
        return {"written": True, "chunks": len(recs)}

    def load(self) -> None:
        """Load a snapshot written by :meth:`snapshot` if one exists.

        :raises RuntimeError: the snapshot's format version or vector width differ.
        """
        if self.data_dir is None:
            return
        d = self.data_dir / f"shard-{self.shard_id}"
        if not (d / "meta.json").exists():
            return
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise RuntimeError(f"{d}: snapshot format {meta.get('format_version')} != {FORMAT_VERSION}")
        if meta.get("dim") != self.dim:
            raise RuntimeError(f"{d}: vectors have width {meta.get('dim')}, the embedder produces {self.dim}")
        table = records.from_ipc((d / "chunks.arrow").read_bytes())
        if table.num_rows:
            self.upsert(table, 0)
            self.postings.drain_delta()
        self.applied_seq = int(meta.get("applied_seq", 0))
        self.next_slot = max(self.next_slot, int(meta.get("next_slot", 0)))
        if (d / "memory.json").exists():
            for m in json.loads((d / "memory.json").read_text()):
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
        self.dirty = False

    # ------------------------------------------------------------------ dispatch
    def handle(self, op: str, args: dict):
        if op == "search":
            return self.search(args)
        if op == "full1":
            return self.full_round1(args)
        if op == "full2":
            return self.full_round2(args)
        if op == "fetch":
            return self.fetch(args["slots"])
        if op == "upsert":
            return self.upsert(records.from_ipc(args["ipc"]), args["seq"])
        if op == "delete":
            return self.delete(args["doc_ids"], args["seq"])
        if op == "memory_upsert":
            return self.memory_upsert(args["record"], args["max_turns"])
        if op == "memory_search":
            return self.memory_search(args)
        if op == "memory_clear":
            return self.memory_clear(args["session_id"])
        if op == "stats":
            return self.stats()
        if op == "snapshot":
            return self.snapshot()
        if op == "ping":
            return {"shard": self.shard_id, "pid": os.getpid()}
        raise ValueError(f"unknown shard op {op!r}")


def run(shard_id: int, conn, dim: int, data_dir: str | None, stem: bool) -> None:
    """Process entry point: load the snapshot, report READY with stats, serve requests until
    ``shutdown`` (which snapshots first) or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when shards stop
    try:
        import faiss

        faiss.omp_set_num_threads(1)
    except Exception:  # pragma: no cover
        pass
    try:
        state = ShardState(shard_id, dim, Path(data_dir) if data_dir else None, stem=stem)
        state.load()
        conn.send((0, True, {"ready": True, **state.stats()}))
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
            conn.send((req_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
