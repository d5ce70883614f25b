"""``oprag eval beir``: BEIR queries and qrels against the service, by document (README:
"oprag eval beir"; the metrics are :mod:`.evaluate`'s)."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from .cli_util import _client, _fail, _rpc_error

#: below this share of the relevant documents retrieved by some query, ``oprag eval`` warns. A
#: judged document the service lacks is never retrieved; one it holds usually is, by its own query
#: or another: all 565 relevant documents of SciFact's train qrels with the corpus ingested (809
#: queries, every mode), but 7 or 8 of 9 with --limit 10 (Recall@100 0.8-0.9), so 90% would warn
#: about a complete corpus
FOUND_WARN = 0.5


def _read(flag: str, path: Path, load, want: str):
    """``load(path)``, or the message (``str``) naming ``flag`` and what to pass."""
    if path.is_dir():  # (was "cannot read queries/qrels: [Errno 21] Is a directory")
        return f"{flag} {path} is a folder: give {want}"
    try:
        return load(path)
    except OSError as exc:
        return f"cannot read {flag} {path}: {exc.strerror or exc}"
    except ValueError as exc:  # the loaders' messages name the file and line
        return f"{flag}: {exc}"


def judged_found(qrels: dict[str, dict[str, int]], qids: list[str], rankings: list[list[str]]) -> tuple[int, int]:
    """``(found, total)``: the relevant documents (judgement > 0) of the queries ``qids`` and how
    many of them some query retrieved (any of ``rankings``). A share far below the usual
    Recall@100 means the service lacks most of them (a corpus not or partly ingested)."""
    relevant = {d for q in qids for d, r in qrels[q].items() if r > 0}
    seen = {d for docs in rankings for d in docs}
    return len(relevant & seen), len(relevant)


def cmd_eval(a) -> int:
    """``oprag eval beir``: prints one JSON object (metrics: ``ndcg@10``, ``recall@<--top-k>``
    (``recall@100`` by default), ``mrr@10``; ``n``, latency percentiles, ``judged_docs`` and
    ``judged_docs_retrieved``, ``warning`` when few of those were retrieved); exit 1 on a failed
    call or unreadable input."""
    from .evaluate import doc_ranking, load_qrels, load_queries, metrics, percentile

    queries = _read("--queries", a.queries, load_queries, "the BEIR queries file (queries.jsonl)")
    if isinstance(queries, str):
        return _fail(queries)
    qrels = _read("--qrels", a.qrels, load_qrels, "a BEIR qrels file (tab-separated, e.g. qrels/test.tsv)")
    if isinstance(qrels, str):
        return _fail(qrels)
    judged = [qid for qid in qrels if qid in queries and any(r > 0 for r in qrels[qid].values())]
    if a.limit:
        judged = judged[: a.limit]
    if not judged:
        return _fail("no judged query of the qrels is in the queries file")
    top_k = a.top_k

    def one(c, qid):  # document-level retrieval: the top documents by their best chunk (MaxP)
        t = time.perf_counter()
        r = c.retrieve(queries[qid], top_k=top_k, mode=a.mode, candidates=a.candidates, group_by_document=True)
        return qid, [d.doc_id for d in r.documents], (time.perf_counter() - t) * 1000

    try:
        with _client(a) as c:
            ex = ThreadPoolExecutor(max(1, a.concurrency))
            try:
                results = list(ex.map(lambda q: one(c, q), judged))
            finally:  # the queued queries dropped, and the channel closed before the threads are joined: that
                # cancels the calls in flight (Ctrl-C waited for them, with no end on a server that did not answer)
                ex.shutdown(wait=False, cancel_futures=True)
    except grpc.RpcError as exc:
        return _rpc_error(exc, a)
    per = [metrics(doc_ranking(docs), qrels[qid], top_k) for qid, docs, _ in results]
    lat = [ms for _, _, ms in results]
    n = len(results)
    found, total = judged_found(qrels, judged, [docs for _, docs, _ in results])
    out = {
        **{m: round(sum(p[m] for p in per) / n, 5) for m in per[0]},  # ndcg@10, recall@<top-k>, mrr@10
        "n": n,
        "mode": a.mode,
        "p50_ms": round(percentile(lat, 50), 3),
        "p95_ms": round(percentile(lat, 95), 3),
        "judged_docs": total,
        "judged_docs_retrieved": found,
    }
    if found < FOUND_WARN * total:
        out["warning"] = (f"only {found} of the {total} relevant documents of the qrels ({100 * found / total:.0f}%) "
                          f"were retrieved by any of the {n} queries (top {top_k} each): the service probably lacks "
                          "most of them (they count as misses); ingest the corpus the qrels judge (oprag ingest "
                          "--format beir corpus.jsonl) and compare `oprag stats` with its size")
        print(f"oprag: warning: {out['warning']}", file=sys.stderr)
    print(json.dumps(out))
    return 0
