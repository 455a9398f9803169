# kvtier: two commands on a fresh machine.
#   make run    create .venv, install, start a local cluster (master + 1 GiB segment) in the foreground
#   make test   create .venv, install with test extras, run the default suite (< 10 minutes)
# Others: make test-slow (soak/slow tests), make lint, make proto, make bench.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow lint proto proto-check bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,ssd]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier up

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q || [ $$? -eq 5 ]  # 5: no test is marked slow yet

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

proto: $(STAMP)
	$(BIN)/python proto/generate.py

proto-check: $(STAMP)
	$(BIN)/python proto/generate.py --check

bench: $(STAMP)
	$(BIN)/kvtier bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
