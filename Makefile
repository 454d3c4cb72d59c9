# The two commands the README promises on a fresh machine:
#   make run    set up, then train the default model on the embedded digits with 2 local workers
#   make test   set up (Python deps; Debian's Slurm for the testbed tier, as root), lint, every test tier
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Debian's Slurm for the testbed; for its monitoring test, Prometheus (the job's own), ssh servers on the
# login and head nodes for the dashboard's tunnel, and headless Chromium with its WebDriver; for its
# container test, Podman (with runc: crun refuses hybrid cgroups) and mmdebstrap to build the image.
SLURM_PACKAGES := munge slurmctld slurmd slurm-client iproute2 prometheus openssh-server openssh-client \
  chromium chromium-driver podman runc mmdebstrap

.PHONY: run test test-fast lint setup system-deps testbed-up testbed-down

$(BIN)/raytrain: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,bench,mlflow]'
	touch $@

# The tests' MLflow tracking server (tests/mlflow_server.py), in an environment of its own as a site's would be:
# the full MLflow package pins a pyarrow that raytrain's does not take.
MLFLOW_SERVER := .mlflow-server/bin/mlflow
$(MLFLOW_SERVER):
	$(PYTHON) -m venv .mlflow-server
	.mlflow-server/bin/pip install -q mlflow==3.17.2
	touch $@

# Byte-compiled once here: an editable install leaves raytrain's modules to be compiled again by every
# process that imports them when PYTHONDONTWRITEBYTECODE is set (about 0.3 s of CPU each: driver, Ray
# Train's controller, every worker).
setup: $(BIN)/raytrain
	$(BIN)/python -m compileall -q raytrain

run: setup
	$(BIN)/raytrain fit --workers 2

# Debian's Slurm daemons for the multi-node testbed (tests/testbed); needs root.
system-deps:
	@if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! command -v sinfo >/dev/null \
	  || ! command -v prometheus >/dev/null || ! command -v sshd >/dev/null || ! command -v chromedriver >/dev/null \
	  || ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make: the Slurm testbed needs root and: apt-get install $(SLURM_PACKAGES)" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null; \
	fi

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/shellcheck $$(git ls-files --cached --others --exclude-standard '*.sh' '*.sbatch' '.ci/run')

# Every tier: unit, real local Ray, slow end to end, and the 4-node Slurm testbed (torn down afterwards).
# The three installs run at once (each mostly waits on downloads and disk), lint once raytrain's is done: on a
# fresh machine that is about two minutes of the suite's time limit.
test:
	$(MAKE) --no-print-directory -j3 lint system-deps $(MLFLOW_SERVER)
	$(BIN)/python -m pytest -m 'slow or not slow' --durations=15; rc=$$?; $(BIN)/python tests/testbed/testbed.py down; exit $$rc

# The default tier only (a few minutes): no slow end-to-end runs, no Slurm testbed.
test-fast: setup $(MLFLOW_SERVER)
	$(BIN)/python -m pytest

testbed-up: setup system-deps
	$(BIN)/python tests/testbed/testbed.py up

testbed-down:
	$(BIN)/python tests/testbed/testbed.py down
