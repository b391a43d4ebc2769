# Everything a fresh machine needs. `make demo` runs the main job; `make test` runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 lies on the project's build machines; elsewhere pip fetches it from PyPI.
# Users with their own CUDA build can pass TORCH= (empty) to keep the torch they have.
TORCH ?= torch==2.13.0
# Two pytest workers keep the 2-core CI machine 93% busy (a third gained 2.5%, the slow tests a median 1.38× slower
# beside each other); the Slurm tests stay on one worker (tests/conftest.py).
PYTEST_WORKERS ?= 2

.PHONY: setup demo test lint slurm-cluster clean-runs

setup: $(VENV)/.installed data/shakespeare.txt

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile $(TORCH) -e '.[dev]'
	@# pip compiles what it installs on one core (48 s of a 2-core VM's setup); compileall spreads the same
	@# bytecode over every core. A file that does not compile is left out, as pip leaves it out.
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
	touch $@

data/shakespeare.txt: | $(VENV)/.installed
	$(PY) scripts/fetch_shakespeare.py $@

demo: setup
	$(VENV)/bin/cona run --profile slurm/profiles/local-cpu.yaml --job examples/tiny-gpt.yaml

slurm-cluster:
	@if [ -x slurm/local-cluster.sh ]; then slurm/local-cluster.sh start; fi

# Each phase prints its wall time (scripts/timed.sh), so a slow step is visible in a CI log.
test:
	@scripts/timed.sh setup $(MAKE) --no-print-directory setup
	@scripts/timed.sh "cluster start" $(MAKE) --no-print-directory slurm-cluster
	@scripts/timed.sh ruff $(VENV)/bin/ruff check .
	@scripts/timed.sh pytest $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check orchestrator trainer tests benchmarks || true

clean-runs:
	rm -rf runs
