#!/usr/bin/env bash
# GPU serving benchmark (issue 12, item 4): OpRAG in front of `transformers serve
# --continuous-batching` running a Llama-3-8B-shaped model in bfloat16 on one GPU.
#
# On a GPU machine without network (torch, transformers, grpcio present; the rest carried as
# wheels in .whl/, tokenizers in .devcarry/, both made by bench/device/prepare.sh):
#     OUT=/some/dir bash bench/device/run.sh
# A short re-measure of one setting (about 2.5 minutes):
#     OUT=/some/dir BUDGET_S=180 SKIP_EMBED=1 CONC=32 SERVING_EXTRA="--settings C=1 --duration 5
#       --warmup 2 --no-overload --cancels 0" bash bench/device/run.sh
# CPU smoke run of the same path (tiny 2-layer model, few chunks, short sweeps):
#     TINY=1 OUT=/tmp/oprag-dev bash bench/device/run.sh
#
# Steps (each under its own time limit; the whole run is budgeted at BUDGET_S, default 450 s):
#  1. install the carried wheels into /tmp/site (skipped when .whl/ is absent or NO_WHEELS=1)
#  2. write random weights: Llama-3-8B dimensions with SmolLM2's vocabulary, MiniLM-shaped encoder
#     (bench/device/make_models.py)
#     (meanwhile OpRAG's corpus is loaded in the background: bench.serving --ingest-only)
#  4. start `transformers serve --continuous-batching --dtype bfloat16` on the model, wait for
#     /health, warm it with one request
#  5. python -m bench.serving --engine-url ... (OpRAG started by the bench with
#     --generator openai, >= 100K chunks with vectors supplied by the bench)
#  3. (last, engine stopped) ingest-embedding throughput of the server's encoder, float32 vs
#     bfloat16 (SDPA) (python -m bench.device.embed_gpu)
#  6. merge everything into $OUT/gpu.json (one file; the step logs are next to it)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-/tmp/oprag-device-out}
mkdir -p "$OUT"
PY=${PY:-python3}
TINY=${TINY:-0}
BUDGET_S=${BUDGET_S:-450}
T0=$(date +%s)
WORK=${WORK:-/tmp/oprag-device-work}
mkdir -p "$WORK"
if [ "$TINY" = 1 ]; then
  DEVICE=cpu; CHUNKS=${CHUNKS:-3000}; EMBED_CHUNKS=40; EMBED_ARGS="--dtypes float32 --batches 8 --rounds 1"; CONC=${CONC:-1,4}; TINYFLAG=--tiny
  SHARDS=2; SERVING_EXTRA=${SERVING_EXTRA:---quick --settings A=8,C=2}
else
  DEVICE=cuda; CHUNKS=${CHUNKS:-100000}; EMBED_CHUNKS=10000; EMBED_ARGS="--rounds 2"; CONC=${CONC:-1,8,32,64}; TINYFLAG=
  SHARDS=4
  SERVING_EXTRA=${SERVING_EXTRA:---settings A=8,B=64,C=1 --duration 6 --warmup 2 --overload-duration 10 --cancels 10}
fi
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/steps.log"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

# 1. wheels
if [ -d .whl ] && [ "${NO_WHEELS:-0}" != 1 ]; then
  log "installing $(ls .whl | wc -l) carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { log "wheel install failed (see pip.log)"; tail -20 "$OUT/pip.log"; exit 2; }
  export PYTHONPATH=/tmp/site
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$ROOT/server:$ROOT/client:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
{
  date -u; uname -a; nproc; free -g | head -2
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, transformers, grpc, google.protobuf as pb, faiss, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__, 'faiss', faiss.__version__, 'numpy', numpy.__version__)"
} > "$OUT/env.txt" 2>&1
log "env: $(tail -1 "$OUT/env.txt")"
command -v transformers >/dev/null || { log "no 'transformers' command (transformers[serving] missing)"; exit 2; }

# 2. models: the encoder first (OpRAG's servers load it at start), then the LLM
LLM=$WORK/llm; ENC=$WORK/encoder
MM="$PY bench/device/make_models.py --tokenizer .devcarry/llm-tokenizer --llm $LLM --encoder-src .devcarry/encoder --encoder $ENC $TINYFLAG --device $DEVICE"
[ -f "$ENC/config.json" ] || timeout 60 $MM --only encoder > "$OUT/models_encoder.json" 2> "$OUT/models.log" \
  || { log "encoder weights failed"; tail -20 "$OUT/models.log"; exit 3; }
SRV_ARGS="--server-arg=--embedder --server-arg=$ENC"
# OpRAG's corpus is loaded in the background (CPU) while the models are written and the engine
# loads (GPU, disk); bench.serving below finds the data dir full and reuses it.
ENGINE_PORT=${ENGINE_PORT:-8765}
log "loading $CHUNKS chunks into OpRAG in the background ($SHARDS shards)"
$PY -m bench.serving --engine-url "http://127.0.0.1:$ENGINE_PORT/v1" --ingest-only --chunks $CHUNKS \
  --shards $SHARDS --ingest-streams 4 $SRV_ARGS > "$OUT/ingest.json" 2> "$OUT/ingest.log" &
INGEST_PID=$!
ENGINE_PID=
cleanup() { kill $INGEST_PID 2>/dev/null; [ -n "$ENGINE_PID" ] && { kill -- -$ENGINE_PID 2>/dev/null; kill $ENGINE_PID 2>/dev/null; }; }
trap cleanup EXIT

if [ ! -f "$LLM/config.json" ]; then
  log "writing random-weight models"
  timeout 240 $MM --only llm > "$OUT/models.json" 2>> "$OUT/models.log" \
    || { log "make_models failed"; tail -20 "$OUT/models.log"; exit 3; }
else
  echo '{"reused": true}' > "$OUT/models.json"
fi
log "models: $(cat "$OUT/models.json" | head -c 300)"

# 4. the engine
log "starting transformers serve --continuous-batching on $DEVICE"
DEV_ARG=cuda:0; [ "$DEVICE" = cpu ] && DEV_ARG=cpu
setsid transformers serve "$LLM" --host 127.0.0.1 --port $ENGINE_PORT --device $DEV_ARG --dtype bfloat16 \
  --continuous-batching --model-timeout 3600 --log-level warning > "$OUT/engine.log" 2>&1 &
ENGINE_PID=$!
for i in $(seq 1 120); do
  curl -s -m 2 "http://127.0.0.1:$ENGINE_PORT/health" >/dev/null && break
  kill -0 $ENGINE_PID 2>/dev/null || { log "engine exited"; tail -30 "$OUT/engine.log"; exit 4; }
  sleep 1
done
T=$(date +%s)
curl -s -m 240 "http://127.0.0.1:$ENGINE_PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d "{\"model\":\"$LLM\",\"messages\":[{\"role\":\"user\",\"content\":\"warm up\"}],\"max_tokens\":4}" \
  > "$OUT/engine_warm.json" || { log "engine warm-up failed"; tail -30 "$OUT/engine.log"; exit 4; }
log "engine warm in $(( $(date +%s) - T )) s: $(head -c 200 "$OUT/engine_warm.json")"
# warm the engine's batch shapes too (continuous batching allocates/captures per size): bursts of
# 64 and 8 concurrent ~400-token prompts before anything is measured
T=$(date +%s)
LONG=$(printf 'retrieved passage text about the subject %.0s' $(seq 1 60))
for burst in 64 8; do
  PIDS=
  for i in $(seq 1 $burst); do
    curl -s -m 120 "http://127.0.0.1:$ENGINE_PORT/v1/chat/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"$LLM\",\"messages\":[{\"role\":\"user\",\"content\":\"$i $LONG\"}],\"max_tokens\":8}" >/dev/null &
    PIDS="$PIDS $!"
  done
  wait $PIDS  # only the curls: the engine and the ingest are background jobs too
done
log "engine burst warm-up in $(( $(date +%s) - T )) s"

# 5. OpRAG in front of the engine
wait $INGEST_PID || log "background ingest failed (see ingest.log)"
log "ingest: $(tail -c 300 "$OUT/ingest.json")"
RESERVE=60; [ "${SKIP_EMBED:-0}" = 1 ] && RESERVE=8
LIMIT=$(( $(left) - RESERVE ))  # leaves ~45 s for the embedding figure (unless skipped) and the JSON
log "bench.serving --engine-url ($CHUNKS chunks, concurrency $CONC, limit ${LIMIT} s)"
timeout $LIMIT $PY -m bench.serving --engine-url "http://127.0.0.1:$ENGINE_PORT/v1" --engine-model "$LLM" \
  --chunks $CHUNKS --shards $SHARDS --concurrency $CONC --json "$OUT/serving.json" $SERVING_EXTRA $SRV_ARGS \
  > "$OUT/serving.log" 2>&1 || log "bench.serving failed or timed out (rc $?; see serving.log)"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$OUT/env.txt" 2>/dev/null

# 3. ingest embedding on the device (after the serving run: the engine is stopped first, and
#    the serving figures come first if time runs short)
if [ "${SKIP_EMBED:-0}" != 1 ]; then
log "embedding throughput ($EMBED_CHUNKS chunks)"
EMBED_LIMIT=$(( $(left) > 100 ? 100 : $(left) ))
kill -- -$ENGINE_PID 2>/dev/null; kill $ENGINE_PID 2>/dev/null; ENGINE_PID=; sleep 3
timeout $EMBED_LIMIT $PY -m bench.device.embed_gpu --encoder "$ENC" --device "$DEVICE" --chunks $EMBED_CHUNKS $EMBED_ARGS \
  --json "$OUT/embed.json" > "$OUT/embed.log" 2>&1 || log "embed_gpu failed or timed out (see embed.log)"
log "embed: $(grep -o '"embed_forward_chunks_per_s_best".*' "$OUT/embed.json" 2>/dev/null | head -c 200)"
fi

# 6. one JSON
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {"env": (out / "env.txt").read_text(errors="replace").splitlines()}
for name in ("models", "embed", "ingest", "serving", "engine_warm"):
    p = out / f"{name}.json"
    try:
        txt = p.read_text().strip()
        res[name] = json.loads(txt.splitlines()[-1] if name == "ingest" else txt)
    except Exception as e:  # noqa: BLE001 - a missing step is reported, not fatal
        res[name] = {"error": f"{type(e).__name__}: {e}"}
res["steps"] = (out / "steps.log").read_text().splitlines()
(out / "gpu.json").write_text(json.dumps(res, indent=1))
print("wrote", out / "gpu.json")
PY
log "done"
