"""Would a gate that skips the ANN check for queries near the corpus keep dense Recall@10? (issue 13,
session 49: the check costs 0.8-1.4 ms of the 1M served p50; bench/RESULTS.md "Session 49").

In process, on each shard of a data dir that ``bench.scale`` left (loaded from its snapshot), for
query vectors of many generators, the shard's dense top-10 is compared with the exact one (every
live vector scored): the list as the HNSW walk finds it (``never``), the list after the check and
its widening (``always``, what the server does), and for a gate: the walk's list where the gate
skips the check, the checked list elsewhere. The gate's statistic is computed from a fixed
sixteenth of the check's own sample (its chunks' id hashes below a lower threshold): ``z`` =
(the list's 64th score - the sub-sample's mean score) / their standard deviation; ``zt``: the
same with the sub-sample's best score in place of the mean; ``+hit``: the check also runs when
a sub-sample chunk above the 64th score is missing from the list.

Generators (100 queries each by default): the MiniLM vectors of ``bench._common.probe_texts``
(SciFact questions, WikiText sentences, SciFact sentences, keywords, one word, random letters,
SciFact passages) and vectors made from the shard's own: a chunk's vector plus Gaussian noise of
norm 0.02-1 (``perturb<s>``), the normalised sum of 2 or 4 random chunks' vectors (``mix2``,
``mix4``), uniform random directions, negated chunk vectors, the corpus mean plus small noise,
and sparse random directions.

    python -m bench.check_gate_probe --data-dir bench/out/scale-1000000-hnsw --json
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from . import _internals
from ._common import emit_json, log, machine_info, probe_texts, shard_probe_args

TEXTS = ("scifact", "terms", "term", "nonwords", "wikitext", "passages")
RULES = {"z>=4.5": lambda f: f["z"] >= 4.5, "z>=5": lambda f: f["z"] >= 5.0, "z>=5.5": lambda f: f["z"] >= 5.5,
         "z>=5+hit": lambda f: f["z"] >= 5.0 and not f["hit"], "zt>=1+hit": lambda f: f["zt"] >= 1.0 and not f["hit"],
         "zt>=1.5+hit": lambda f: f["zt"] >= 1.5 and not f["hit"]}


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _generators(texts: dict, dense, n: int, rng) -> dict:
    live = dense.slots
    vec = lambda k: np.asarray(dense.vectors_of(rng.choice(live, k)), np.float32)  # noqa: E731
    d = dense.dim
    g = dict(texts)
    base = vec(n)
    for s in (0.02, 0.1, 0.35, 1.0):
        g[f"perturb{s}"] = _unit(base + s * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d))
    g["mix2"] = _unit(vec(n) + vec(n))
    g["mix4"] = _unit(vec(n) + vec(n) + vec(n) + vec(n))
    g["uniform"] = _unit(rng.standard_normal((n, d)))
    g["negated"] = -base
    g["mean+noise"] = _unit(vec(4096).mean(0)[None] + 0.03 * rng.standard_normal((n, d)))
    g["sparse"] = _unit(np.where(rng.random((n, d)) < 0.02, rng.standard_normal((n, d)), 0) + 1e-6)
    return g


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shard_probe_args(ap, queries=100, shards=True)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    _internals.one_thread()
    from oprag_server.shards import ann_check as A

    texts = {s: _internals.query_vectors(probe_texts(s, a.queries, a.shared), a.vectors if s == "scifact" else "")
             for s in TEXTS}
    per = []
    for shard in range(a.shards):
        st = _internals.shard_state(a.data_dir, shard, a.dense_index)
        st.search.warm()
        S, dense = st.search, st.store.dense
        ck = A.check_of(S)
        ck._current(dense, st.store)  # noqa: SLF001
        rows = ck._rows  # noqa: SLF001
        sub = ck._live & (ck._h[rows.slots] < A.threshold(ck._j + 4 * A.STEPS))  # noqa: SLF001 - a sixteenth
        log(f"shard {shard}: {len(dense)} chunks, check sample {int(ck._live.sum())}, sub-sample {int(sub.sum())}")  # noqa: SLF001
        for name, qs in _generators(texts, dense, a.queries, np.random.default_rng(7 + shard)).items():
            for q in np.asarray(qs, np.float32):
                q = np.ascontiguousarray(q)
                exact = dense.score_all(q[None])[0]
                want = set(dense.slots[np.argpartition(-exact, 10)[:10]].tolist())
                raw = S._dense_tops(q[None], [0], 256, check=False)[0]  # noqa: SLF001
                chk = S._dense_tops(q[None], [0], 256, check=True)[0]  # noqa: SLF001
                cut = float(raw[1][min(raw[0].size, A.TOP) - 1])
                sc = rows.i8.scores(q, None)
                s = np.sort(sc[sub]).astype(np.float64)
                sd = max(float(s.std()), 1e-12)
                hit = bool(((sc[sub] > cut) & ~np.isin(rows.slots[sub], raw[0])).any())
                per.append({"gen": name, "z": (cut - s.mean()) / sd, "zt": (cut - s[-1]) / sd, "hit": hit,
                            "never": len(want & set(raw[0][:10].tolist())) / 10,
                            "always": len(want & set(chk[0][:10].tolist())) / 10})
        del st, S, dense, ck
    table, worst = {}, collections.defaultdict(float)
    for name in dict.fromkeys(f["gen"] for f in per):
        fs = [f for f in per if f["gen"] == name]
        row = {"queries": len(fs), "never": round(float(np.mean([f["never"] for f in fs])), 4),
               "always": round(float(np.mean([f["always"] for f in fs])), 4)}
        for r, rule in RULES.items():
            rec = float(np.mean([f["never"] if rule(f) else f["always"] for f in fs]))
            row[r] = {"recall_change": round(rec - row["always"], 4), "skipped": round(float(np.mean([rule(f) for f in fs])), 2)}
            worst[r] = min(worst[r], rec - row["always"])
        table[name] = row
        log(name, row)
    out = {"generators": table, "worst_change": {r: round(v, 4) for r, v in worst.items()}, "machine": machine_info()}
    log("worst change", out["worst_change"])
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
