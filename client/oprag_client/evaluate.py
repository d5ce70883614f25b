"""Retrieval evaluation on BEIR-format queries and qrels (``oprag eval beir``).

Documents, not chunks, are judged. The evaluator asks the server for document-level retrieval
(``group_by_document``): the top 100 documents (``--top-k``), each scored by its best chunk (MaxP: Dai &
Callan, SIGIR 2019), ranked by that score, ties by ascending doc id. Metrics over that document
ranking follow the TREC definitions used by BEIR (pytrec_eval):

* nDCG@k = DCG@k / IDCG@k with DCG@k = sum_{i=1..k} rel_i / log2(i + 1) (linear gain), IDCG@k
  the DCG of the judgements sorted by relevance.
* Recall@k = |relevant docs in the top k| / |relevant docs| (relevant: judgement > 0).
* MRR@k = 1 / rank of the first relevant doc within the top k (0 if none).

Queries without a positive judgement are skipped, as in BEIR.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path


def load_queries(path: Path) -> dict[str, str]:
    """BEIR queries.jsonl -> {query id: text}.

    :raises ValueError: a line that is not a JSON object with ``_id`` and ``text`` (file and
        line named; a missing ``_id`` was a bare KeyError, printed as ``'_id'``)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                    out[str(obj["_id"])] = obj["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    why = f"no {exc} field" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
                    raise ValueError(f'{path}:{n}: a BEIR queries line is a JSON object {{"_id", "text"}} ({why})') from None
    return out


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """BEIR qrels TSV (header ``query-id corpus-id score``, any line ending) -> {qid: {docid: rel}}.

    :raises ValueError: a score that is not a number (the message names the file and line).
    """
    out: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8", newline="") as f:
        rows = reader = csv.reader(f, delimiter="\t")
        header = next(rows, None)
        if header is None:
            return out
        if not header or header[0].strip().lower() not in ("query-id", "query_id", "qid"):
            rows = iter([header, *rows])
        for row in rows:
            if len(row) < 3 or not row[0].strip():
                continue
            try:
                rel = int(float(row[2]))
            except ValueError:  # (said only "could not convert string to float: 'abc'")
                raise ValueError(f"{path}:{reader.line_num}: score {row[2]!r} is not a number: a qrels line is "
                                 "query-id, corpus-id and an integer score, separated by tabs") from None
            out.setdefault(row[0].strip(), {})[row[1].strip()] = rel
    return out


def doc_ranking(doc_ids: list[str]) -> list[str]:
    """Documents in order of their first (best-ranked) chunk (duplicates dropped)."""
    return list(dict.fromkeys(doc_ids))


def metrics(ranked: list[str], rels: dict[str, int], recall_k: int = 100) -> dict[str, float]:
    """``{"ndcg@10", "recall@<recall_k>", "mrr@10"}`` of one query's document ranking (best first)."""
    return {"ndcg@10": ndcg_at_k(ranked, rels, 10), f"recall@{recall_k}": recall_at_k(ranked, rels, recall_k),
            "mrr@10": mrr_at_k(ranked, rels, 10)}


def ndcg_at_k(ranked: list[str], rels: dict[str, int], k: int) -> float:
    """nDCG@k with linear gain (module docstring); 0.0 when no judgement is positive."""
    dcg = sum(rels.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted((r for r in rels.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at_k(ranked: list[str], rels: dict[str, int], k: int) -> float:
    """Share of the relevant documents in the top k; 0.0 when none is relevant."""
    relevant = {d for d, r in rels.items() if r > 0}
    return len(relevant & set(ranked[:k])) / len(relevant) if relevant else 0.0


def mrr_at_k(ranked: list[str], rels: dict[str, int], k: int) -> float:
    """Reciprocal rank of the first relevant document within the top k (0.0 if none)."""
    for i, d in enumerate(ranked[:k]):
        if rels.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 100]); 0.0 for an empty list."""
    if not values:
        return 0.0
    s = sorted(values)
    idx = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[idx]
