# kvtier: two commands on a fresh machine.
#   make run    create .venv, install, start a local cluster (master + 1 GiB segment) in the foreground
#   make test   create .venv, install with test extras, run the default suite (< 10 minutes)
# Others: make test-slow (soak/slow tests), make test-chaos (history checker under faults, ~10 min),
# make test-engines (engine adapters, own venv), make lint (ruff, import rules), make fuzz (atheris + long hypothesis runs),
# make proto, make bench.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow test-chaos test-chaos-ci test-engines fuzz lint proto proto-check bench clean

# The engine adapters' tests run in a venv of their own: torch's CPU build (pinned: otherwise pip
# fetches a CUDA build) and the engines without their dependency trees (tests/engines/*.txt).
ENGINES_VENV  := .venv-engines
ENGINES_STAMP := $(ENGINES_VENV)/.installed
ENGINES_PIP   := $(ENGINES_VENV)/bin/python -m pip install --quiet -c tests/engines/constraints.txt

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,ssd]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier up

# Two workers (pytest-xdist), one test file each at a time: the suite mostly waits on the processes
# it starts, so two run side by side in about half the time. A short --basetemp of its own keeps
# the Unix socket paths tests make under tmp_path within 107 bytes (xdist adds popen-gwN/).
# The trap removes it however the run ends (an interrupted run once left 3.6 GB behind per run).
test: $(STAMP)
	@tmp=$$(mktemp -d /tmp/kvt.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; trap 'exit 130' INT TERM HUP; \
	$(BIN)/python -m pytest -m "not slow and not chaos" -q --ignore=tests/engines -n 2 --dist loadfile \
		--basetemp=$$tmp/t

$(ENGINES_STAMP): pyproject.toml tests/engines/constraints.txt tests/engines/requirements.txt
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ENGINES_PIP) torch==2.13.0
	$(ENGINES_PIP) -e '.[test]'
	$(ENGINES_PIP) --no-deps sglang lmcache vllm
	$(ENGINES_PIP) -r tests/engines/requirements.txt
	touch $@

test-engines: $(STAMP) $(ENGINES_STAMP)
	$(ENGINES_VENV)/bin/python -m pytest -q tests/engines

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q --ignore=tests/engines

# The history checker's long run (tests/e2e/test_history.py): CHAOS_SECONDS of workers under every
# fault; a failing run's history and logs stay in $KVTIER_ARTIFACTS or .kvtier/chaos/<run>/.
# Then the network faults across test hosts (tests/e2e/test_net_chaos.py: root, ip, etcd; faketime
# for the clock tests in make test): NET_CHAOS_SECONDS of them, the soak (SOAK_SECONDS, a fault every
# SOAK_FAULT_EVERY_S; its plots in the artifacts directory it prints) and 1% loss throughput.
CHAOS_SECONDS ?= 600
NET_CHAOS_SECONDS ?= 300
SOAK_SECONDS ?= 1800
SOAK_FAULT_EVERY_S ?= 60
CHAOS_ENV = KVTIER_CHAOS_SECONDS=$(CHAOS_SECONDS) KVTIER_NET_CHAOS_SECONDS=$(NET_CHAOS_SECONDS) \
	KVTIER_SOAK_SECONDS=$(SOAK_SECONDS) KVTIER_SOAK_FAULT_EVERY_S=$(SOAK_FAULT_EVERY_S)
test-chaos: $(STAMP)
	$(CHAOS_ENV) $(BIN)/python -m pytest -m chaos -q -s -o timeout=$$(($(CHAOS_SECONDS) + 300)) tests/e2e

# The same, short enough for CI (under 10 minutes): `.ci/run` runs it.
test-chaos-ci: $(STAMP)
	$(MAKE) test-chaos CHAOS_SECONDS=90 NET_CHAOS_SECONDS=100 SOAK_SECONDS=120 SOAK_FAULT_EVERY_S=20

# ruff, then the import rules (import-linter contracts in pyproject.toml: proto <- common <-
# {master | segment_server | client} <- bench <- cli).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache --no-logo

proto: $(STAMP)
	$(BIN)/python proto/generate.py

proto-check: $(STAMP)
	$(BIN)/python proto/generate.py --check

bench: $(STAMP)
	$(BIN)/kvtier bench

# Coverage-guided fuzzing of the two frame parsers (atheris, libFuzzer flags after the harness),
# FUZZ_SECONDS each, then the hypothesis fuzz tests at FUZZ_SCALE times their default-suite budget
# (about 15 minutes in all on 2 cores).
# Findings land in .kvtier/fuzz/ (the failing input: replay it with the harness and its path).
FUZZ_SECONDS ?= 120
FUZZ_SCALE ?= 10
fuzz: $(STAMP)
	$(BIN)/python -m pip install --quiet 'atheris>=2.3'
	mkdir -p .kvtier/fuzz
	$(BIN)/python -m tests.fuzz.fuzz_fastpath -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=.kvtier/fuzz/fastpath-
	$(BIN)/python -m tests.fuzz.fuzz_segment_protocol -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=.kvtier/fuzz/segment-
	KVTIER_FUZZ_SCALE=$(FUZZ_SCALE) $(BIN)/python -m pytest -q -o timeout=3600 \
		tests/unit/master/test_fastpath_fuzz.py tests/unit/master/test_handlers_fuzz.py

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build *.egg-info .pytest_cache .ruff_cache
