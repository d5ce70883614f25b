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


#: what every qrels error message ends with: the format asked for
_QRELS_LINE = "a qrels line is query-id, corpus-id and an integer score, separated by tabs"


def _qrels_shape(row: list[str]) -> str:
    """Why a qrels row of other than 3 tab-separated fields is not one, and what to change."""
    words = " ".join(row).split()
    if len(words) == 4 and words[1] == "Q0":  # TREC: query-id Q0 doc-id relevance
        sep = "tab" if len(row) == 4 else "space"
        return (f"this looks like TREC qrels ({sep}-separated query-id, Q0, doc-id, score): {_QRELS_LINE}; drop "
                "the Q0 column (e.g. awk '{print $1 \"\\t\" $3 \"\\t\" $4}')")
    if len(row) == 1 and row[0].lstrip().startswith(("{", "[")):
        return f"this looks like JSON, not a qrels TSV (e.g. BEIR's qrels/test.tsv): {_QRELS_LINE}"
    if len(row) == 1 and len(words) == 3:
        return f"this line is separated by spaces: {_QRELS_LINE}, not spaces"
    fields = "1 tab-separated field" if len(row) == 1 else f"{len(row)} tab-separated fields"
    return f"{fields}, not 3: {_QRELS_LINE}"


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """BEIR qrels TSV (optional header ``query-id corpus-id score``, any line ending) -> {qid: {docid: rel}}.

    Blank lines are skipped; every other line is exactly 3 tab-separated fields.

    :raises ValueError: a line of other than 3 tab-separated fields (a space-separated file, TREC
        qrels with their ``Q0`` column, a JSON line), an empty id, or a score that is not an integer
        (``1.5``, ``inf``, ``x``; ``2.0`` reads as 2); the message names the file and line. (Such lines were skipped or misread: a space-separated
        file ended in "no judged query of the qrels is in the queries file", and TREC's ``Q0`` was
        read as the doc id.)
    """
    out: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        first = True
        for row in reader:
            if not any(field.strip() for field in row):
                continue
            where = f"{path}:{reader.line_num}"
            if first:
                first = False
                if row[0].strip().lower() in ("query-id", "query_id", "qid"):
                    continue  # BEIR's header line
            if len(row) != 3:
                raise ValueError(f"{where}: {_qrels_shape(row)}")
            qid, doc, score = (field.strip() for field in row)
            if not qid or not doc:
                raise ValueError(f"{where}: empty {'query-id' if not qid else 'corpus-id'}: {_QRELS_LINE}")
            try:
                value = float(score)
            except ValueError:  # (said only "could not convert string to float: 'abc'")
                raise ValueError(f"{where}: score {row[2]!r} is not a number: {_QRELS_LINE}") from None
            if not math.isfinite(value):  # (int(inf) raised OverflowError: a traceback)
                raise ValueError(f"{where}: score {row[2]!r} is not a finite number: {_QRELS_LINE}")
            if not value.is_integer():  # (1.5 was cut to 1 silently)
                raise ValueError(f"{where}: score {row[2]!r} is not an integer: {_QRELS_LINE} (relevance grades "
                                 "0, 1, 2, ...; map fractional scores to such grades)")
            rel = int(value)
            out.setdefault(qid, {})[doc] = rel
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
