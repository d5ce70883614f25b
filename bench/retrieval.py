"""Retrieval benchmark: OpRAG (gRPC) vs a plain exact reference vs LangChain, side by side.

One run:

1. Corpus: SciFact corpus + WikiText-2 valid articles (client loaders); >= 10,000 chunks at the
   server's default chunking (256 MiniLM tokens), checked.
2. A real server (``--generator none --shards 2``, data dir ``bench/out/retrieval-data``, free
   ports). If the data dir already holds the corpus (Stats shows the expected number of
   documents) ingest is skipped, else the corpus is ingested over the gRPC streaming API.
   The server is stopped (SIGTERM -> snapshot) and every ``shard-*/chunks.arrow`` is read: those
   vectors and texts are THE embeddings shared by every system. The server is restarted.
3. Queries: SciFact queries judged in ``qrels/train.tsv``; query vectors computed once here
   (TransformersEncoder("minilm")) and sent to OpRAG as ``query_vector``.
4. Systems: OpRAG ``Retrieve`` (full_hybrid / hybrid / dense / lexical, concurrency 1 and 16),
   the reference (rank_bm25.BM25Okapi + numpy ``V @ q`` + 0.5/0.5 min-max fusion + full sort),
   LangChain ``EnsembleRetriever([BM25Retriever, FAISS retriever], weights=[0.5, 0.5])``.
5. Agreement of OpRAG exact vs the reference, dense-first vs exact.
6. Quality (nDCG@10, Recall@100) on the train qrels from separate top-100 runs.

``--json`` prints one JSON object as the last stdout line; progress goes to stderr.
Latency percentiles are nearest-rank (``_common.percentile``).

From the repository root (the LangChain baseline needs ``pip install -e ".[bench]"``, or pass
``--no-langchain``):

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.retrieval --json            # full run
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.retrieval --quick --json    # 100 queries

``--quick`` only shortens the query list; the first run on an empty ``--data-dir`` still ingests
the whole corpus (about 10 minutes on 2 cores), later runs reuse it.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _internals
from ._common import (
    DEFAULT_SHARED,
    OUT,
    count_chunks,
    emit_json,
    ingest,
    load_corpus,
    load_queries_qrels,
    log,
    machine_info,
    percentile,
    read_snapshot,
    require,
    start_server,
    summarize,
)

MODES = ("full_hybrid", "hybrid", "dense", "lexical")
MIN_CHUNKS = 10_000
W_DENSE = W_LEX = 0.5


# ------------------------------------------------------------------------------ OpRAG

def oprag_requests(texts, qvecs, mode: str, top_k: int, candidates: int):
    from oprag_client.client import query_request

    return [query_request(t, top_k=top_k, mode=mode, candidates=candidates, query_vector=v.tolist())
            for t, v in zip(texts, qvecs)]


def run_oprag(stub, reqs, concurrency: int, timeout: float = 120.0) -> dict:
    """Send every request (prebuilt QueryRequest) to Retrieve; per-request wall latency.

    :returns: ``{"lat": [s], "wall": s, "hits": [[(chunk_id, doc_id, score, dense, lexical)]],
        "server_ms": [retrieve ms]}`` in request order.
    """
    n = len(reqs)
    lat = [0.0] * n
    hits: list = [None] * n
    srv = [0.0] * n

    def one(i: int) -> None:
        t = time.perf_counter()
        r = stub.Retrieve(reqs[i], timeout=timeout)
        lat[i] = time.perf_counter() - t
        hits[i] = [(h.chunk_id, h.doc_id, h.score, h.dense_score, h.lexical_score) for h in r.hits]
        srv[i] = r.timings_ms.get("retrieve", 0.0)  # the whole retrieve step, frontend fusion included

    t0 = time.perf_counter()
    if concurrency <= 1:
        for i in range(n):
            one(i)
    else:
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(one, range(n)))
    wall = time.perf_counter() - t0
    return {"lat": lat, "wall": wall, "hits": hits, "server_ms": srv}


# ------------------------------------------------------------------------------ reference

def _normalise(x: np.ndarray) -> np.ndarray:
    """Min-max over the list; a constant list normalises to 0 (as the server's fusion)."""
    lo, hi = float(x.min()), float(x.max())
    span = hi - lo
    if not span > 0.0:
        return np.zeros_like(x, dtype=np.float64)
    return (x.astype(np.float64) - lo) / span


class Reference:
    """The plain exact hybrid: rank_bm25.BM25Okapi over every chunk's analyzer tokens, dense
    inner product over every chunk, 0.5/0.5 weighted min-max fusion, full sort by (fused desc,
    chunk id asc)."""

    def __init__(self, chunk_ids: list[str], tokens: list[list[str]], vectors: np.ndarray, analyzer) -> None:
        from rank_bm25 import BM25Okapi

        self.ids = chunk_ids
        self.analyzer = analyzer
        self.V = np.ascontiguousarray(vectors, dtype=np.float32)
        t = time.perf_counter()
        self.bm25 = BM25Okapi(tokens)
        self.build_s = time.perf_counter() - t
        # position of each chunk id in ascending string order: the tie-break key
        rank = np.empty(len(chunk_ids), dtype=np.int64)
        rank[sorted(range(len(chunk_ids)), key=chunk_ids.__getitem__)] = np.arange(len(chunk_ids))
        self.id_rank = rank

    def query(self, text: str, qvec: np.ndarray, k: int):
        """:returns: (top-k row indices, fused float64[N], dense float32[N], bm25 float64[N])."""
        lex = np.asarray(self.bm25.get_scores(self.analyzer.tokens(text)), dtype=np.float64)
        dense = self.V @ qvec
        fused = W_DENSE * _normalise(dense) + W_LEX * _normalise(lex)
        order = np.lexsort((self.id_rank, -fused))  # full sort: fused desc, then chunk id asc
        return order[:k], fused, dense, lex


# ------------------------------------------------------------------------------ LangChain

def build_langchain(texts: list[str], metas: list[dict], vectors: np.ndarray, qmap: dict, analyzer, k: int):
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from langchain_classic.retrievers import EnsembleRetriever
    from langchain_community.retrievers import BM25Retriever
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings

    class Precomputed(Embeddings):
        """Returns the precomputed query vector for a query text (dict lookup); documents are
        never embedded (the store is built from the snapshot vectors)."""

        def embed_documents(self, texts):  # pragma: no cover - not used
            raise RuntimeError("documents come with precomputed vectors")

        def embed_query(self, text):
            return qmap[text]

    docs = [Document(page_content=t, metadata=m) for t, m in zip(texts, metas)]
    t = time.perf_counter()
    bm25 = BM25Retriever.from_documents(docs, preprocess_func=analyzer.tokens, k=k)
    t_bm25 = time.perf_counter() - t
    t = time.perf_counter()
    store = FAISS.from_embeddings(list(zip(texts, vectors.tolist())), Precomputed(), metadatas=metas,
                                  distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
    t_faiss = time.perf_counter() - t
    vs = store.as_retriever(search_kwargs={"k": k})
    # id_key: fuse by chunk id (the default, page_content, would merge chunks with equal text)
    ens = EnsembleRetriever(retrievers=[bm25, vs], weights=[0.5, 0.5], id_key="chunk_id")
    return ens, bm25, vs, {"bm25_build_s": round(t_bm25, 2), "faiss_build_s": round(t_faiss, 2)}


# ------------------------------------------------------------------------------ metrics

def quality(rankings: list[list[str]], qids: list[str], qrels: dict) -> dict:
    """Mean nDCG@10 / Recall@100 / MRR@10 of per-query chunk-doc-id lists (first occurrence
    of a document kept; every document counts as retrieved, WikiText distractors included)."""
    from oprag_client.evaluate import doc_ranking, mrr_at_k, ndcg_at_k, recall_at_k

    nd, rc, mr = [], [], []
    for qid, docs in zip(qids, rankings):
        ranked = doc_ranking(docs)
        nd.append(ndcg_at_k(ranked, qrels[qid], 10))
        rc.append(recall_at_k(ranked, qrels[qid], 100))
        mr.append(mrr_at_k(ranked, qrels[qid], 10))
    n = max(len(nd), 1)
    return {"ndcg10": round(sum(nd) / n, 4), "recall100": round(sum(rc) / n, 4), "mrr10": round(sum(mr) / n, 4)}


# ------------------------------------------------------------------------------ steps

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="folder holding data/scifact, data/wikitext-2")
    ap.add_argument("--data-dir", type=Path, default=OUT / "retrieval-data")
    ap.add_argument("--queries", type=int, default=0, help="first N judged train queries (0 = all 809)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 queries (unless --queries)")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated client concurrencies")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--eval-k", type=int, default=100, help="top-k of the quality runs")
    ap.add_argument("--candidates", type=int, default=128, help="dense-first N")
    ap.add_argument("--warmup", type=int, default=20, help="untimed requests per mode first")
    ap.add_argument("--per-stream", type=int, default=500, help="documents per Ingest stream")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    ap.add_argument("--no-langchain", action="store_true")
    ap.add_argument("--min-chunks", type=int, default=MIN_CHUNKS, help=argparse.SUPPRESS)  # tiny smoke tests only
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    a = ap.parse_args(argv)
    a.n_queries = a.queries or (100 if a.quick else 0)
    concs = sorted({int(x) for x in a.concurrency.split(",") if x.strip()})
    a.concs = concs if 1 in concs else [1, *concs]
    a.server_args = ["--generator", "none", "--shards", str(a.shards), *a.server_arg]
    a.server_log = OUT / "retrieval-server.log"
    return a


@dataclass
class Snapshot:
    """The shared embeddings and texts every system searches (read from the server's snapshot)."""

    ids: list[str]            # chunk ids, snapshot order
    doc_of: list[str]         # doc id per chunk
    idx_texts: list[str]      # "title\ntext" as the server indexes it
    tokens: list[list[str]]   # analyzer tokens of idx_texts
    vectors: np.ndarray       # float32[N, D]
    row_of: dict[str, int]    # chunk id -> row
    analyzer: object


@dataclass
class Queries:
    qids: list[str]
    texts: list[str]
    qvecs: np.ndarray         # float32[Q, D], MiniLM, computed once here
    qmap: dict[str, list[float]]
    qrels: dict


def load_docs(a) -> tuple[list, int]:
    """Step 1: the corpus and its chunk count at the server's default chunking."""
    docs = load_corpus(a.shared)
    n_sci = sum(1 for d in docs if not d.id.startswith("valid:"))
    expected_chunks = count_chunks(docs)
    log(f"corpus: {len(docs)} documents ({n_sci} SciFact, {len(docs) - n_sci} WikiText-2 valid), "
        f"{expected_chunks} chunks at the default 256 tokens")
    if expected_chunks < a.min_chunks:
        raise SystemExit(f"FAIL: corpus yields {expected_chunks} chunks < {a.min_chunks}")
    return docs, expected_chunks


def ingest_once(srv, a, docs: list) -> tuple[dict, int]:
    """Step 2a: ingest the corpus unless the data dir already holds it.

    :returns: (ingest summary, chunks the server reports)."""
    from oprag_client.client import OpRAGClient

    with OpRAGClient(srv.target) as c:
        st = c.stats()
        if st.documents == len(docs):
            log(f"data dir already holds {st.documents} documents / {st.chunks} chunks: ingest skipped")
            summary = {"skipped": True}
        else:
            log(f"data dir holds {st.documents} documents, expected {len(docs)}: ingesting")
            summary = ingest(c, docs, a.per_stream)
            log(f"ingest: {summary}")
        st = c.stats()
    if st.documents != len(docs):
        raise SystemExit(f"FAIL: server holds {st.documents} documents after ingest, expected {len(docs)}")
    return summary, int(st.chunks)


def snapshot(srv, a, server_chunks: int, expected_chunks: int) -> Snapshot:
    """Step 2b: stop the server (SIGTERM -> snapshot), read every shard's chunks and vectors,
    tokenise them with the server's analyzer, restart the server on the same data dir."""
    rc = srv.stop()
    log(f"server stopped (rc={rc}); reading the snapshot")
    snap = read_snapshot(a.data_dir)
    n_chunks = len(snap["chunk_id"])
    if n_chunks != server_chunks:
        raise SystemExit(f"FAIL: snapshot holds {n_chunks} chunks, server reported {server_chunks}")
    if n_chunks < a.min_chunks:
        raise SystemExit(f"FAIL: {n_chunks} chunks < {a.min_chunks}")
    log(f"snapshot: {n_chunks} chunks, vectors {snap['vectors'].shape} (chunker alone: {expected_chunks}) "
        f"from {snap['files']}")
    t = time.perf_counter()
    srv.start()
    log(f"server restarted on {srv.target} in {time.perf_counter() - t:.1f} s")
    analyzer = _internals.analyzer()
    idx_texts = [f"{ti}\n{tx}" if ti else tx for ti, tx in zip(snap["title"], snap["text"])]
    ids = snap["chunk_id"]
    return Snapshot(ids=ids, doc_of=snap["doc_id"], idx_texts=idx_texts,
                    tokens=[analyzer.tokens(s) for s in idx_texts], vectors=snap["vectors"],
                    row_of={cid: i for i, cid in enumerate(ids)}, analyzer=analyzer)


def load_queries(a) -> Queries:
    """Step 3: judged SciFact train queries, embedded once with the server's encoder."""
    judged, qrels = load_queries_qrels(a.shared, "train")
    qids = list(judged)[: a.n_queries or None]
    texts = [judged[q] for q in qids]
    enc = _internals.encoder("minilm", device="cpu")
    t = time.perf_counter()
    qvecs = enc.encode(texts, truncate=True)
    log(f"{len(qids)} queries (of {len(judged)} judged train queries) embedded in {time.perf_counter() - t:.1f} s")
    return Queries(qids, texts, qvecs, {tx: v.tolist() for tx, v in zip(texts, qvecs)}, qrels)


def measure_oprag(srv, a, q: Queries) -> tuple[dict, dict]:
    """Step 4a: warm-up, timed runs per mode and concurrency (top_k), then untimed top-eval_k
    quality runs. :returns: (``{mode: {conc: run_oprag result}}``, ``{mode: run}``)."""
    from oprag_client.client import OpRAGClient

    oprag: dict = {}
    oprag_eval: dict = {}
    with OpRAGClient(srv.target) as c:
        c.wait_ready(60)
        stub = c.stub
        for mode in MODES:
            reqs = oprag_requests(q.texts, q.qvecs, mode, a.top_k, a.candidates)
            run_oprag(stub, reqs[: a.warmup], 1)
            oprag[mode] = {}
            for conc in a.concs:
                r = run_oprag(stub, reqs, conc)
                oprag[mode][conc] = r
                s = summarize(r["lat"], r["wall"])
                log(f"oprag {mode:11s} c={conc:<3d} p50 {s['p50_ms']:8.2f} ms  p95 {s['p95_ms']:8.2f} ms  "
                    f"{s['qps']:8.1f} q/s  server retrieve p50 {percentile(r['server_ms'], 50):.2f} ms")
        for mode in MODES:
            reqs = oprag_requests(q.texts, q.qvecs, mode, a.eval_k, a.candidates)
            oprag_eval[mode] = run_oprag(stub, reqs, max(a.concs))
            log(f"oprag {mode:11s} top-{a.eval_k} quality run done")
    return oprag, oprag_eval


def measure_reference(a, snap: Snapshot, q: Queries, exact_hits: list) -> dict:
    """Step 4b: the reference, timed query by query, and (untimed) its agreement with OpRAG's
    exact mode: same top-k ids in the same order with fused scores within 1e-6."""
    ref = Reference(snap.ids, snap.tokens, snap.vectors, snap.analyzer)
    log(f"reference BM25Okapi built in {ref.build_s:.1f} s")
    for i in range(min(a.warmup, len(q.texts))):
        ref.query(q.texts[i], q.qvecs[i], a.eval_k)
    ids, row_of = snap.ids, snap.row_of
    ref_lat, ref_top = [], []
    n_ident = 0
    max_fused_diff = max_dense_diff = max_lex_diff = 0.0
    mismatches = []
    for i, (tx, qv) in enumerate(zip(q.texts, q.qvecs)):
        t = time.perf_counter()
        top, fused, dense, lex = ref.query(tx, qv, a.eval_k)
        ref_lat.append(time.perf_counter() - t)
        ref_top.append(top)
        ref10 = [ids[j] for j in top[: a.top_k]]
        got = exact_hits[i]
        got10 = [h[0] for h in got]
        fd = max((abs(h[2] - fused[row_of[h[0]]]) for h in got), default=0.0)
        dd = max((abs(h[3] - float(dense[row_of[h[0]]])) for h in got), default=0.0)
        ld = max((abs(h[4] - lex[row_of[h[0]]]) for h in got), default=0.0)
        max_fused_diff = max(max_fused_diff, fd)
        max_dense_diff = max(max_dense_diff, dd)
        max_lex_diff = max(max_lex_diff, ld)
        # same ids in the same order; then fd compares position by position
        same = got10 == ref10 and fd <= 1e-6
        n_ident += same
        if not same and len(mismatches) < 8:
            mismatches.append({
                "qid": q.qids[i], "query": tx,
                "oprag": [[h[0], round(h[2], 9)] for h in got],
                "reference": [[ids[j], round(float(fused[j]), 9)] for j in top[: a.top_k]],
                "max_abs_fused_diff_same_chunk": fd, "max_abs_dense_diff": dd, "max_abs_bm25_diff": ld,
            })
    ref_sum = summarize(ref_lat)
    log(f"reference          c=1   p50 {ref_sum['p50_ms']:8.2f} ms  p95 {ref_sum['p95_ms']:8.2f} ms  "
        f"{ref_sum['qps']:8.1f} q/s; identical top-{a.top_k} with OpRAG exact: {n_ident}/{len(q.qids)}")
    return {"summary": ref_sum, "top": ref_top, "build_s": ref.build_s, "n_ident": n_ident,
            "max_fused_diff": max_fused_diff, "max_dense_diff": max_dense_diff, "max_lex_diff": max_lex_diff,
            "mismatches": mismatches}


def measure_langchain(a, snap: Snapshot, q: Queries) -> dict:
    """Step 4c: LangChain's EnsembleRetriever, warm-up then timed top_k runs, then top-eval_k
    quality runs."""
    metas = [{"chunk_id": cid, "doc_id": d} for cid, d in zip(snap.ids, snap.doc_of)]
    ens, lc_bm25, lc_vs, lc_build = build_langchain(snap.idx_texts, metas, snap.vectors, q.qmap, snap.analyzer,
                                                    a.top_k)
    log(f"langchain built: {lc_build}")
    for i in range(min(a.warmup, len(q.texts))):
        ens.invoke(q.texts[i])
    lc_lat, lc_top10 = [], []
    for tx in q.texts:
        t = time.perf_counter()
        out = ens.invoke(tx)
        lc_lat.append(time.perf_counter() - t)
        lc_top10.append([d.metadata["chunk_id"] for d in out[: a.top_k]])
    lc_sum = summarize(lc_lat)
    log(f"langchain ensemble c=1   p50 {lc_sum['p50_ms']:8.2f} ms  p95 {lc_sum['p95_ms']:8.2f} ms  "
        f"{lc_sum['qps']:8.1f} q/s")
    lc_bm25.k = a.eval_k
    lc_vs.search_kwargs = {"k": a.eval_k}
    lc_eval = [[d.metadata["doc_id"] for d in ens.invoke(tx)[: a.eval_k]] for tx in q.texts]
    return {"summary": lc_sum, "build": lc_build, "top10": lc_top10, "eval": lc_eval}


def agreement(a, oprag: dict, snap: Snapshot, ref: dict, lc: dict | None) -> dict:
    """Step 5: dense-first vs exact (Recall@5, Jaccard@10), same top-k across concurrency,
    LangChain's top-k overlap with the reference."""
    def top_ids(mode, k, conc=1):
        return [[h[0] for h in hs[:k]] for hs in oprag[mode][conc]["hits"]]

    ex5, df5 = top_ids("full_hybrid", 5), top_ids("hybrid", 5)
    ex10, df10 = top_ids("full_hybrid", 10), top_ids("hybrid", 10)
    recall5 = float(np.mean([len(set(x) & set(y)) / 5 for x, y in zip(ex5, df5)]))
    jacc10 = float(np.mean([len(set(x) & set(y)) / max(len(set(x) | set(y)), 1) for x, y in zip(ex10, df10)]))
    conc_consistency = {}
    for mode in MODES:
        base = top_ids(mode, a.top_k, 1)
        for conc in a.concs:
            if conc != 1:
                other = top_ids(mode, a.top_k, conc)
                conc_consistency[f"{mode}@c{conc}"] = round(float(np.mean([x == y for x, y in zip(base, other)])), 4)
    lc_vs_ref = None
    if lc:
        ref10 = [[snap.ids[j] for j in top[: a.top_k]] for top in ref["top"]]
        lc_vs_ref = round(float(np.mean([len(set(x) & set(y)) / a.top_k for x, y in zip(lc["top10"], ref10)])), 4)
    return {"recall5": recall5, "jacc10": jacc10, "conc_consistency": conc_consistency, "lc_vs_ref": lc_vs_ref}


def quality_table(oprag_eval: dict, snap: Snapshot, q: Queries, ref: dict, lc: dict | None) -> dict:
    """Step 6: nDCG@10 / Recall@100 / MRR@10 per system: ``{"ndcg10"|"recall100"|"mrr10": {system: v}}``."""
    rows = {mode: quality([[h[1] for h in hs] for hs in oprag_eval[mode]["hits"]], q.qids, q.qrels) for mode in MODES}
    rows["reference"] = quality([[snap.doc_of[j] for j in top] for top in ref["top"]], q.qids, q.qrels)
    if lc:
        rows["langchain"] = quality(lc["eval"], q.qids, q.qrels)
    return {key: {system: r[key] for system, r in rows.items()} for key in ("ndcg10", "recall100", "mrr10")}


def report(a, oprag: dict, ref: dict, lc: dict | None, agree: dict, qual: dict, n_queries: int) -> dict:
    """Step 7: the result fields (latencies, speed-ups, agreement, quality)."""
    concs = a.concs
    s1 = {m: summarize(oprag[m][1]["lat"], oprag[m][1]["wall"]) for m in MODES}
    ref_sum, n_ident = ref["summary"], ref["n_ident"]
    return {
        "top_k": a.top_k,
        "candidates": a.candidates,
        "server_args": a.server_args,
        "speedup_exact_vs_reference": round(ref_sum["p50_ms"] / s1["full_hybrid"]["p50_ms"], 2),
        "speedup_densefirst_vs_reference": round(ref_sum["p50_ms"] / s1["hybrid"]["p50_ms"], 2),
        "recall5_densefirst_vs_exact": round(agree["recall5"], 4),
        "jaccard10_densefirst_vs_exact": round(agree["jacc10"], 4),
        "identical_topk_exact_vs_reference": round(n_ident / n_queries, 4),
        "identical_topk_exact_vs_reference_count": n_ident,
        "max_abs_fused_score_diff_exact_vs_reference": ref["max_fused_diff"],
        "max_abs_dense_score_diff_exact_vs_reference": ref["max_dense_diff"],
        "max_abs_bm25_score_diff_exact_vs_reference": ref["max_lex_diff"],
        "exact_vs_reference_mismatch_examples": ref["mismatches"],
        "same_topk_across_concurrency": agree["conc_consistency"],
        "p50_ms": {m: s1[m]["p50_ms"] for m in MODES},
        "p95_ms": {m: s1[m]["p95_ms"] for m in MODES},
        "p50_ms_by_concurrency": {m: {str(c): summarize(oprag[m][c]["lat"])["p50_ms"] for c in concs} for m in MODES},
        "p95_ms_by_concurrency": {m: {str(c): summarize(oprag[m][c]["lat"])["p95_ms"] for c in concs} for m in MODES},
        "qps": {m: {str(c): summarize(oprag[m][c]["lat"], oprag[m][c]["wall"])["qps"] for c in concs} for m in MODES},
        "server_internal_p50_ms": {m: round(percentile(oprag[m][1]["server_ms"], 50), 3) for m in MODES},
        "server_internal_p50_ms_by_concurrency": {
            m: {str(c): round(percentile(oprag[m][c]["server_ms"], 50), 3) for c in concs} for m in MODES},
        "reference_p50_ms": ref_sum["p50_ms"],
        "reference_p95_ms": ref_sum["p95_ms"],
        "reference_qps": ref_sum["qps"],
        "reference_bm25_build_s": round(ref["build_s"], 2),
        "langchain_p50_ms": lc["summary"]["p50_ms"] if lc else None,
        "langchain_p95_ms": lc["summary"]["p95_ms"] if lc else None,
        "langchain_qps": lc["summary"]["qps"] if lc else None,
        "langchain_build": lc["build"] if lc else None,
        "langchain_top10_overlap_with_reference": agree["lc_vs_ref"],
        **qual,
    }


# ------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    a = parse_args(argv)
    require("rank_bm25", what="the retrieval reference")
    if not a.no_langchain:
        require("langchain_classic", "langchain_community", "langchain_core", "faiss",
                what="the LangChain baseline (or pass --no-langchain)")
    t_start = time.perf_counter()
    result: dict = {"machine": machine_info()}
    docs, expected_chunks = load_docs(a)
    t = time.perf_counter()
    srv = start_server(a.data_dir, *a.server_args, log_path=a.server_log)
    log(f"server up on {srv.target} in {time.perf_counter() - t:.1f} s (log: {a.server_log})")
    try:
        result["ingest"], server_chunks = ingest_once(srv, a, docs)
        snap = snapshot(srv, a, server_chunks, expected_chunks)
        q = load_queries(a)
        oprag, oprag_eval = measure_oprag(srv, a, q)
        ref = measure_reference(a, snap, q, oprag["full_hybrid"][1]["hits"])
        lc = None if a.no_langchain else measure_langchain(a, snap, q)
    finally:
        rc = srv.stop()
        log(f"server stopped (rc={rc})")
    agree = agreement(a, oprag, snap, ref, lc)
    qual = quality_table(oprag_eval, snap, q, ref, lc)
    result.update({"chunks": len(snap.ids), "chunks_chunker_only": expected_chunks, "documents": len(docs),
                   "queries": len(q.qids)})
    result.update(report(a, oprag, ref, lc, agree, qual, len(q.qids)))
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if not a.json:
        import json

        log(json.dumps(result, indent=2, default=str))
    else:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
