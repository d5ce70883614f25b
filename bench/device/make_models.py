"""Write random-weight models for the GPU serving benchmark (bench/device/run.sh).

No weights can be downloaded on the device machine, and the benchmark measures time, not
answers, so both models get random weights of the real architectures' shapes:

* ``--llm``: a Llama model with Llama-3-8B's dimensions (hidden 4096, 32 layers, 32 query and 8
  key/value heads, MLP 14336, RoPE theta 500000; the published ``config.json`` of
  meta-llama/Meta-Llama-3-8B) and the vocabulary of the local SmolLM2 tokenizer (49,152 tokens
  instead of 128,256, which changes only the embedding and LM-head FLOPs: ~0.4 of 8 GFLOP per
  token). Same per-token FLOPs and KV-cache bytes per token as the real 8B model in the
  transformer blocks. Written in bfloat16 safetensors with the tokenizer and chat template.
  ``--tiny`` writes a 2-layer, 64-wide model of the same family for a CPU smoke run.
* ``--encoder``: all-MiniLM-L6-v2's architecture (BERT, 6 layers, hidden 384) with random weights
  and MiniLM's tokenizer, for the ingest-embedding throughput figure.

Usage: python bench/device/make_models.py --tokenizer .devcarry/llm-tokenizer --llm DIR
       --encoder-src .devcarry/encoder --encoder DIR [--tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

#: meta-llama/Meta-Llama-3-8B config.json (public model card), all but the vocabulary.
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
            rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)


def make_llm(tok_dir: Path, out: Path, tiny: bool, device: str) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    dims = TINY if tiny else LLAMA3_8B
    # EOS: a token id the random model is as unlikely to pick as any other; the benchmark wants
    # every answer to run to max_tokens so that generation time is the same in every setting.
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=len(tok) - 1, pad_token_id=tok.pad_token_id, **dims)
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # build in bfloat16: 16 GB, not 32, for the 8B shape
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="5GB")
    tok.save_pretrained(str(out))
    for f in ("chat_template.jinja",):
        if (tok_dir / f).is_file() and not (out / f).is_file():
            shutil.copy(tok_dir / f, out / f)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": len(tok) - 1,
           "pad_token_id": tok.pad_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"llm_dir": str(out), "llm_params": n_params, "llm_dims": dims, "vocab": len(tok),
            "llm_write_s": round(time.perf_counter() - t0, 1)}


def make_encoder(src: Path, out: Path) -> dict:
    import torch
    from transformers import BertConfig, BertModel

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    cfg = BertConfig.from_pretrained(str(src))
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(str(out))
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return {"encoder_dir": str(out), "encoder_write_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument("--encoder-src", type=Path, required=True)
    ap.add_argument("--encoder", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", choices=("both", "encoder", "llm"), default="both")
    a = ap.parse_args()
    info = make_encoder(a.encoder_src, a.encoder) if a.only != "llm" else {}
    if a.only != "encoder":
        info.update(make_llm(a.tokenizer, a.llm, a.tiny, a.device))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
