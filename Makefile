# The two commands the README promises on a fresh machine:
#   make run    set up, then train the default model on the embedded digits with 2 local workers
#   make test   set up (Python deps; Slurm packages for the testbed tier), lint, then every test tier
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-fast lint setup

$(BIN)/raytrain: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@

setup: $(BIN)/raytrain

run: setup
	$(BIN)/raytrain fit --workers 2

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/shellcheck $$(git ls-files '*.sh' '*.sbatch' '.ci/run')

# Every tier: unit, real local Ray, slow end-to-end, and the Slurm testbed.
test: setup lint
	$(BIN)/python -m pytest -m 'slow or not slow'

# The default tier only (seconds to a few minutes): no slow end-to-end runs, no Slurm testbed.
test-fast: setup
	$(BIN)/python -m pytest
