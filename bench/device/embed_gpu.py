"""Ingest-embedding throughput of the server's encoder on a GPU: chunks per second.

Runs ``TransformersEncoder`` (the class ``oprag serve`` embeds with) on MiniLM-shaped weights
(``--encoder DIR``: bench/device/make_models.py writes random ones when the real weights are not
on the machine; the arithmetic is the same) over synthetic chunks of ``--tokens`` MiniLM tokens
(words drawn from the encoder's own vocabulary, seeded), in float32 and in bfloat16, at the
server's default batch size (32) and at a larger one. Each figure is the median of ``--rounds``
timed passes after one warm-up pass; tokenization (CPU) is timed apart from the forward passes.

    python -m bench.device.embed_gpu --encoder DIR --chunks 20000 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from bench import _internals


def synthetic_chunks(vocab_file: Path, n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``words`` whole-word vocabulary entries each (no ``##`` pieces)."""
    vocab = [w for w in vocab_file.read_text(encoding="utf-8").split("\n")
             if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choices(vocab, k=words)) for _ in range(n)]


def measure(enc_dir: str, device: str, dtype: str, batch: int, texts: list[str], tokens: int,
            rounds: int) -> dict:
    import torch

    enc = _internals.encoder(enc_dir, device=device, dtype=dtype, batch_size=batch)
    t = time.perf_counter()
    ids = enc.tokenize(texts, truncate=True)
    tok_s = time.perf_counter() - t
    ids = [s[:tokens] for s in ids]
    enc.encode_tokenized(ids[: batch * 4])  # warm-up (kernels, allocator)
    times = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        enc.encode_tokenized(ids)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"device": enc.device, "dtype": enc.dtype, "batch": batch, "chunks": len(ids),
            "tokens_per_chunk": statistics.mean(len(s) for s in ids),
            "forward_chunks_per_s": round(len(ids) / med, 1),
            "tokenize_chunks_per_s": round(len(ids) / tok_s, 1),
            "end_to_end_chunks_per_s": round(len(ids) / (med + tok_s), 1),
            "rounds_s": [round(x, 3) for x in times]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", required=True, help="encoder directory (config, tokenizer, weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per chunk (server --chunk-size)")
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    texts = synthetic_chunks(Path(a.encoder) / "vocab.txt", a.chunks, a.tokens)
    rows = [measure(a.encoder, a.device, dt, int(b), texts, a.tokens, a.rounds)
            for dt in a.dtypes.split(",") for b in a.batches.split(",")]
    best = {dt: max(r["forward_chunks_per_s"] for r in rows if r["dtype"] == dt) for dt in {r["dtype"] for r in rows}}
    out = {"embed_rows": rows, "embed_forward_chunks_per_s_best": best}
    if "bfloat16" in best and "float32" in best:
        out["embed_bf16_over_fp32"] = round(best["bfloat16"] / best["float32"], 2)
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
