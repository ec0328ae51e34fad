# The project's commands. `make install` is idempotent and fast when nothing changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers, a test file each at a time (0: one process, in order).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
DEMO_ARGS ?=

.PHONY: install test test-unit test-integration lint demo demo-incremental bench clean

install:
	@bash packaging/install.sh

# The whole suite: lint, unit tests, integration tests (real horovodrun processes).
test: install lint
	@$(PYTEST) $(PYTEST_ARGS)

test-unit: install
	@$(PYTEST) tests/unit $(PYTEST_ARGS)

test-integration: install
	@$(PYTEST) tests/integration $(PYTEST_ARGS)

lint: install
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy
	@$(VENV)/bin/hadolint Dockerfile docker/*.Dockerfile

# The product end to end: click log -> Spark preprocessing -> horovodrun -np 2 training
# -> AUC, checkpoint, SavedModel; outputs in demo_output/ (about 80 s on 2 cores once
# installed).
demo: install
	@$(PY) examples/demo.py $(DEMO_ARGS)

# Day-by-day training on a drifting click log: each day preprocessed with the day
# before's vocabulary and trained warm from yesterday's checkpoint, beside a model
# retrained from scratch and one never updated (docs/incremental.md).
demo-incremental: install
	@$(PY) examples/incremental_demo.py $(DEMO_ARGS)

# The benchmark suite: ours against a plain TensorFlow loop and each target against the
# machine's matmul peak, in one run (about an hour on 2 cores; BENCH_ARGS=--quick for a
# few minutes). Table, targets, benchmarks/results.json, docs/bench_batch_size.png.
BENCH_ARGS ?=
bench: install
	@$(PY) benchmarks/suite.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
