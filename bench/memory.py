"""Conversational-memory benchmark: does the ``memory`` operator resolve implicit follow-ups?

Two sets. The default, ``--set conversations``, runs the conversation sets of
:mod:`bench.memory_sets` (follow-ups with and without a pronoun, chains of three turns,
self-contained questions that contain "it"/"they" but name their subject, a topic switch inside
a session; template families ``--family 0,1,2``, several in one run) over gRPC as :mod:`bench.memory_conv` describes,
with the oracle and naive-prepend rows, and prints the issue's keys (``followup_top1_with``,
``followup_top1_without``, ``followup_top1_oracle``, ``chain_turn3_top1_with``,
``selfcontained_top1_with``, ``selfcontained_top1_without``, ``session_latency_ratio_p50``,
``memory_stage_ms_p95``, ``per_kind``; ``families`` holds every family's figures, the top
level the first family's; ``latency_abab`` the ABAB latency rounds (``--latency-rounds``) with
the server's stage p50s per arm; ``load_average`` the load after each phase). ``--set pairs`` runs the original pairs described below.

The evaluation set (deterministic; regenerable from any WikiText file)
---------------------------------------------------------------------

Input: a WikiText file (default ``../shared/data/wikitext-2/valid.txt``; ``--wikitext PATH``).

1. Articles: ``oprag_client.loaders.load_wikitext`` (one document per `` = Title = `` article,
   ``@-@``/``@,@``/``@.@`` joined back, doc id ``<file stem>:<title>``, ``#2``... for a repeated
   title).
2. Windows: each article body is cut with the server's chunker,
   ``bench._internals.chunk_text(body, 256, 0)`` (windows that are only
   whitespace are dropped, as the server does).
3. Words: ``casefold`` of every maximal run of letters (regex ``[^\\W\\d_]+``). A word touching
   the start or the end of a window (a chunk boundary) is
   ignored for that window. Document frequency (df) = number of articles of the file whose body
   contains the word.
4. Eligible articles, in file order: title contains no ``<unk>``; the title is not repeated in
   the file; >= 3 windows; at least one window other than the first has >= 300 characters
   (a "candidate window"); the chosen window (5.) has >= 3 specific keywords and >= 1 shared
   keyword (6.).
5. Target window: ``cands[h % len(cands)]`` where ``cands`` are the candidate windows' indices
   (ascending, index 0 never included) and ``h = int(sha256(title.encode("utf-8")).hexdigest(), 16)``.
6. Keywords. Candidates: words of the target window that have >= 4 letters, are not in the
   stop list ``STOPWORDS`` below, are not ``unk``, are not a word of the title, and occur in no
   other window of the same article (so the word points at the target window *within* its
   article).

   * specific keywords ``r1 r2 r3``: the candidates sorted by (df ascending, first position in
     the window), first 3. Mostly words of this article alone: they identify the chunk even
     without the subject.
   * shared keyword ``w``: the first candidate, in the same order, with df >= ``SHARED_MIN_DF``
     (3: the word also occurs in at least two other articles). Alone it does not say which
     article is meant -- the question is underspecified, like "what was its population?".
7. Questions (``T`` = title; a keyword is written as at its first occurrence in the window):

   * first turn:                ``What is T?``
   * follow-up (the headline):  ``What about its w?``                       (subject implicit)
   * specific follow-up:        ``What does it say about r1, r2 and r3?``   (subject implicit)
   * self-contained:            ``What does T say about w?``
   * specific self-contained:   ``What does T say about r1, r2 and r3?``

   The target of every question but the first is the target window as the
   server stored it: chunk id ``<doc id>#<ordinal>``. The ordinal equals the window index unless
   an earlier window of the article had more than the embedder's 256 tokens (the server splits
   such a window again and numbers every piece), so the benchmark resolves the ids from the
   server's own snapshot after the run (the chunks of the document, in ordinal order,
   concatenated window by window). If the target window itself was split, every piece counts as
   the target. Articles whose stored chunks do not reproduce the windows are reported
   (``unresolved``) and left out.

The run
-------

A real server (``--generator none``, 2 shards, data dir ``bench/out/memory-data``). If Stats
shows the file's documents already there, ingest is skipped; else the file is ingested over
the gRPC streaming API (``load_wikitext``). Every request is ``Retrieve`` with ``top_k=10``,
``mode=hybrid``, sequential (one request at a time, so a scheduler batch is one request).
Per pair, with session ids unique to the run (``memb-<run nonce>-<pair>-<variant>``):

* memory ON: for each of the four questions of 7., a fresh session: the first turn (recorded
  by the server), then the question in the same session.
* memory OFF: each of the four questions with no session id and ``disable_memory=True``.

Metrics against the target chunk: Top-1, Hit@5, MRR@10 (``top1_with`` ... are the headline
follow-up; ``specific_*``, ``selfcontained_*``, ``selfcontained_specific_*`` the others).
Overhead: the server-reported ``memory`` stage (ms) of the memory-on follow-ups of both kinds
(p50, p95), and
``overhead_fraction_of_retrieval = p50(memory) / p50(embed + retrieve)`` over the
same requests. ``bytes_per_turn``: after a clean stop (SIGTERM -> snapshot), the total size of
``shard-*/<CURRENT>/memory.json`` divided by the records in it (Stats ``memory_records``
before the stop is reported beside it; the data dir keeps the records of earlier runs, which
count too: the figure is an average per stored record).

``--json`` prints one JSON object as the last stdout line; progress goes to stderr; per-pair
details go to ``bench/out/memory-pairs.jsonl``. Percentiles are nearest-rank
(``_common.percentile``). From the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.memory --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from . import _internals
from ._common import (
    DEFAULT_SHARED,
    OUT,
    REPO,
    emit_json,
    ingest,
    log,
    machine_info,
    percentile,
    shard_snapshot_files,
    start_server,
)

CHUNK_SIZE = 256  # tokens: the server default (--chunk-size)
MIN_WINDOWS = 3
MIN_WINDOW_CHARS = 300
N_KEYWORDS = 3
SHARED_MIN_DF = 3
MIN_WORD_LEN = 4
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)

# A small English stop list (function words and very common verbs/nouns of encyclopedic text).
STOPWORDS = frozenset("""
a about above after again against all also although among an and another any are around as at
be became because become been before being below between both but by can could did do does
doing down during each either even ever every few for from further had has have having he her
here hers him his how however i if in into is it its itself just later least less many may
might more most much must near neither never new no nor not now of off often on once one only
or other others our out over own per rather same several she should since so some still such
than that the their theirs them then there these they this those though three through thus to
too two under until up upon very was we were what when where whether which while who whom
whose why will with within without would year years yet you your first second third time
made make including included include known called would part following early late well
""".split())


# question kinds of a pair (keys of the pair dict) -> label
VARIANTS = {
    "followup": "follow-up (shared word)",
    "specific": "specific follow-up",
    "selfcontained": "self-contained",
    "selfcontained_specific": "specific self-contained",
}

# ------------------------------------------------------------------------------ the set

def _words(text: str) -> list[tuple[str, int, int]]:
    """(casefolded word, start, end) for every run of letters."""
    return [(m.group(0).casefold(), m.start(), m.end()) for m in _WORD.finditer(text)]


def _inner_words(window: str) -> list[tuple[str, str]]:
    """(casefolded word, word as written) of a window in order, without those touching either
    edge (maybe cut in half)."""
    n = len(window)
    return [(w, window[s:e]) for w, s, e in _words(window) if s > 0 and e < n]


def build_pairs(path: Path) -> tuple[list[dict], dict]:
    """The evaluation pairs of one WikiText file (see the module docstring) and counts of why
    articles were left out."""
    from oprag_client.loaders import load_wikitext

    chunk_text = _internals.chunk_text
    docs = list(load_wikitext([Path(path)]))
    title_count: dict[str, int] = {}
    for d in docs:
        title_count[d.title] = title_count.get(d.title, 0) + 1
    df: dict[str, int] = {}
    for d in docs:
        for w in {w for w, _, _ in _words(d.text)}:
            df[w] = df.get(w, 0) + 1
    skipped = {"unk_title": 0, "repeated_title": 0, "few_windows": 0, "no_candidate_window": 0, "few_keywords": 0}
    pairs: list[dict] = []
    for d in docs:
        if "<unk>" in d.title:
            skipped["unk_title"] += 1
            continue
        if title_count[d.title] > 1:
            skipped["repeated_title"] += 1
            continue
        windows = [p for p in chunk_text(d.text, CHUNK_SIZE, 0) if p.strip()]
        if len(windows) < MIN_WINDOWS:
            skipped["few_windows"] += 1
            continue
        cands = [i for i in range(1, len(windows)) if len(windows[i]) >= MIN_WINDOW_CHARS]
        if not cands:
            skipped["no_candidate_window"] += 1
            continue
        h = int(hashlib.sha256(d.title.encode("utf-8")).hexdigest(), 16)
        t = cands[h % len(cands)]
        title_words = {w for w, _, _ in _words(d.title)}
        elsewhere = {w for i, win in enumerate(windows) if i != t for w, _, _ in _words(win)}
        seen: dict[str, int] = {}
        surface: dict[str, str] = {}
        for pos, (w, written) in enumerate(_inner_words(windows[t])):
            if (len(w) < MIN_WORD_LEN or w in STOPWORDS or w == "unk" or w in title_words
                    or w in elsewhere or w in seen):
                continue
            seen[w] = pos
            surface[w] = written
        ordered = sorted(seen, key=lambda w: (df.get(w, 0), seen[w]))
        kws = ordered[:N_KEYWORDS]
        shared = [w for w in ordered if df.get(w, 0) >= SHARED_MIN_DF][:1]
        if len(kws) < N_KEYWORDS or not shared:
            skipped["few_keywords"] += 1
            continue
        w1, w2, w3 = (surface[k] for k in kws)
        w = surface[shared[0]]
        pairs.append({
            "doc_id": d.id,
            "title": d.title,
            "n_windows": len(windows),
            "window": t,
            "window_text": windows[t],
            "windows": windows,
            "keywords": kws,
            "keyword_df": [df[k] for k in kws],
            "shared_keyword": shared[0],
            "shared_keyword_df": df[shared[0]],
            "first": f"What is {d.title}?",
            "followup": f"What about its {w}?",
            "specific": f"What does it say about {w1}, {w2} and {w3}?",
            "selfcontained": f"What does {d.title} say about {w}?",
            "selfcontained_specific": f"What does {d.title} say about {w1}, {w2} and {w3}?",
        })
    return pairs, {"articles": len(docs), "skipped": skipped}


def resolve_targets(pairs: list[dict], data_dir: Path) -> int:
    """Set ``pair["targets"]`` (server chunk ids of the target window) from the snapshot;
    returns how many pairs could not be resolved (``targets`` = [])."""
    import pyarrow as pa

    by_doc: dict[str, list[tuple[int, str, str]]] = {}
    want = {p["doc_id"] for p in pairs}
    for _, f in shard_snapshot_files(data_dir):
        with pa.OSFile(str(f), "rb") as src:
            table = pa.ipc.open_stream(src).read_all()
        cols = {c: table.column(c).to_pylist() for c in ("chunk_id", "doc_id", "text")}
        for cid, did, text in zip(cols["chunk_id"], cols["doc_id"], cols["text"]):
            if did in want:
                by_doc.setdefault(did, []).append((int(cid.rsplit("#", 1)[1]), cid, text or ""))
    bad = 0
    for p in pairs:
        chunks = sorted(by_doc.get(p["doc_id"], []))
        p["targets"] = []
        k = 0
        ok = True
        for wi, win in enumerate(p["windows"]):
            ids, acc = [], ""
            while k < len(chunks) and len(acc) < len(win):
                acc += chunks[k][2]
                ids.append(chunks[k][1])
                k += 1
            if acc != win:
                ok = False
                break
            if wi == p["window"]:
                p["targets"] = ids
        if not ok or k != len(chunks) or not p["targets"]:
            p["targets"] = []
            bad += 1
    return bad


# ------------------------------------------------------------------------------ metrics

def rank_of(hit_ids: list[str], targets: list[str]) -> int:
    """1-based rank of the first target among the hits; 0 = not retrieved."""
    ts = set(targets)
    for i, cid in enumerate(hit_ids, 1):
        if cid in ts:
            return i
    return 0


def quality(ranks: list[int], k: int = 10) -> dict:
    n = len(ranks)
    if not n:
        return {"top1": 0.0, "hit5": 0.0, "mrr": 0.0}
    return {
        "top1": round(sum(1 for r in ranks if r == 1) / n, 4),
        "hit5": round(sum(1 for r in ranks if 1 <= r <= 5) / n, 4),
        "mrr": round(sum(1.0 / r for r in ranks if 1 <= r <= k) / n, 4),
    }


def _git_rev() -> dict:
    out: dict = {}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                       timeout=10).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--", "server/oprag_server"],
                            cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        out["server_modified"] = bool(st)
    except Exception:  # noqa: BLE001
        pass
    return out


# ------------------------------------------------------------------------------ steps

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wikitext", type=Path, default=DEFAULT_SHARED / "data" / "wikitext-2" / "valid.txt",
                    help="WikiText file the set is built from and the server holds")
    ap.add_argument("--data-dir", type=Path, default=OUT / "memory-data")
    ap.add_argument("--fresh", action="store_true", help="delete --data-dir first (re-ingest, no old memory records)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--mode", default="hybrid")
    ap.add_argument("--set", choices=("conversations", "pairs"), default="conversations",
                    help="conversations: the sets of bench/memory_sets.py (five kinds, the issue's JSON keys); "
                         "pairs: the original follow-up/self-contained pairs below")
    ap.add_argument("--family", default="0",
                    help="template families of the conversations, comma-separated (0, 1, 2; e.g. 0,1,2: one "
                         "server and ingest, each family in turn, ``families`` in the JSON)")
    ap.add_argument("--latency-rounds", type=int, default=4,
                    help="ABAB latency rounds after the quality runs (0: none): per round, per conversation of "
                         "a subset, a session follow-up (A) and the same question without memory (B), the order "
                         "alternating per round")
    ap.add_argument("--limit", type=int, default=0,
                    help="use only the first N pairs (conversations: N of each kind) -- a --quick subset")
    ap.add_argument("--warmup", type=int, default=5, help="untimed requests first")
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    ap.add_argument("--pairs-out", type=Path, default=OUT / "memory-pairs.jsonl")
    ap.add_argument("--details-prefix", default="memory-conv",
                    help="conversations: every request's hits go to bench/out/<prefix>-f<family>.jsonl")
    ap.add_argument("--examples", type=int, default=6, help="failure examples kept in the JSON")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    a = ap.parse_args(argv)
    a.server_args = ["--generator", "none", "--shards", str(a.shards), *a.server_arg]
    return a


def build_set(a) -> tuple[list[dict], dict]:
    """Step 1: the evaluation pairs (module docstring), first ``--limit`` of them."""
    pairs, set_info = build_pairs(a.wikitext)
    if a.limit:
        pairs = pairs[: a.limit]
    log(f"set: {len(pairs)} pairs from {set_info['articles']} articles of {a.wikitext} "
        f"(left out: {set_info['skipped']})")
    if not pairs:
        raise SystemExit("FAIL: no eligible article")
    return pairs, set_info


def ingest_corpus(c, a, docs: list, result: dict) -> int:
    """Step 2: ingest the WikiText file unless the data dir already holds it; fills
    ``result["ingest"]`` and ``result["corpus"]``. :returns: memory records before the run."""
    st = c.stats()
    if st.documents == len(docs):
        log(f"data dir already holds {st.documents} documents / {st.chunks} chunks: ingest skipped")
        result["ingest"] = {"skipped": True}
    else:
        if st.documents:
            raise SystemExit(f"FAIL: {a.data_dir} holds {st.documents} documents, the file has {len(docs)}: "
                             "use --fresh or another --data-dir")
        log(f"ingesting {len(docs)} documents")
        result["ingest"] = ingest(c, docs)
        log(f"ingest: {result['ingest']}")
    st = c.stats()
    if st.documents != len(docs):
        raise SystemExit(f"FAIL: server holds {st.documents} documents, expected {len(docs)}")
    result["corpus"] = {"documents": int(st.documents), "chunks": int(st.chunks)}
    return int(st.memory_records)


def ask(c, a, pairs: list[dict], result: dict) -> list[dict]:
    """Step 3: warm-up, then every question of every pair with memory on (fresh session after
    the first turn) and off. :returns: per pair ``{request key: {"hits", "titles",
    "memory_context", "t": {stage: ms}}}``; sets ``result["query_seconds"]``."""
    nonce = uuid.uuid4().hex[:8]
    q = {"top_k": a.top_k, "mode": a.mode}

    def call(question: str, sid: str = "") -> dict:
        r = c.retrieve(question, session_id=sid, disable_memory=not sid, timeout=120, **q)
        tm = dict(r.timings_ms)
        return {"hits": [h.chunk_id for h in r.hits], "titles": [h.title for h in r.hits],
                "memory_context": r.memory_context,
                "t": {k: round(tm.get(k, 0.0), 4) for k in ("memory", "embed", "retrieve", "total")}}

    for i in range(a.warmup):
        call(pairs[i % len(pairs)]["first"])
    runs: list[dict] = []
    t_q = time.perf_counter()
    for i, p in enumerate(pairs):
        rec: dict = {}
        for variant in VARIANTS:
            sid = f"memb-{nonce}-{i}-{variant}"
            rec[f"first_{variant}"] = call(p["first"], sid)
            rec[f"{variant}_on"] = call(p[variant], sid)
            rec[f"{variant}_off"] = call(p[variant])
        runs.append(rec)
        if (i + 1) % 10 == 0:
            log(f"  {i + 1}/{len(pairs)} pairs, {time.perf_counter() - t_q:.0f} s")
    result["query_seconds"] = round(time.perf_counter() - t_q, 1)
    return runs


def memory_bytes(data_dir: Path) -> tuple[int, int]:
    """Step 4: (bytes, records) of every shard's current ``memory.json`` (after a clean stop)."""
    mem_bytes = mem_records = 0
    for d in sorted(Path(data_dir).glob("shard-*")):
        cur = d / "CURRENT"
        f = (d / cur.read_text().strip() if cur.exists() else d) / "memory.json"
        if f.exists():
            mem_bytes += f.stat().st_size
            mem_records += len(json.loads(f.read_text()))
    return mem_bytes, mem_records


def score(a, pairs: list[dict], runs: list[dict]) -> tuple[dict, dict]:
    """Step 5: quality per request kind, rank changes, failure examples and the memory stage's
    overhead over the pairs whose target resolved.

    :returns: (result fields, ``{kind: quality}`` for the log)."""
    keep = [(p, r) for p, r in zip(pairs, runs) if p["targets"]]
    ranks: dict[str, list[int]] = {}
    for p, r in keep:
        for v in VARIANTS:
            for key in (f"{v}_on", f"{v}_off"):
                ranks.setdefault(key, []).append(rank_of(r[key]["hits"], p["targets"]))
        ranks.setdefault("first_doc_top1", []).append(
            1 if r["first_followup"]["hits"] and r["first_followup"]["hits"][0].rsplit("#", 1)[0] == p["doc_id"] else 0)
    Q = {k: quality(v) for k, v in ranks.items() if k != "first_doc_top1"}
    on = [r[f"{v}_on"]["t"] for _, r in keep for v in ("followup", "specific")]
    off = [r[f"{v}_off"]["t"] for _, r in keep for v in ("followup", "specific")]
    mem_ms = [t["memory"] for t in on]
    path_ms = [t["embed"] + t["retrieve"] for t in on]
    path_ms_with_mem = [t["memory"] + t["embed"] + t["retrieve"] for t in on]
    path_ms_off = [t["memory"] + t["embed"] + t["retrieve"] for t in off]
    n = len(keep)

    def changed(key: str) -> dict:
        on_r, off_r = ranks[f"{key}_on"], ranks[f"{key}_off"]
        return {"top1_gained": sum(1 for x, y in zip(on_r, off_r) if x == 1 and y != 1),
                "top1_lost": sum(1 for x, y in zip(on_r, off_r) if x != 1 and y == 1),
                "rank_better": sum(1 for x, y in zip(on_r, off_r) if (x or 99) < (y or 99)),
                "rank_worse": sum(1 for x, y in zip(on_r, off_r) if (x or 99) > (y or 99))}

    def example(p: dict, r: dict, key: str) -> dict:
        return {"title": p["title"], "target": p["targets"], "question": p[key],
                "rank_with": rank_of(r[f"{key}_on"]["hits"], p["targets"]),
                "rank_without": rank_of(r[f"{key}_off"]["hits"], p["targets"]),
                "memory_context": r[f"{key}_on"]["memory_context"],
                "first_turn_top_titles": r[f"first_{key}"]["titles"][:3],
                "top3_with": r[f"{key}_on"]["hits"][:3], "top3_without": r[f"{key}_off"]["hits"][:3]}

    examples = {}
    for key in VARIANTS:
        lost = [example(p, r, key) for p, r in keep
                if rank_of(r[f"{key}_on"]["hits"], p["targets"]) != 1 and rank_of(r[f"{key}_off"]["hits"], p["targets"]) == 1]
        failed = [example(p, r, key) for p, r in keep if rank_of(r[f"{key}_on"]["hits"], p["targets"]) != 1]
        examples[key] = {"top1_lost_with_memory": lost[: a.examples], "not_top1_with_memory": failed[: a.examples]}

    fields = {
        "n": n,
        "top1_with": Q["followup_on"]["top1"], "top1_without": Q["followup_off"]["top1"],
        "hit5_with": Q["followup_on"]["hit5"], "hit5_without": Q["followup_off"]["hit5"],
        "mrr_with": Q["followup_on"]["mrr"], "mrr_without": Q["followup_off"]["mrr"],
        "selfcontained_top1_with": Q["selfcontained_on"]["top1"],
        "selfcontained_top1_without": Q["selfcontained_off"]["top1"],
        "selfcontained_hit5_with": Q["selfcontained_on"]["hit5"],
        "selfcontained_hit5_without": Q["selfcontained_off"]["hit5"],
        "selfcontained_mrr_with": Q["selfcontained_on"]["mrr"],
        "selfcontained_mrr_without": Q["selfcontained_off"]["mrr"],
        **{f"{v}_{m}_{w}": Q[f"{v}_{o}"][m] for v in ("specific", "selfcontained_specific")
           for m in ("top1", "hit5", "mrr") for w, o in (("with", "on"), ("without", "off"))},
        "top1_ratio": round(Q["followup_on"]["top1"] / Q["followup_off"]["top1"], 3)
        if Q["followup_off"]["top1"] else None,
        "selfcontained_top1_change_points": round(100 * (Q["selfcontained_on"]["top1"]
                                                         - Q["selfcontained_off"]["top1"]), 2),
        "first_turn_doc_top1": round(sum(ranks["first_doc_top1"]) / n, 4) if n else 0.0,
        "overhead_ms_p50": round(percentile(mem_ms, 50), 4),
        "overhead_ms_p95": round(percentile(mem_ms, 95), 4),
        "overhead_fraction_of_retrieval": round(percentile(mem_ms, 50) / percentile(path_ms, 50), 4)
        if percentile(path_ms, 50) else None,
        "retrieval_ms_p50_with": round(percentile(path_ms_with_mem, 50), 3),
        "retrieval_ms_p50_without": round(percentile(path_ms_off, 50), 3),
        "embed_ms_p50_with": round(percentile([t["embed"] for t in on], 50), 3),
        "embed_ms_p50_without": round(percentile([t["embed"] for t in off], 50), 3),
        "changes": {k: changed(k) for k in VARIANTS},
        "examples": examples,
    }
    return fields, Q


def write_pairs(path: Path, pairs: list[dict], runs: list[dict]) -> None:
    """Step 6: one JSON line per pair (its set fields, ranks and every request's outcome)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p, r in zip(pairs, runs):
            row = {k: v for k, v in p.items() if k not in ("windows", "window_text")}
            row["ranks"] = {k: rank_of(r[k]["hits"], p["targets"]) for k in r if not k.startswith("first_")}
            row["runs"] = r
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def log_summary(result: dict, Q: dict, pairs_out: Path) -> None:
    log(f"n={result['n']} (unresolved {result['unresolved']})")
    for key, name in VARIANTS.items():
        log(f"{name:24s} with memory: top1 {Q[key + '_on']['top1']:.3f} hit5 {Q[key + '_on']['hit5']:.3f} "
            f"mrr {Q[key + '_on']['mrr']:.3f} | without: top1 {Q[key + '_off']['top1']:.3f} "
            f"hit5 {Q[key + '_off']['hit5']:.3f} mrr {Q[key + '_off']['mrr']:.3f}")
    log(f"memory stage p50 {result['overhead_ms_p50']} ms p95 {result['overhead_ms_p95']} ms "
        f"({result['overhead_fraction_of_retrieval']} of embed+retrieve p50); "
        f"bytes/turn {result['bytes_per_turn']} ({result['memory_records_snapshot']} records, "
        f"{result['memory_json_bytes']} bytes)")
    log(f"per-pair details: {pairs_out}")


# ------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from oprag_client.client import OpRAGClient
    from oprag_client.loaders import load_wikitext

    t_start = time.perf_counter()
    result: dict = {"machine": machine_info(), "git": _git_rev()}
    if a.set == "conversations":
        return run_conversations(a, result, t_start)
    pairs, set_info = build_set(a)
    docs = list(load_wikitext([a.wikitext]))
    if a.fresh and a.data_dir.exists():
        shutil.rmtree(a.data_dir)
    server_log = OUT / "memory-server.log"
    t = time.perf_counter()
    srv = start_server(a.data_dir, *a.server_args, log_path=server_log)
    try:
        log(f"server up on {srv.target} in {time.perf_counter() - t:.1f} s (log: {server_log})")
        with OpRAGClient(srv.target) as c:  # no deadline: ingest on a busy machine takes minutes
            mem_before = ingest_corpus(c, a, docs, result)
            runs = ask(c, a, pairs, result)
            mem_after = int(c.stats().memory_records)
        rc = srv.stop()
        log(f"server stopped (rc={rc})")
    finally:
        srv.stop()

    unresolved = resolve_targets(pairs, a.data_dir)
    mem_bytes, mem_records_snapshot = memory_bytes(a.data_dir)
    fields, Q = score(a, pairs, runs)
    result.update({
        "n": fields.pop("n"),
        "unresolved": unresolved,
        **{k: v for k, v in fields.items() if k not in ("changes", "examples")},
        "bytes_per_turn": round(mem_bytes / mem_records_snapshot, 1) if mem_records_snapshot else None,
        "memory_json_bytes": mem_bytes,
        "memory_records_snapshot": mem_records_snapshot,
        "memory_records_stats": mem_after,
        "memory_records_added": mem_after - mem_before,
        "changes": fields["changes"],
        "set": {"file": str(a.wikitext), **set_info, "pairs": len(pairs)},
        "settings": {"top_k": a.top_k, "mode": a.mode, "shards": a.shards, "server_args": a.server_args},
        "examples": fields["examples"],
        "seconds": round(time.perf_counter() - t_start, 1),
    })
    write_pairs(a.pairs_out, pairs, runs)
    log_summary(result, Q, a.pairs_out)
    if a.json:
        emit_json(result)
    return 0


def machine_load() -> list[float]:
    """The 1/5/15-minute load averages (``os.getloadavg``)."""
    import os

    return [round(x, 2) for x in os.getloadavg()]


def run_conversations(a, result: dict, t_start: float) -> int:
    """``--set conversations``: :mod:`bench.memory_conv` against a real server."""
    from oprag_client.client import OpRAGClient
    from oprag_client.loaders import load_wikitext

    from . import memory_conv

    families = [int(f) for f in str(a.family).split(",")]
    sets = {f: memory_conv.conversations(a.wikitext, f, a.limit) for f in families}
    for f, (convs, _) in sets.items():
        log(f"set: {len(convs)} conversations (family {f}) from {a.wikitext}")
    docs = list(load_wikitext([a.wikitext]))
    if a.fresh and a.data_dir.exists():
        shutil.rmtree(a.data_dir)
    srv = start_server(a.data_dir, *a.server_args, log_path=OUT / "memory-server.log")
    runs, load = {}, {"before": machine_load()}
    try:
        with OpRAGClient(srv.target) as c:
            ingest_corpus(c, a, docs, result)
            t = time.perf_counter()
            for f, (convs, _) in sets.items():
                runs[f] = memory_conv.ask(c, convs, a.top_k, a.mode, a.warmup)
                load[f"after_family_{f}"] = machine_load()
            result["query_seconds"] = round(time.perf_counter() - t, 1)
            if a.latency_rounds:
                convs = sets[families[0]][0]
                result["latency_abab"] = memory_conv.latency_abab(c, convs, a.top_k, a.mode, a.latency_rounds)
                load["after_latency"] = machine_load()
        srv.stop()
    finally:
        srv.stop()
    fams = {}
    for f, (convs, bodies) in sets.items():
        targets = memory_conv.resolve(convs, bodies, a.data_dir)
        fams[f] = memory_conv.score(convs, runs[f], targets)
        with open(OUT / f"{a.details_prefix}-f{f}.jsonl", "w", encoding="utf-8") as fh:  # every request's hits
            for cv, r in zip(convs, runs[f]):
                fh.write(json.dumps({"kind": cv.kind, "turns": cv.turns, "targets": [targets.get(t, []) for t in
                                     cv.targets], "oracle": cv.oracle, "runs": r}, ensure_ascii=False) + "\n")
        log(f"family {f}:")
        memory_conv.log_summary(fams[f])
    if "latency_abab" in result:
        log(f"ABAB latency: {result['latency_abab']}")
        result["session_latency_ratio_p50_abab"] = result["latency_abab"]["ratio_p50"]
    result.update(fams[families[0]], families=fams, load_average=load,
                  set={"file": str(a.wikitext), "families": families, "limit_per_kind": a.limit},
                  settings={"top_k": a.top_k, "mode": a.mode, "shards": a.shards, "server_args": a.server_args},
                  seconds=round(time.perf_counter() - t_start, 1))
    if a.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
