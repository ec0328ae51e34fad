# The project's commands. `make install` is idempotent and fast when nothing changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers, a test file each at a time (0: one process, in order).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
DEMO_ARGS ?=

.PHONY: install test test-unit test-integration lint demo demo-incremental bench gpu-check clean

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

# Proves the GPU paths on this machine: the default model fp32, --amp, --xla and
# --amp --xla (samples/s, peak memory, a falling finite loss), the GPU's weights
# against the CPU's, DLRM-DCNv2's AUC, an export scored on the CPU, the plain loop
# beside ours. Without a GPU, the CPU path's checks, said so. Table and
# benchmarks/gpu_check.json (GPU_CHECK_ARGS=--small: CI's size, about 2 minutes).
GPU_CHECK_ARGS ?=
gpu-check: install
	@$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
