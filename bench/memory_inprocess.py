"""In-process evaluation of conversational memory on the sets of :mod:`bench.memory_sets`.

The real MiniLM encoder, an in-process shard pool (2 shards), the Retriever, the Memory
operator and the QueryEngine (no generator: Retrieve-style requests, hybrid, top_k 5), one
request at a time. Per conversation: memory ON (a fresh session: every turn in order, the last
one scored), memory OFF (the last question alone), oracle (subject written out, no session),
naive (previous question + last question, no session). Top-1 against the target window's chunk.

    PYTHONPATH=server:client:. python bench/memory_inprocess.py --wikitext ../shared/data/wikitext-2/valid.txt
    ... --scifact ../shared/data/scifact/corpus.jsonl --limit-docs 1500   (a second corpus)

Prints one JSON object (all rows, per kind, latency p50 with/without session and the ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.memory_conv import server_windows  # noqa: E402
from bench.memory_sets import KINDS, build, headline, wikitext_articles, windows  # noqa: E402
from oprag_server import records  # noqa: E402
from oprag_server.config import BatchConfig, BM25Config, GenerateConfig, MemoryConfig, RetrievalConfig  # noqa: E402
from oprag_server.domain import RetrieveSpec  # noqa: E402
from oprag_server.engine.query import QueryEngine, QueryJob  # noqa: E402
from oprag_server.engine.rwlock import RWLock  # noqa: E402
from oprag_server.index.analyzer import Analyzer  # noqa: E402
from oprag_server.index.bm25 import CorpusStats  # noqa: E402
from oprag_server.models.encoder import TransformersEncoder  # noqa: E402
from oprag_server.operators.memory import Memory  # noqa: E402
from oprag_server.operators.retrieve import Retriever  # noqa: E402
from oprag_server.service.metrics import Metrics  # noqa: E402
from oprag_server.shards.inprocess import in_process_pool  # noqa: E402
from oprag_server.shards.pool import route  # noqa: E402
from oprag_server.shards.state import ShardState  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


class Embedder:
    def __init__(self, enc):
        self.enc = enc

    async def embed_queries(self, texts):
        return self.enc.encode(texts, truncate=True)


def scifact_articles(path: Path, limit: int) -> list[tuple[str, str, str]]:
    """SciFact abstracts as articles: paragraphs are its sentences in groups of three."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines()[:limit]:
        d = json.loads(line)
        out.append((f"scifact:{d['_id']}", d["title"].rstrip("."), d["text"]))
    return out


def index(articles, enc, n_shards=2, cache: Path | None = None, split=windows):
    rows = []
    for doc_id, title, body in articles:
        for i, w in enumerate(split(body)):
            rows.append((doc_id, title, i, w))
    key = hashlib.sha256("\x00".join(f"{d}|{i}|{w}" for d, _, i, w in rows).encode()).hexdigest()[:16]
    f = cache / f"vecs-{key}.npy" if cache else None
    if f is not None and f.exists():
        vecs = np.load(f)
    else:
        vecs = enc.encode([(f"{t}\n{w}" if t else w) for _, t, _, w in rows], truncate=True)
        if f is not None:
            f.parent.mkdir(parents=True, exist_ok=True)
            np.save(f, vecs)
    shards = [ShardState(i, enc.dim, None) for i in range(n_shards)]
    stats = CorpusStats()
    per: dict[int, list[int]] = {}
    for k, (d, *_rest) in enumerate(rows):
        per.setdefault(route(d, n_shards), []).append(k)
    for s, ks in per.items():
        batch = records.make_chunk_batch(
            chunk_ids=[f"{rows[k][0]}#{rows[k][2]}" for k in ks], doc_ids=[rows[k][0] for k in ks],
            titles=[rows[k][1] for k in ks], texts=[rows[k][3] for k in ks], metadata=[{} for _ in ks],
            ordinals=[rows[k][2] for k in ks], generations=[1 for _ in ks],
            content_hashes=[hashlib.sha256(rows[k][3].encode()).hexdigest() for k in ks], vectors=vecs[ks])
        out = shards[s].store.upsert(pa.Table.from_batches([batch]), 1)
        stats.apply_delta(*out.delta)
    return shards, stats, len(rows)


async def evaluate(convs, shards, stats, enc, top_k=5, details=None):
    pool = in_process_pool(shards)
    retriever = Retriever(pool, stats, Analyzer(), BM25Config(), RetrievalConfig())
    memory = Memory(in_process_pool(shards), MemoryConfig())
    metrics = Metrics()
    eng = QueryEngine(generator=None, retriever=retriever, memory=memory, lock=RWLock(),
                      batch=BatchConfig(max_batch=8, max_wait_ms=0.0), gen_cfg=GenerateConfig(),
                      embedder=Embedder(enc), metrics=metrics)
    eng.start()
    spec = RetrieveSpec(mode="hybrid", top_k=top_k)
    res = {k: {"with": [], "without": [], "oracle": [], "naive": []} for k in KINDS}
    chain2 = []
    lat_with, lat_without, used = [], [], 0
    nonce = time.time_ns()

    async def ask(q, sid=""):
        t = time.perf_counter()
        j = await eng.submit(QueryJob(question=q, spec=spec, session_id=sid, use_memory=bool(sid), generate=False))
        return j, time.perf_counter() - t

    for n, c in enumerate(convs):
        sid = f"s{nonce}-{n}"
        trace = []
        for t, q in enumerate(c.turns):
            j, dt = await ask(q, sid)
            trace.append({"q": q, "top": [h.chunk_id for h in j.hits[:3]], "used": bool(j.memory and j.memory.used),
                          "ctx": j.memory.context_text if j.memory else ""})
            if t == len(c.turns) - 1 or t > 0:
                lat_with.append(dt)
            if c.kind == "chain" and t == 1:
                chain2.append(bool(j.hits) and j.hits[0].chunk_id == c.targets[1])
        used += bool(j.memory and j.memory.used)
        res[c.kind]["with"].append(bool(j.hits) and j.hits[0].chunk_id == c.target)
        for row, q in (("without", c.turns[-1]), ("oracle", c.oracle), ("naive", c.naive)):
            j, dt = await ask(q)
            if row == "without":
                lat_without.append(dt)
            res[c.kind][row].append(bool(j.hits) and j.hits[0].chunk_id == c.target)
            trace.append({"row": row, "q": q, "top": [h.chunk_id for h in j.hits[:3]]})
        if details is not None:
            details.append({"kind": c.kind, "targets": c.targets, "target": c.target, "trace": trace})
    await eng.stop()
    return headline(res, chain2) | {
        "session_latency_ratio_p50": round(statistics.median(lat_with) / statistics.median(lat_without), 3),
        "retrieve_p50_ms_with": round(statistics.median(lat_with) * 1000, 2),
        "retrieve_p50_ms_without": round(statistics.median(lat_without) * 1000, 2),
        "memory_used_fraction": round(used / len(convs), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wikitext", type=Path)
    ap.add_argument("--scifact", type=Path)
    ap.add_argument("--limit-docs", type=int, default=1500)
    ap.add_argument("--family", type=int, default=0)
    ap.add_argument("--max-convs", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to run (default all)")
    ap.add_argument("--server-windows", action="store_true",
                    help="cut windows with the server's chunker (256 MiniLM tokens) instead of 900 characters")
    ap.add_argument("--details", type=Path, help="write one JSON line per conversation (every request's top 3)")
    a = ap.parse_args()
    arts = wikitext_articles(a.wikitext) if a.wikitext else scifact_articles(a.scifact, a.limit_docs)
    split = server_windows if a.server_windows else windows
    convs = [c for c in build(arts, a.family, split=split) if c.kind in a.kinds.split(",")]
    if a.max_convs:
        convs = convs[: a.max_convs]
    enc = TransformersEncoder("minilm", device="cpu")
    shards, stats, n = index(arts, enc, cache=OUT / "memcache", split=split)
    print(f"{len(arts)} articles, {n} chunks, {len(convs)} conversations", file=sys.stderr)
    details = [] if a.details else None
    out = asyncio.run(evaluate(convs, shards, stats, enc, details=details))
    if a.details:
        a.details.write_text("".join(json.dumps(d) + "\n" for d in details), encoding="utf-8")
    out["conversations"] = len(convs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
