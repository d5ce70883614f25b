"""Builtin generator vs ``transformers serve`` (without and with ``--continuous-batching``): which
generator backend is the default (issue 12).

Same converted SmolLM2, same ~900-token prompt (the server's system prompt and source layout,
text from this repository's docs), greedy, ``--max-new-tokens`` new tokens:

* latency at concurrency 1 (``--c1-runs`` requests one after another);
* throughput at concurrency 4 (4 requests at once: the builtin decodes them as one static batch,
  the engine gets 4 concurrent streams through the server's openai backend);
* stability: whether every answer at concurrency 4 equals the answer alone.

Backends run one after another in one process run; the machine's load is recorded at the start
and end. Run from the repository root: ``python -m bench.engine_backends [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from . import _internals
from ._common import emit_json, log, machine_info, summarize

DOCS = ["README.md", "docs/architecture.md"]


def build_prompt(gen, target_tokens: int) -> tuple[str, str, str]:
    """``(system, user, rendered)`` with the rendered chat about ``target_tokens`` tokens."""
    from oprag_server.operators.context import SYSTEM_PROMPT

    root = Path(__file__).resolve().parents[1]
    text = "\n".join((root / d).read_text() for d in DOCS if (root / d).is_file())
    q = "\n\nQuestion: What does OpRAG do with a request before it generates an answer?"
    body = gen.truncate_to_tokens(text, target_tokens - gen.count_tokens(gen.chat_prompt(SYSTEM_PROMPT, "Sources:\n\n[1] Docs\n" + q)))
    user = f"Sources:\n\n[1] Docs\n{body.strip()}\n{q}"
    return SYSTEM_PROMPT, user, gen.chat_prompt(SYSTEM_PROMPT, user)


def bench_builtin(gen, prompt: str, max_new: int, c1_runs: int) -> dict:
    gen.generate([prompt], 2)  # warm-up
    lat, texts = [], []
    for _ in range(c1_runs):
        t = time.perf_counter()
        r = gen.generate([prompt], max_new)[0]
        lat.append(time.perf_counter() - t)
        texts.append(r.text)
    t = time.perf_counter()
    batch = gen.generate([prompt] * 4, max_new)
    wall = time.perf_counter() - t
    return {"c1": summarize(lat), "c1_tokens": r.completion_tokens, "c4_wall_s": round(wall, 2),
            "c4_req_per_s": round(4 / wall, 3), "c4_tokens": [b.completion_tokens for b in batch],
            "stable_batched_vs_alone": all(b.text == texts[0] for b in batch) and len(set(texts)) == 1,
            "answer": texts[0]}


async def _engine_runs(gen, system: str, user: str, max_new: int, c1_runs: int) -> dict:
    msgs = gen.chat_messages(system, user)

    async def one() -> tuple[float, float, str, object]:
        u, t, first = _internals.engine_usage(), time.perf_counter(), 0.0
        parts = []
        async for d in gen.stream(msgs, max_new, u):
            first = first or time.perf_counter() - t
            parts.append(d)
        return time.perf_counter() - t, first, "".join(parts), u

    await one()  # warm-up
    lat, ttft, texts = [], [], []
    for _ in range(c1_runs):
        dt, first, text, u = await one()
        lat.append(dt)
        ttft.append(first)
        texts.append(text)
    t = time.perf_counter()
    res = await asyncio.gather(*[one() for _ in range(4)])
    wall = time.perf_counter() - t
    await gen.aclose()
    return {"c1": summarize(lat), "c1_ttft": summarize(ttft), "c1_tokens": u.completion_tokens,
            "prompt_tokens": u.prompt_tokens, "c4_wall_s": round(wall, 2), "c4_req_per_s": round(4 / wall, 3),
            "c4_tokens": [r[3].completion_tokens for r in res],
            "stable_batched_vs_alone": all(r[2] == texts[0] for r in res) and len(set(texts)) == 1,
            "answer": texts[0]}


def bench_engine(model_dir: Path, system: str, user: str, max_new: int, c1_runs: int, cb: bool) -> dict:
    eng = _internals.managed_engine(model_dir, continuous_batching=cb, device="cpu",
                                    log_path=Path(os.environ.get("TMPDIR", "/tmp")) / f"engine-bench-cb{int(cb)}.log")
    t = time.perf_counter()
    eng.start()
    start_s = time.perf_counter() - t
    try:
        gen = _internals.openai_generator(eng.url, str(model_dir), tokenizer_dir=model_dir, max_inflight=4,
                                         timeout_s=1800.0)
        out = asyncio.run(_engine_runs(gen, system, user, max_new, c1_runs))
    finally:
        eng.stop()
    return {"engine_start_s": round(start_s, 1), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--c1-runs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    info = machine_info()
    gen = _internals.generator("smollm2", device="cpu")
    gen.warm_up()
    system, user, prompt = build_prompt(gen, a.prompt_tokens)
    n_prompt = gen.count_tokens(prompt)
    log(f"prompt: {n_prompt} tokens; load {os.getloadavg()}")
    out = {"prompt_tokens": n_prompt, "max_new_tokens": a.max_new_tokens, "machine": info}
    out["builtin"] = bench_builtin(gen, prompt, a.max_new_tokens, a.c1_runs)
    log("builtin", out["builtin"])
    model_dir = gen.cached_model_dir()
    del gen
    for cb in (False, True):
        key = "transformers_serve" + ("_cb" if cb else "")
        out[key] = bench_engine(model_dir, system, user, a.max_new_tokens, a.c1_runs, cb)
        log(key, out[key])
    out["same_answer_all_backends"] = len({out[k]["answer"] for k in ("builtin", "transformers_serve",
                                                                       "transformers_serve_cb")}) == 1
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    emit_json(out) if a.json else print(out)


if __name__ == "__main__":
    main()
