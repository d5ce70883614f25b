"""The conversation sets of :mod:`bench.memory_sets` run over gRPC (``python -m bench.memory``,
the default ``--set conversations``).

The server (the shared launcher, ``--generator none``) holds the WikiText file; the set is built
with the server's own chunker (:func:`bench._internals.chunk_text`, 256 MiniLM tokens), so the
target of a turn is stored chunk ``<doc id>#<window index>``; after the run the ids are checked
against the server's snapshot (:func:`bench.memory.resolve_targets`; a conversation whose target
does not resolve is left out and counted in ``unresolved``). Every request is ``Retrieve``
(``--mode``, ``--top-k``), one at a time. Per conversation:

* ``with``: a fresh session (``memc-<nonce>-<n>``), every turn in order, the last one scored
  (the chain's turn 2 as well);
* ``without``: the last question, no session, ``disable_memory``;
* ``oracle``: the last question with its subject written out, no session;
* ``naive``: the previous question + the last question in one request, no session.

Latency: ``session_latency_ratio_p50`` = p50 of the client-measured wall time of the session
turns after the first (memory on) / p50 of the ``without`` requests, nearest-rank; the
server-reported ``memory`` stage of the same session turns gives ``memory_stage_ms_p50/p95``.
"""

from __future__ import annotations

import time
import uuid

from . import _internals
from ._common import log, percentile
from .memory_sets import KINDS, ROWS, Conversation, build, headline, wikitext_articles


def server_windows(body: str) -> list[str]:
    """The server's chunks of a document body (whitespace-only ones dropped, as the server does)."""
    return [w for w in _internals.chunk_text(body, 256, 0) if w.strip()]


def conversations(path, family: int, limit: int = 0) -> tuple[list[Conversation], dict[str, str]]:
    """The set of a WikiText file (server chunks) and ``{doc_id: body}`` of its articles; the
    first ``limit`` conversations of each kind when ``limit``."""
    arts = wikitext_articles(path)
    convs = build(arts, family, split=server_windows)
    if limit:
        convs = [c for k in KINDS for c in [c for c in convs if c.kind == k][:limit]]
    return convs, {d: body for d, _, body in arts}


def ask(c, convs: list[Conversation], top_k: int, mode: str, warmup: int = 5) -> list[dict]:
    """Every request of every conversation. :returns: per conversation ``{"turns": [call],
    "without": call, "oracle": call, "naive": call}``, a call being ``{"hits", "used", "ms",
    "t": {stage: ms}}``."""
    nonce = uuid.uuid4().hex[:8]

    def call(question: str, sid: str = "") -> dict:
        t = time.perf_counter()
        r = c.retrieve(question, session_id=sid, disable_memory=not sid, timeout=120, top_k=top_k, mode=mode)
        ms = (time.perf_counter() - t) * 1000
        tm = dict(r.timings_ms)
        return {"hits": [h.chunk_id for h in r.hits], "used": bool(r.memory_used), "ms": round(ms, 3),
                "t": {k: round(tm.get(k, 0.0), 4) for k in ("memory", "embed", "retrieve", "total")}}

    for i in range(warmup):
        call(convs[i % len(convs)].turns[0])
    runs, t0 = [], time.perf_counter()
    for n, cv in enumerate(convs):
        sid = f"memc-{nonce}-{n}"
        runs.append({"turns": [call(q, sid) for q in cv.turns], "without": call(cv.turns[-1]),
                     "oracle": call(cv.oracle), "naive": call(cv.naive)})
        if (n + 1) % 25 == 0:
            log(f"  {n + 1}/{len(convs)} conversations, {time.perf_counter() - t0:.0f} s")
    return runs


ABAB_STAGES = ("queue", "memory", "embed", "retrieve", "fusion", "promote", "total")


def latency_abab(c, convs: list[Conversation], top_k: int, mode: str, rounds: int, n: int = 40) -> dict:
    """Retrieve latency with a session vs without, in ABAB rounds: per round, per conversation
    of the first ``n`` follow-up conversations (kinds ``pronoun``/``nopronoun``), A = its last
    question in a fresh session after its first turn (untimed), B = the same question with no
    session and ``disable_memory``; A first in even rounds, B first in odd ones (a load drift
    hits both arms alike). Client wall time (ms), nearest-rank p50/p95.

    :returns: ``{"ratio_p50", "with_ms_p50", "without_ms_p50", "with_ms_p95", "without_ms_p95",
        "memory_stage_ms_p50", "memory_stage_ms_p95", "requests_per_arm", "rounds",
        "server_stage_ms_p50": {stage: {"with", "without"}}}`` (server-reported ``timings_ms``)."""
    nonce = uuid.uuid4().hex[:8]
    sub = [cv for cv in convs if cv.kind in ("pronoun", "nopronoun")][:n]
    with_ms, without_ms, mem = [], [], []
    stages: dict[str, tuple[list, list]] = {s: ([], []) for s in ABAB_STAGES}

    def timed(question: str, sid: str = "") -> tuple[float, float]:
        t = time.perf_counter()
        r = c.retrieve(question, session_id=sid, disable_memory=not sid, timeout=120, top_k=top_k, mode=mode)
        ms, tm = (time.perf_counter() - t) * 1000, dict(r.timings_ms)
        for s, arms in stages.items():
            arms[0 if sid else 1].append(tm.get(s, 0.0))
        return ms, tm.get("memory", 0.0)

    for rnd in range(rounds):
        for k, cv in enumerate(sub):
            sid = f"meml-{nonce}-{rnd}-{k}"
            for arm in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                if arm == 0:
                    c.retrieve(cv.turns[0], session_id=sid, timeout=120, top_k=top_k, mode=mode)
                    ms, m = timed(cv.turns[-1], sid)
                    with_ms.append(ms)
                    mem.append(m)
                else:
                    without_ms.append(timed(cv.turns[-1])[0])
    p = lambda xs, q: round(percentile(xs, q), 3) if xs else 0.0  # noqa: E731
    return {"ratio_p50": round(p(with_ms, 50) / p(without_ms, 50), 3) if without_ms else None,
            "with_ms_p50": p(with_ms, 50), "without_ms_p50": p(without_ms, 50),
            "with_ms_p95": p(with_ms, 95), "without_ms_p95": p(without_ms, 95),
            "memory_stage_ms_p50": p(mem, 50), "memory_stage_ms_p95": p(mem, 95),
            "requests_per_arm": len(with_ms), "rounds": rounds,
            "server_stage_ms_p50": {s: {"with": p(a, 50), "without": p(b, 50)} for s, (a, b) in stages.items()}}


def resolve(convs: list[Conversation], bodies: dict[str, str], data_dir) -> dict[str, list[str]]:
    """``{window chunk id: stored chunk ids}`` of every target, from the server's snapshot (an
    id that does not resolve maps to ``[]``)."""
    from .memory import resolve_targets

    want = sorted({t for cv in convs for t in [cv.target, *cv.targets] if t})
    pairs, cache = [], {}
    for t in want:
        doc, i = t.rsplit("#", 1)
        if doc not in cache:
            cache[doc] = server_windows(bodies[doc])
        pairs.append({"doc_id": doc, "windows": cache[doc], "window": int(i)})
    resolve_targets(pairs, data_dir)
    return {t: p["targets"] for t, p in zip(want, pairs)}


def score(convs: list[Conversation], runs: list[dict], targets: dict[str, list[str]]) -> dict:
    """The :func:`bench.memory_sets.headline` figures, latency and memory-stage percentiles."""
    res = {k: {r: [] for r in ROWS} for k in KINDS}
    chain2, lat_with, lat_without, mem_ms, used, kept = [], [], [], [], 0, 0

    def top1(call: dict, target: str) -> bool:
        return bool(call["hits"]) and call["hits"][0] in targets[target]

    for cv, r in zip(convs, runs):
        if not targets.get(cv.target) or (cv.kind == "chain" and not targets.get(cv.targets[1])):
            continue
        kept += 1
        res[cv.kind]["with"].append(top1(r["turns"][-1], cv.target))
        for row in ("without", "oracle", "naive"):
            res[cv.kind][row].append(top1(r[row], cv.target))
        if cv.kind == "chain":
            chain2.append(top1(r["turns"][1], cv.targets[1]))
        lat_with += [x["ms"] for x in r["turns"][1:]]
        mem_ms += [x["t"]["memory"] for x in r["turns"][1:]]
        lat_without.append(r["without"]["ms"])
        used += r["turns"][-1]["used"]
    p50 = lambda xs: percentile(xs, 50) if xs else 0.0  # noqa: E731
    return headline(res, chain2) | {
        "session_latency_ratio_p50": round(p50(lat_with) / p50(lat_without), 3) if lat_without else None,
        "retrieve_ms_p50_with": round(p50(lat_with), 2), "retrieve_ms_p50_without": round(p50(lat_without), 2),
        "memory_stage_ms_p50": round(p50(mem_ms), 3),
        "memory_stage_ms_p95": round(percentile(mem_ms, 95), 3) if mem_ms else 0.0,
        "memory_used_fraction": round(used / kept, 3) if kept else None,
        "conversations": kept, "unresolved": len(convs) - kept,
    }


def log_summary(out: dict) -> None:
    for k, p in out["per_kind"].items():
        log(f"{k:14s} n={p['n']:3d} " + " ".join(f"{r} {p[r]}" for r in ROWS))
    log(f"follow-up top1 with {out['followup_top1_with']} without {out['followup_top1_without']} "
        f"oracle {out['followup_top1_oracle']} naive {out['followup_top1_naive']}; chain turn2 "
        f"{out['chain_turn2_top1_with']} turn3 {out['chain_turn3_top1_with']}; self-contained with "
        f"{out['selfcontained_top1_with']} without {out['selfcontained_top1_without']}; latency ratio p50 "
        f"{out['session_latency_ratio_p50']}; memory stage p95 {out['memory_stage_ms_p95']} ms")
