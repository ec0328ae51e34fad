# The project's commands. `make install` is idempotent and fast when nothing changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-unit test-integration lint demo bench clean

install:
	@bash packaging/install.sh

# The whole suite: lint, unit tests, integration tests (real horovodrun processes).
test: install lint
	@$(PY) -m pytest $(PYTEST_ARGS)

test-unit: install
	@$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: install
	@$(PY) -m pytest tests/integration $(PYTEST_ARGS)

lint: install
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy
	@$(VENV)/bin/hadolint Dockerfile docker/*.Dockerfile

demo: install
	@echo "make demo: not yet: the end-to-end demo (Spark preprocessing + hybrid-parallel"
	@echo "training under horovodrun) lands with the training and launch issues."
	@echo "What works today: synthetic data and the loader, e.g."
	@echo "  $(PY) -m dataloading.synthetic --output_dir /tmp/dlrm_synthetic"
	@echo "  $(PY) benchmarks/loader.py"
	@exit 1

bench: install
	@$(PY) benchmarks/loader.py
	@$(PY) benchmarks/train.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
