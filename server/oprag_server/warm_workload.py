"""A small end-to-end workload that makes numba compile (or load from its cache) every kernel signature a served shard
reaches, run by ``python -m oprag_server.precompile`` after the kernel modules' own ``warm()`` (session 41, trial41:
on a fresh install a shard still compiled ~20 specialisations on first use, each holding its request loop 1.2-7.1 s:
the first staging of a batch, of non-ASCII text, the first search, the first search after a snapshot (read-only
memory-mapped arrays), the first filtered and lexical searches).

Rather than list signatures by hand, it runs the paths themselves, in this process, for each dense index type:
staging and applying chunks of ASCII, Latin-1, CJK and emoji text (the four widths of a Python string) with metadata,
every query mode with and without filters and grouping, a replacement and a delete, then a snapshot, a load of it in a
new shard (the arrays it maps are read-only), and the same queries again. In-process shards and the frontend's
:class:`~.operators.retrieve.Retriever` (the code the served path runs; no gRPC, no model).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

#: texts in the four widths of a Python string (ASCII, Latin-1, BMP, astral) and with digits and punctuation
TEXTS = (
    "the quick brown fox jumps over the lazy dog 42 times.",
    "café crème brûlée à la française, naïve façade",
    "東京都の人口は約一千四百万人です 検索 拡張 生成",
    "rocket 🚀 launch 🌕 moon 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 text",
    "Protein folding; alpha-helix beta-sheet (n=12) p<0.05",
)
DIM = 8


def _batch(ids: list[str], gen: int, rng: np.random.Generator) -> pa.Table:
    from . import records  # noqa: PLC0415

    n = len(ids)
    texts = [TEXTS[i % len(TEXTS)] + f" {d} v{gen}" for i, d in enumerate(ids)]
    v = rng.normal(size=(n, DIM)).astype(np.float32)
    return pa.Table.from_batches([records.make_chunk_batch(
        chunk_ids=[f"{d}#0" for d in ids], doc_ids=ids, titles=[f"title {d}" for d in ids], texts=texts,
        metadata=[{"lang": ["en", "fr", "ja", "emoji", "en"][i % 5], "year": 2000 + i % 7, "ok": bool(i % 2)}
                  for i in range(n)],
        ordinals=[0] * n, generations=[gen] * n, content_hashes=[hashlib.sha256(t.encode()).hexdigest() for t in texts],
        vectors=v / np.linalg.norm(v, axis=1, keepdims=True))])


async def _queries(retriever, rng: np.random.Generator) -> None:
    from .domain import RetrieveSpec  # noqa: PLC0415

    specs = [RetrieveSpec(mode=m, top_k=5, candidates=16) for m in ("hybrid", "dense", "lexical", "full_hybrid")]
    specs += [RetrieveSpec(mode="hybrid", top_k=5, candidates=16, filters=(("lang", ("fr", "ja")),)),
              RetrieveSpec(mode="full_hybrid", top_k=5, filters=(("year", (2001,)), ("ok", (True,)))),
              RetrieveSpec(mode="lexical", top_k=5, filters=(("lang", ("en",)),)),
              RetrieveSpec(mode="hybrid", top_k=5, candidates=16, fusion="rrf"),
              RetrieveSpec(mode="hybrid", top_k=3, candidates=16, group_by_document=True, chunks_per_document=2)]
    q = rng.normal(size=(len(specs), DIM)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    texts = [TEXTS[i % len(TEXTS)].split(" ", 3)[-1] for i in range(len(specs))]
    await retriever.retrieve(q, texts, specs)


def _shards(root: Path, kind: str) -> list:
    from .config import DenseConfig  # noqa: PLC0415
    from .shards.state import ShardState  # noqa: PLC0415

    dense = DenseConfig(kind=kind, train_min=64, hnsw_m=8, ef_construction=16, ann_tail=64, ann_check=128)
    shards = [ShardState(i, DIM, root, dense=dense) for i in range(2)]
    for sh in shards:
        sh.load(set())
    return shards


async def _write(cp, ids: list[str], gen: int, rng: np.random.Generator) -> None:
    """One committed write of the documents ``ids``, as an ingest's: each shard stages its batch from Arrow IPC (the
    buffers a message's bytes give, read-only), then the two-phase commit prepares and applies it."""
    from . import records  # noqa: PLC0415
    from .shards.protocol import Op, StageRequest  # noqa: PLC0415
    from .shards.pool import route  # noqa: PLC0415

    txn, n = f"warm-{gen}-{ids[0]}", cp.pool.n
    for i in range(n):
        mine = [d for d in ids if route(d, n) == i]
        if mine:
            ipc = records.to_ipc(_batch(mine, gen, rng).to_batches()[0])
            await cp.pool.call(i, Op.STAGE, StageRequest(txn, ipc))
    await cp.commit(txn, "upsert")


async def _one_kind(base: Path, kind: str) -> None:
    from .config import BM25Config, RetrievalConfig  # noqa: PLC0415
    from .engine.commit import CommitProtocol  # noqa: PLC0415
    from .engine.rwlock import RWLock  # noqa: PLC0415
    from .index.analyzer import Analyzer  # noqa: PLC0415
    from .index.bm25 import CorpusStats  # noqa: PLC0415
    from .operators.retrieve import Retriever  # noqa: PLC0415
    from .shards.inprocess import in_process_pool  # noqa: PLC0415

    rng = np.random.default_rng(0)
    for loaded in (False, True):  # a fresh data dir, then the same one loaded from its snapshot (read-only maps)
        shards = _shards(base, kind)
        stats = CorpusStats.merge_full([sh.store.postings.full_stats() for sh in shards])
        for sh in shards:
            sh.search.warm()
        pool = in_process_pool(shards, copy=True)
        cp = CommitProtocol(pool, stats, RWLock())
        cp.seq = cp.applied_seq = max(sh.store.applied_seq for sh in shards)
        retriever = Retriever(pool, stats, Analyzer(), BM25Config(), RetrievalConfig())
        if not loaded:
            await _write(cp, [f"d{i}" for i in range(300)], 1, rng)
            for sh in shards:
                while sh.background_step():
                    pass
        await _queries(retriever, rng)
        await _write(cp, [f"d{i}" for i in range(0, 300, 3)], 2 + loaded, rng)  # a replacement
        await cp.delete([f"d{i}" for i in range(1, 300, 5 + loaded)])
        await _write(cp, [f"e{loaded}{i}" for i in range(40)], 1, rng)
        await _queries(retriever, rng)
        for sh in shards:
            sh.store.postings.merge()
            sh.snapshot()
        await _queries(retriever, rng)


def run(root: Path | None = None) -> None:
    """The workload (module docstring) under ``root`` (a temporary directory by default)."""
    with tempfile.TemporaryDirectory(dir=root) as tmp, contextlib.redirect_stderr(io.StringIO()):  # (its shards' log)
        for kind in ("flat", "hnsw", "ivf"):
            asyncio.run(_one_kind(Path(tmp) / kind, kind))
