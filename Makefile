# Every target installs what it needs: a fresh clone needs only python3 (3.11) and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run lint test test-slow bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/orch run

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy orchestrator/core eventlog replay

test: $(STAMP) lint
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python -m pytest bench -p no:randomly -o addopts= --benchmark-only \
		--benchmark-json=bench/results/latest.json

clean:
	rm -rf $(VENV) runs
