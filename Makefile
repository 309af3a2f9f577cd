PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run run-fleet test lint fmt proto clean vllm-env checkov-env clients-env prometheus-env

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: setup
	$(BIN)/skymesh up --config configs/local.yaml

# the same mesh with two active-active balancers per region (configs/local-fleet.yaml)
run-fleet: setup
	$(BIN)/skymesh up --config configs/local-fleet.yaml --state-dir .skymesh/run-fleet

# real vLLM (CPU build) for the tests marked `vllm`: its own venv, built once (~4 min),
# instant afterwards; when it cannot be built this says why and the vllm tests skip
vllm-env: setup
	$(BIN)/python -m skymesh.testing.vllm_env build

# checkov (pinned) for the terraform test: its own venv, built once, instant afterwards;
# when it cannot be built this says why and that test skips (tests never install anything)
checkov-env: setup
	$(BIN)/python -m skymesh.testing.checkov_env build

# the benchmark clients (docs/clients.md), pinned, on Python 3.12: openai, litellm, guidellm,
# aiperf in .venv-clients, inference-perf in .venv-inference-perf (its pins conflict with
# aiperf's); built once (~5-11 min), instant afterwards; when they cannot be built this says
# why and tests/test_clients.py skips (tests never install anything)
clients-env: setup
	$(BIN)/python -m skymesh.testing.clients_env build

# prometheus and promtool (Debian's package, unpacked into .prometheus/, nothing installed
# system-wide) for the observability tests; when it cannot be fetched they skip saying why
prometheus-env: setup
	$(BIN)/python -m skymesh.testing.prometheus_env fetch

test: setup vllm-env checkov-env clients-env prometheus-env
	$(BIN)/ruff check skymesh controller tests benchmarks
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check skymesh controller tests benchmarks

fmt: setup
	$(BIN)/ruff check --fix skymesh controller tests benchmarks
	$(BIN)/ruff format skymesh controller tests benchmarks

proto: setup
	$(BIN)/python -m skymesh.runtime.proto_build

clean:
	rm -rf $(VENV) build *.egg-info .vllm-venv .vllm-cache .venv-checkov .venv-clients .venv-inference-perf .prometheus
